"""The fused statistics route (issue 14 §2): one Triton kernel computes a layer's sink statistics and
pooled maps straight from Q and K, without writing a single probability to memory.

Why this route. On a GPU the block engine's statistics are memory-bound: every fp32 block of scores
is written, then read and rewritten by about ten elementwise passes (mask, max, exp, sum, divide,
entropy, column sums, pooling, the cast for P·V). At 32k tokens on a Llama-3-8B shape that is ~40 TB
of traffic, ten times the SDPA forward. The alternative the issue names, SDPA for the output plus a
torch pass over the log-sum-exp, saves only the max/sum/divide passes. A kernel keeps each 64 × 64
tile of scores in registers: pass 1 finds each row's log-sum-exp (as flash attention does), pass 2
recomputes the tile and accumulates every statistic from it, so the cost is two QKᵀ products,
compute-bound like the forward itself. The layer output then comes from SDPA (flash/efficient
kernels), which is what the model runs anyway.

Which layers take it: a recorded layer of a statistics capture (``capture(reduce=True)``) on a CUDA
device with Triton available, batch 1, no StableMask/SM-I pseudo-logits, learned sinks, softcapping or
position bias (those keep the block engine, which handles every case). ``ATTNVIZ_FUSED=0`` turns the
route off; ``ATTNVIZ_FUSED=1`` forces it on any device, which with ``TRITON_INTERPRET=1`` runs the
kernel in Triton's interpreter on the CPU: that is how the tests check it against the definitions
(SPEC §6) on a machine without a GPU.

The kernel's outputs per head: row sums, Σ p·log p, the diagonal, key 0's probability and the
delimiter share per query; column sums per key (atomic adds across query blocks); and max-pooled
maps of the probabilities (and, when asked, of A·‖W_O v‖ and of the allowed scores) by atomic max on
the pooled grid. Pooling factors are multiples of the kernel's pooling granularity G (a power of
two up to 16) by :func:`attnviz.reduce.pool_factor`. What is computed from these (alpha, entropy
normalised, allocation, ...) is :class:`attnviz.reduce.LayerSummary`'s own code, shared with the
block engine.
"""

from __future__ import annotations

import functools
import os

import torch

BLOCK_M = 64  # query rows per program
BLOCK_N = 64  # keys per tile


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def wanted(device: torch.device) -> bool:
    """Whether recorded layers on ``device`` take the fused route (see the module docstring)."""
    setting = os.environ.get("ATTNVIZ_FUSED", "")
    if setting == "0":
        return False
    if setting == "1":
        return available()
    return device.type == "cuda" and available()


