"""The Triton kernel of :func:`attnviz.flow.contributions.attention_raw_triton` (imported on first use, so Triton
is optional and ``TRITON_INTERPRET`` is read when the kernel is first needed).

One program is one (head, BM queries, BN keys) tile of a layer's raw contributions. It reads the tile's weights
``a = c_i · A_ij`` once, finishes the linear part ``a · lin`` (``lin = (s_i W̃)·v_j``, one matrix product made
before), and subtracts the exact correction ``2 Σ_d max(a s_d w_jd − |y_d|, 0)`` over every dimension d of the
stream, one dimension at a time: per dimension a column of signs and sizes (BM), a row of writes (BN) and three
elementwise operations on the tile, nothing reduced across threads. A block of BD dimensions is skipped when no
(query, dimension) pair in it can pass the stream: the row's heaviest weight in the tile times the largest write
along the stream's sign (``hi`` / ``lo``) does not reach ``|y_d|``. That test is the compiled CPU loop's bound
(attnviz.flow.kernel), taken a block at a time; the sum is the same sum, every term that can be non-zero included,
in another order (``SKIP`` off: every block, the cost whatever the numbers are). A tile whose weights are all zero
(above a causal diagonal) writes zeros and reads nothing else. Signs and sizes come transposed, (D, n_q), so a
dimension's column is one contiguous read."""

import triton
import triton.language as tl


@triton.jit
def raw_tile(out_ptr, lin_ptr, probs_ptr, c_ptr, written_ptr, sign_ptr, size_ptr, hi_ptr, lo_ptr,
             n_q, n_kv, width,
             BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, SKIP: tl.constexpr):
    head = tl.program_id(0)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    cols = tl.program_id(2) * BN + tl.arange(0, BN)
    row_ok = rows < n_q
    col_ok = cols < n_kv
    ok = row_ok[:, None] & col_ok[None, :]
    at = head.to(tl.int64) * n_q * n_kv + rows[:, None].to(tl.int64) * n_kv + cols[None, :]
    c = tl.load(c_ptr + rows, mask=row_ok, other=0.0)
    a = tl.load(probs_ptr + at, mask=ok, other=0.0) * c[:, None]
    heaviest = tl.max(a, axis=1)  # (BM,)
    raw = tl.zeros([BM, BN], tl.float32)
    if tl.max(heaviest, axis=0) > 0:
        raw = tl.load(lin_ptr + at, mask=ok, other=0.0) * a
        corr = tl.zeros([BM, BN], tl.float32)
        dims0 = tl.arange(0, BD)
        written = written_ptr + head.to(tl.int64) * width * n_kv  # past 2^31 at 10k tokens of a 14B model
        for d0 in range(0, width, BD):
            dims = d0 + dims0
            dim_ok = dims < width
            pair = dims[None, :] * n_q + rows[:, None]  # (BM, BD) in the transposed (D, n_q) layout
            pair_ok = row_ok[:, None] & dim_ok[None, :]
            size = tl.load(size_ptr + pair, mask=pair_ok, other=0.0)
            sign = tl.load(sign_ptr + pair, mask=pair_ok, other=0.0)
            hi = tl.load(hi_ptr + head * width + dims, mask=dim_ok, other=0.0)
            lo = tl.load(lo_ptr + head * width + dims, mask=dim_ok, other=0.0)
            bound = tl.where(sign > 0, hi[None, :], -lo[None, :])  # the largest write along the stream's sign
            passes = tl.max(tl.max(tl.where(pair_ok, heaviest[:, None] * bound - size, -1.0), axis=1), axis=0) > 0
            if passes or not SKIP:  # a key of this tile may pass the stream somewhere in these dimensions
                for d in range(d0, tl.minimum(d0 + BD, width)):
                    s_d = tl.load(sign_ptr + d * n_q + rows, mask=row_ok, other=0.0)
                    y_d = tl.load(size_ptr + d * n_q + rows, mask=row_ok, other=0.0)
                    w_d = tl.load(written + d * n_kv + cols, mask=col_ok, other=0.0)
                    corr += tl.maximum(a * (s_d[:, None] * w_d[None, :]) - y_d[:, None], 0.0)
        raw = tl.maximum(raw - 2.0 * corr, 0.0)
    tl.store(out_ptr + at, raw, mask=ok)

