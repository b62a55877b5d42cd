"""The Triton kernels of :mod:`attnviz.core.kernels` (imported on first use, so Triton is optional and
``TRITON_INTERPRET`` is read when the kernels are first needed)."""

import triton
import triton.language as tl


@triton.jit
def scores_tile(q, k_ptr, allow_ptr, rows, row_ok, dims, start, n_kv, dim, scale, q_offset, stride_kn,
                BN: tl.constexpr, PRECISION: tl.constexpr, CAUSAL: tl.constexpr):
    """One BM x BN tile: its key indices, which exist, the scaled scores and the allow-set (read from
    the packed allow matrix, or for a plain causal mask computed from the indices)."""
    cols = start + tl.arange(0, BN)
    col_ok = cols < n_kv
    k = tl.load(k_ptr + cols[:, None] * stride_kn + dims[None, :],
                mask=col_ok[:, None] & (dims[None, :] < dim), other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if CAUSAL:
        ok = row_ok[:, None] & col_ok[None, :] & (cols[None, :] <= rows[:, None] + q_offset)
    else:
        # the allow-set packed 32 keys to an int32 word (attnviz.core.kernels.pack_allow): BN / 32 loads a row
        # instead of BN, and no pointer a score (those cost the registers that made ptxas spill)
        n_words = (n_kv + 31) // 32
        words_at = start // 32 + tl.arange(0, BN // 32)
        words = tl.load(allow_ptr + rows[:, None].to(tl.int64) * n_words + words_at[None, :],
                        mask=row_ok[:, None] & (words_at[None, :] < n_words), other=0)
        bits = (words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1
        ok = (tl.reshape(bits, (rows.shape[0], BN)) != 0) & col_ok[None, :]
    return cols, col_ok, s, ok


@triton.jit
def layer_stats(q_ptr, k_ptr, allow_ptr, ranges_ptr, delim_ptr, norms_ptr, lse_ptr,
                rowsum_ptr, plogp_ptr, diag_ptr, key0_ptr, delimacc_ptr, colsum_ptr,
                pooled_ptr, pooled_value_ptr, pooled_scores_ptr,
                n_q, n_kv, dim, group, scale, q_offset, factor, pooled_rows, pooled_cols,
                stride_qh, stride_qn, stride_kh, stride_kn,
                BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                POOL: tl.constexpr, VALUE: tl.constexpr, SCORES: tl.constexpr, PRECISION: tl.constexpr,
                CAUSAL: tl.constexpr, LSE: tl.constexpr):
    """One program: BM query rows of one head. With ``LSE`` each row's log-sum-exp over its allowed keys is
    read (the forward's own attention computed it), else pass 1 finds it; then one pass over every tile
    accumulates the statistics (see attnviz.core.kernels). Heads
    are the grid's fast axis: the heads of one row block run side by side and share their K tiles
    (grouped-query attention) and allow tiles in the L2 cache."""
    head = tl.program_id(0)
    block = tl.program_id(1)
    kv_head = head // group
    rows = block * BM + tl.arange(0, BM)
    dims = tl.arange(0, D)
    row_ok = rows < n_q
    q = tl.load(q_ptr + head * stride_qh + rows[:, None] * stride_qn + dims[None, :],
                mask=row_ok[:, None] & (dims[None, :] < dim), other=0.0)
    k_lo = tl.load(ranges_ptr + 2 * block)
    k_hi = tl.load(ranges_ptr + 2 * block + 1)
    k_lo = (k_lo // BN) * BN  # tiles on the global BN grid: pooled cells stay aligned
    if LSE:  # the forward's attention already computed every row's log-sum-exp: one pass over QK^T
        lse = tl.load(lse_ptr + head * n_q + rows, mask=row_ok, other=0.0)
    else:  # pass 1: every row's log-sum-exp over its allowed keys (online, as flash attention)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        for start in range(k_lo, k_hi, BN):
            cols, col_ok, s, ok = scores_tile(q, k_ptr + kv_head * stride_kh, allow_ptr, rows, row_ok, dims, start,
                                              n_kv, dim, scale, q_offset, stride_kn, BN, PRECISION, CAUSAL)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
            m_i = m_new
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), 0.0)
    # the probabilities tile by tile, every statistic accumulated from registers
    rowsum = tl.zeros([BM], tl.float32)
    plogp = tl.zeros([BM], tl.float32)
    diag = tl.zeros([BM], tl.float32)
    key0 = tl.zeros([BM], tl.float32)
    delim_acc = tl.zeros([BM], tl.float32)
    for start in range(k_lo, k_hi, BN):
        cols, col_ok, s, ok = scores_tile(q, k_ptr + kv_head * stride_kh, allow_ptr, rows, row_ok, dims, start,
                                          n_kv, dim, scale, q_offset, stride_kn, BN, PRECISION, CAUSAL)
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