def granularity(factor: int) -> int:
    """The pooling granularity G the kernel reduces a tile to before its atomic max: a power of two
    dividing the pooling factor, at most 16."""
    g = 1
    while g < 16 and factor % (2 * g) == 0:
        g *= 2
    return g


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def layer_stats(q_ptr, k_ptr, allow_ptr, ranges_ptr, delim_ptr, norms_ptr,
                    rowsum_ptr, plogp_ptr, diag_ptr, key0_ptr, delimacc_ptr, colsum_ptr,
                    pooled_ptr, pooled_value_ptr, pooled_scores_ptr,
                    n_q, n_kv, dim, group, scale, q_offset, factor, pooled_rows, pooled_cols,
                    stride_qh, stride_qn, stride_kh, stride_kn,
                    BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                    POOL: tl.constexpr, VALUE: tl.constexpr, SCORES: tl.constexpr, PRECISION: tl.constexpr):
        block = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // group
        rows = block * BM + tl.arange(0, BM)
        dims = tl.arange(0, D)
        row_ok = rows < n_q
        q = tl.load(q_ptr + head * stride_qh + rows[:, None] * stride_qn + dims[None, :],
                    mask=row_ok[:, None] & (dims[None, :] < dim), other=0.0)
        k_lo = tl.load(ranges_ptr + 2 * block)
        k_hi = tl.load(ranges_ptr + 2 * block + 1)
        k_lo = (k_lo // BN) * BN  # tiles on the global BN grid: pooled cells stay aligned
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        # pass 1: every row's log-sum-exp over its allowed keys (online, as flash attention)
        for start in range(k_lo, k_hi, BN):
            cols = start + tl.arange(0, BN)
            col_ok = cols < n_kv
            k = tl.load(k_ptr + kv_head * stride_kh + cols[:, None] * stride_kn + dims[None, :],
                        mask=col_ok[:, None] & (dims[None, :] < dim), other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            ok = tl.load(allow_ptr + rows[:, None].to(tl.int64) * n_kv + cols[None, :],
                         mask=row_ok[:, None] & col_ok[None, :], other=0) != 0
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
            m_i = m_new
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), 0.0)
        # pass 2: the probabilities tile by tile, every statistic accumulated from registers
        rowsum = tl.zeros([BM], tl.float32)
        plogp = tl.zeros([BM], tl.float32)
        diag = tl.zeros([BM], tl.float32)
        key0 = tl.zeros([BM], tl.float32)
        delim_acc = tl.zeros([BM], tl.float32)
        for start in range(k_lo, k_hi, BN):
            cols = start + tl.arange(0, BN)
            col_ok = cols < n_kv
            k = tl.load(k_ptr + kv_head * stride_kh + cols[:, None] * stride_kn + dims[None, :],
                        mask=col_ok[:, None] & (dims[None, :] < dim), other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            ok = tl.load(allow_ptr + rows[:, None].to(tl.int64) * n_kv + cols[None, :],
                         mask=row_ok[:, None] & col_ok[None, :], other=0) != 0
            x = s - lse[:, None]
            p = tl.where(ok, tl.exp(x), 0.0)
            rowsum += tl.sum(p, axis=1)
            plogp += tl.sum(tl.where(p > 0, p * x, 0.0), axis=1)
            diag += tl.sum(tl.where(cols[None, :] == rows[:, None] + q_offset, p, 0.0), axis=1)
            key0 += tl.sum(tl.where(cols[None, :] == 0, p, 0.0), axis=1)
            d = tl.load(delim_ptr + cols, mask=col_ok, other=0.0)
            delim_acc += tl.sum(p * d[None, :], axis=1)
            tl.atomic_add(colsum_ptr + head * n_kv + cols, tl.sum(p, axis=0), mask=col_ok, sem="relaxed")
            if POOL:
                cell_r = (block * BM + tl.arange(0, BM // G) * G) // factor
                cell_c = (start + tl.arange(0, BN // G) * G) // factor
                cell_ok = (cell_r[:, None] < pooled_rows) & (cell_c[None, :] < pooled_cols)
                where = head * pooled_rows * pooled_cols + cell_r[:, None] * pooled_cols + cell_c[None, :]
                tile = tl.max(tl.max(tl.reshape(p, (BM // G, G, BN // G, G)), axis=3), axis=1)
                tl.atomic_max(pooled_ptr + where, tile, mask=cell_ok, sem="relaxed")
                if VALUE:
                    nv = tl.load(norms_ptr + head * n_kv + cols, mask=col_ok, other=0.0)
                    tile = tl.max(tl.max(tl.reshape(p * nv[None, :], (BM // G, G, BN // G, G)), axis=3), axis=1)
                    tl.atomic_max(pooled_value_ptr + where, tile, mask=cell_ok, sem="relaxed")
                if SCORES:
                    masked = tl.where(ok, s, float("-inf"))
                    tile = tl.max(tl.max(tl.reshape(masked, (BM // G, G, BN // G, G)), axis=3), axis=1)
                    tl.atomic_max(pooled_scores_ptr + where, tile, mask=cell_ok, sem="relaxed")
        out = head * n_q + rows
        tl.store(rowsum_ptr + out, rowsum, mask=row_ok)
        tl.store(plogp_ptr + out, plogp, mask=row_ok)
        tl.store(diag_ptr + out, diag, mask=row_ok)
        tl.store(key0_ptr + out, key0, mask=row_ok)
        tl.store(delimacc_ptr + out, delim_acc, mask=row_ok)

    return layer_stats


def layer_statistics(query: torch.Tensor, key: torch.Tensor, allow: torch.Tensor, ranges: torch.Tensor,
                     scaling: float, delim: torch.Tensor, pool_factor: int | None = None,
                     pooled_shape: tuple[int, int] | None = None, norms: torch.Tensor | None = None,
                     scores: bool = False, block: tuple[int, int] = (BLOCK_M, BLOCK_N)) -> dict[str, torch.Tensor]:
    """Raw per-row, per-column and pooled sums of one layer (batch of one) on the layer's device.

    ``query`` (H, n_q, d), ``key`` (H_kv, n_kv, d), ``allow`` (n_q, n_kv) bool, ``ranges`` the
    (blocks, 2) key range of every block of ``block[0]`` query rows (the engine's ``_block_ranges``),
    ``delim`` (n_kv,) delimiter flags, ``norms`` (H, n_kv) value norms for pooled A·‖W_O v‖.
    Returns fp32 ``rowsum``, ``plogp`` (Σ p·log p), ``diag``, ``key0``, ``delim`` (H, n_q),
    ``colsum`` (H, n_kv) and, with a pool, ``pooled`` (and ``pooled_value`` / ``pooled_scores``)
    (H, rows, cols), NaN-free: cells no query may see hold 0 (-inf for scores).
    """
    bm, bn = block
    heads, n_q, dim = query.shape
    n_kv = key.shape[1]
    device = query.device
    f32 = {"dtype": torch.float32, "device": device}
    query, key = query.contiguous(), key.contiguous()
    out = {name: torch.zeros(heads, n_q, **f32) for name in ("rowsum", "plogp", "diag", "key0", "delim")}
    out["colsum"] = torch.zeros(heads, n_kv, **f32)
    pool = pool_factor is not None
    rows, cols = pooled_shape if pool else (1, 1)
    g = granularity(pool_factor) if pool else 1
    if pool and (bm % g or bn % g):
        raise ValueError(f"pooling granularity {g} does not divide the kernel's {bm} x {bn} tiles")
    pooled = torch.zeros(heads, rows, cols, **f32)
    pooled_value = torch.zeros(heads, rows, cols, **f32) if norms is not None else pooled
    pooled_scores = torch.full((heads, rows, cols), float("-inf"), **f32) if scores else pooled
    dummy = torch.zeros(1, **f32)
    _kernel()[(triton_cdiv(n_q, bm), heads)](
        query, key, allow if allow.dtype == torch.uint8 else allow.to(torch.uint8).contiguous(),
        ranges.to(device, torch.int32).contiguous(),
        delim.to(**f32).contiguous(), dummy if norms is None else norms.to(**f32).contiguous(),
        out["rowsum"], out["plogp"], out["diag"], out["key0"], out["delim"], out["colsum"],
        pooled, pooled_value, pooled_scores,
        n_q, n_kv, dim, heads // key.shape[0], float(scaling), 0, pool_factor or 1, rows, cols,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        BM=bm, BN=bn, D=max(16, 1 << (dim - 1).bit_length()), G=g,
        POOL=pool, VALUE=norms is not None, SCORES=scores,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32")  # fp32 models: no TF32 rounding (SPEC §15)
    if pool:
        out["pooled"] = pooled
        if norms is not None:
            out["pooled_value"] = pooled_value
        if scores:
            out["pooled_scores"] = pooled_scores
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
