"""The Triton kernels of :mod:`attnviz.core.kernel.kernels` (imported on first use, so Triton is optional and
``TRITON_INTERPRET`` is read when the kernels are first needed).

Scores are kept in base 2, as flash attention keeps them: ``s2 = q·k · scale · log2(e)`` and the row's
log-sum-exp times log2(e), so a probability is one ``exp2`` of one subtraction and Σ p·log p is Σ p·x2
times ln 2 at the end. Tiles come in two kinds. A *full* tile lies wholly inside every row's allow-set
(strictly below the diagonal of a causal layer in half precision, every row and key in range; a float32
kernel's emulated dot products keep one masked loop): it needs no mask, no diagonal and,
except for key 0's tile, no test of any key; per score it costs the ``exp2`` and five adds, multiply-adds
or maxima. The other tiles (the diagonal's, a packed allow-set's, a partial block's) mask each score."""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def scores_tile(q, k_ptr, allow_ptr, rows, row_ok, dims, start, n_kv, dim, scale2, q_offset, stride_kn,
                BN: tl.constexpr, PRECISION: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    """One BM x BN tile: its key indices, which exist, the scores in base 2 and (``MASKED``) the allow-set,
    read from the packed allow matrix or, for a plain causal mask, computed from the indices."""
    cols = start + tl.arange(0, BN)
    col_ok = cols < n_kv
    if MASKED:
        k = tl.load(k_ptr + cols[:, None] * stride_kn + dims[None, :],
                    mask=col_ok[:, None] & (dims[None, :] < dim), other=0.0)
    else:  # every key of a full tile exists
        k = tl.load(k_ptr + cols[:, None] * stride_kn + dims[None, :], mask=dims[None, :] < dim, other=0.0)
    s2 = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale2
    ok = col_ok[None, :]  # a full tile's: unused there, so never computed
    if MASKED:
        if CAUSAL:
            ok = row_ok[:, None] & col_ok[None, :] & (cols[None, :] <= rows[:, None] + q_offset)
        else:
            # the allow-set packed 32 keys to an int32 word (attnviz.core.kernel.kernels.pack_allow): BN / 32 loads a row
            # instead of BN, and no pointer a score (those cost the registers that made ptxas spill)
            n_words = (n_kv + 31) // 32
            words_at = start // 32 + tl.arange(0, BN // 32)
            words = tl.load(allow_ptr + rows[:, None].to(tl.int64) * n_words + words_at[None, :],
                            mask=row_ok[:, None] & (words_at[None, :] < n_words), other=0)
            bits = (words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1
            ok = (tl.reshape(bits, (rows.shape[0], BN)) != 0) & col_ok[None, :]
    return cols, col_ok, s2, ok


@triton.jit
def lse_tile(q, k_ptr, allow_ptr, rows, row_ok, dims, start, n_kv, dim, scale2, q_offset, stride_kn, m_i, l_i,
             BN: tl.constexpr, PRECISION: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    """Pass 1 over one tile: the running maximum and sum of every row's allowed exp2(s2) (online, as flash
    attention)."""
    cols, col_ok, s2, ok = scores_tile(q, k_ptr, allow_ptr, rows, row_ok, dims, start, n_kv, dim, scale2,
                                       q_offset, stride_kn, BN, PRECISION, CAUSAL, MASKED)
    if MASKED:
        s2 = tl.where(ok, s2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s2, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s2 - m_safe[:, None]), axis=1)
    return m_new, l_i


@triton.jit
def slabs(tile, BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
    """A tile's rows as (repeats, SPLIT groups, 16 rows, BN): row r in slab (r // 16) % SPLIT of repeat
    r // (16 · SPLIT), the layout in which a Hopper warp holds one group (attnviz.core.kernel.kernels.row_groups)."""
    return tl.reshape(tile, (BM // (16 * SPLIT), SPLIT, 16, BN))


@triton.jit
def pool_tile(ptr, tile, head, block, start, factor, pooled_rows, pooled_cols,
              BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, WHOLE: tl.constexpr, SPLIT: tl.constexpr):
    """Max-pool one tile into its cells by atomic max: with ``WHOLE`` (the pooling factor a multiple of both
    tile sides, so the tile lies in one cell) one maximum and one atomic (``SPLIT`` > 1: one a row group, each from
    the group's own warp), else G x G maxima by a reshape."""
    base = head * pooled_rows * pooled_cols
    if WHOLE:
        cell_r = (block * BM) // factor
        # start // factor without an integer division a tile: the tile's index over the tiles a cell, in float32,
        # exact below 2^20 tiles (a quotient (t + 0.5) / T lies 0.5 / T from an integer; float32's reciprocal, 2 ulp at
        # worst, and product err by less than 2^-21 of it); kernels.layer_statistics refuses more
        cell_c = tl.cast((start // BN + 0.5) * (1.0 / (factor // BN)), tl.int32)
        if SPLIT > 1:  # each group's maximum from its first thread of 32 (a warp's, in a blocked layout of 32 x SPLIT)
            groups = tl.max(tl.max(tl.max(slabs(tile, BM, BN, SPLIT), axis=3), axis=2), axis=0)
            lanes = tl.reshape(tl.broadcast_to(groups[:, None], (SPLIT, 32)), (SPLIT * 32,))
            lane = tl.arange(0, SPLIT * 32)
            tl.atomic_max(ptr + base + cell_r * pooled_cols + cell_c + lane * 0, lanes,
                          mask=(lane % 32 == 0) & (lane * 0 + cell_r < pooled_rows) & (lane * 0 + cell_c < pooled_cols),
                          sem="relaxed")
        else:
            tl.atomic_max(ptr + base + cell_r * pooled_cols + cell_c, tl.max(tl.max(tile, axis=1), axis=0),
                          mask=(cell_r < pooled_rows) & (cell_c < pooled_cols), sem="relaxed")
    else:
        cell_r = (block * BM + tl.arange(0, BM // G) * G) // factor
        cell_c = (start + tl.arange(0, BN // G) * G) // factor
        cell_ok = (cell_r[:, None] < pooled_rows) & (cell_c[None, :] < pooled_cols)
        cells = tl.max(tl.max(tl.reshape(tile, (BM // G, G, BN // G, G)), axis=3), axis=1)
        tl.atomic_max(ptr + base + cell_r[:, None] * pooled_cols + cell_c[None, :], cells, mask=cell_ok,
                      sem="relaxed")


@triton.jit
def sums_tile(q, k_ptr, allow_ptr, delim_ptr, norms_ptr, colsum_ptr, pooled_ptr, pooled_value_ptr,
              pooled_scores_ptr, rows, row_ok, dims, start, lse2, rowsum, plogp, diag, key0, delim_acc,
              head, block, n_kv, dim, scale2, q_offset, stride_kn, factor, pooled_rows, pooled_cols,
              BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, POOL: tl.constexpr, VALUE: tl.constexpr,
              SCORES: tl.constexpr, PRECISION: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
              WHOLE: tl.constexpr, SPLIT: tl.constexpr):
    """Pass 2 over one tile: its probabilities, every statistic accumulated from registers."""
    cols, col_ok, s2, ok = scores_tile(q, k_ptr, allow_ptr, rows, row_ok, dims, start, n_kv, dim, scale2,
                                       q_offset, stride_kn, BN, PRECISION, CAUSAL, MASKED)
    x2 = s2 - lse2[:, None]  # finite: the scores and the (sanitised) log-sum-exp are
    p = tl.exp2(x2)
    if MASKED:
        p = tl.where(ok, p, 0.0)
    rowsum += tl.sum(p, axis=1)
    if MASKED:  # p · x2 is 0 where p is; the test keeps ptxas from spilling fp32's emulated dot products
        plogp += tl.sum(tl.where(p > 0, p * x2, 0.0), axis=1)
    else:  # in base 2
        plogp += tl.sum(p * x2, axis=1)
    if start == 0:  # key 0 lies in one tile
        key0 += tl.sum(tl.where(cols[None, :] == 0, p, 0.0), axis=1)
    if MASKED:  # a full tile holds no query's own key
        lo = block * BM + q_offset
        if (start < lo + BM) & (start + BN > lo):
            diag += tl.sum(tl.where(cols[None, :] == rows[:, None] + q_offset, p, 0.0), axis=1)
    if MASKED:
        d = tl.load(delim_ptr + cols, mask=col_ok, other=0.0)
    else:  # every key of a full tile exists
        d = tl.load(delim_ptr + cols)
    delim_acc += tl.sum(p * d[None, :], axis=1)
    if SPLIT > 1:  # a column sum a group of 16-row slabs (a warp's, on Hopper): no exchange between warps
        part = tl.sum(tl.sum(slabs(p, BM, BN, SPLIT), axis=2), axis=0)
        tl.atomic_add(tl.broadcast_to((colsum_ptr + head * n_kv + cols)[None, :], (SPLIT, BN)), part,
                      mask=tl.broadcast_to(col_ok[None, :], (SPLIT, BN)), sem="relaxed")
    else:
        tl.atomic_add(colsum_ptr + head * n_kv + cols, tl.sum(p, axis=0), mask=col_ok, sem="relaxed")
    if POOL:
        pool_tile(pooled_ptr, p, head, block, start, factor, pooled_rows, pooled_cols, BM, BN, G, WHOLE, SPLIT)
        if VALUE:
            nv = tl.load(norms_ptr + head * n_kv + cols, mask=col_ok, other=0.0)
            pool_tile(pooled_value_ptr, p * nv[None, :], head, block, start, factor, pooled_rows, pooled_cols,
                      BM, BN, G, WHOLE, SPLIT)
        if SCORES:  # the maxima in base 2, back to natural units (ln 2 > 0 keeps the order)
            if MASKED:
                s2 = tl.where(ok, s2, float("-inf"))
            pool_tile(pooled_scores_ptr, s2 * LN2, head, block, start, factor, pooled_rows, pooled_cols,
                      BM, BN, G, WHOLE, SPLIT)
    return rowsum, plogp, diag, key0, delim_acc


@triton.jit
def layer_stats(q_ptr, k_ptr, allow_ptr, ranges_ptr, delim_ptr, norms_ptr, lse_ptr,
                rowsum_ptr, plogp_ptr, diag_ptr, key0_ptr, delimacc_ptr, colsum_ptr,
                pooled_ptr, pooled_value_ptr, pooled_scores_ptr,
                n_q, n_kv, dim, group, scale, q_offset, factor, pooled_rows, pooled_cols,
                stride_qh, stride_qn, stride_kh, stride_kn,
                BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                POOL: tl.constexpr, VALUE: tl.constexpr, SCORES: tl.constexpr, PRECISION: tl.constexpr,
                CAUSAL: tl.constexpr, LSE: tl.constexpr, WHOLE: tl.constexpr, SPLIT: tl.constexpr):
    """One program: BM query rows of one head. With ``LSE`` each row's log-sum-exp over its allowed keys is
    read (the forward's own attention computed it), else pass 1 finds it; then one pass over every tile
    accumulates the statistics (see attnviz.core.kernel.kernels): first the full tiles, then the masked ones. Heads
    are the grid's fast axis: the heads of one row block run side by side and share their K tiles
    (grouped-query attention) and allow tiles in the L2 cache."""
    head = tl.program_id(0)
    block = tl.program_id(1)
    kv_head = head // group
    k_head = k_ptr + kv_head * stride_kh
    rows = block * BM + tl.arange(0, BM)
    dims = tl.arange(0, D)
    row_ok = rows < n_q
    scale2 = scale * LOG2E
    q = tl.load(q_ptr + head * stride_qh + rows[:, None] * stride_qn + dims[None, :],
                mask=row_ok[:, None] & (dims[None, :] < dim), other=0.0)
    k_lo = tl.load(ranges_ptr + 2 * block)
    k_hi = tl.load(ranges_ptr + 2 * block + 1)
    k_lo = (k_lo // BN) * BN  # tiles on the global BN grid: pooled cells stay aligned
    # full tiles: [k_lo, full_end), strictly left of the first row's own key in a causal block whose rows all
    # exist (so no full tile holds a row's own key or a key past it)
    full_end = k_lo
    if CAUSAL and PRECISION != "ieee":  # fp32's emulated dot products: one loop (two spill its registers)
        if block * BM + BM <= n_q:
            full_end = tl.minimum(tl.maximum(((block * BM + q_offset) // BN) * BN, k_lo), k_hi)
    if LSE:  # the forward's attention already computed every row's log-sum-exp: one pass over QK^T
        lse2 = tl.load(lse_ptr + head * n_q + rows, mask=row_ok, other=0.0) * LOG2E
        lse2 = tl.where(tl.abs(lse2) < float("inf"), lse2, 0.0)  # a row with no key: p is 0 there anyway
    else:  # pass 1: every row's log-sum-exp over its allowed keys
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        for masked in tl.static_range(2):  # the full tiles, then the masked ones
            for start in range(full_end if masked else k_lo, k_hi if masked else full_end, BN):
                m_i, l_i = lse_tile(q, k_head, allow_ptr, rows, row_ok, dims, start, n_kv, dim, scale2, q_offset,
                                    stride_kn, m_i, l_i, BN, PRECISION, CAUSAL, masked == 1)
        lse2 = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), 0.0)
    rowsum = tl.zeros([BM], tl.float32)
    plogp = tl.zeros([BM], tl.float32)
    diag = tl.zeros([BM], tl.float32)
    key0 = tl.zeros([BM], tl.float32)
    delim_acc = tl.zeros([BM], tl.float32)
    for masked in tl.static_range(2):
        for start in range(full_end if masked else k_lo, k_hi if masked else full_end, BN):
            rowsum, plogp, diag, key0, delim_acc = sums_tile(
                q, k_head, allow_ptr, delim_ptr, norms_ptr, colsum_ptr, pooled_ptr, pooled_value_ptr,
                pooled_scores_ptr, rows, row_ok, dims, start, lse2, rowsum, plogp, diag, key0, delim_acc, head, block,
                n_kv, dim, scale2, q_offset, stride_kn, factor, pooled_rows, pooled_cols,
                BM, BN, G, POOL, VALUE, SCORES, PRECISION, CAUSAL, masked == 1, WHOLE, SPLIT)
    out = head * n_q + rows
    tl.store(rowsum_ptr + out, rowsum, mask=row_ok)
    tl.store(plogp_ptr + out, plogp * LN2, mask=row_ok)
    tl.store(diag_ptr + out, diag, mask=row_ok)
    tl.store(key0_ptr + out, key0, mask=row_ok)
    tl.store(delimacc_ptr + out, delim_acc, mask=row_ok)
