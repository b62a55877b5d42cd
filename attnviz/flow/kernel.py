"""The exact L1 correction of attention contributions as one compiled loop (docs/methods.md#contributions), for
float32 tensors on the CPU.

Why a compiled loop: the correction ``2 Σ_d max(a_ij s_d w_jd − |y_d|, 0)`` is non-zero for a few hundredths of the
(query, dimension) pairs, and which keys can make it non-zero is known only after a bound per (query, dimension)
(the pair's threshold ``|y_d| / (largest write along s_d)``, compared with each key's weight). torch can only
express that as gathers over candidate lists: about ten operations, each a full pass, per candidate. A loop visits
each candidate once and stops at the first dimension whose threshold the key's weight does not reach (the
dimensions sorted by threshold). On ten layers of the default model at 1,024 tokens, the contributions take 0.71 s
this way against 1.70 s with the gathers (docs/gpu.md has the whole pass, bench/routes.py). ``torch.compile`` cannot write this loop and would need a C++ compiler at run time; numba's
LLVM ships inside its wheel.

The loop computes exactly what :func:`attnviz.flow.contributions.attention_raw_torch` computes (the tests compare
both with the written-out definition); only the order of float32 additions differs. Without numba (a platform with
no wheel), on another device or in another dtype, the torch path runs.
"""

from __future__ import annotations

import threading

import numpy as np
from numba import njit, prange  # imported only where this module is: the compiled path (contributions.attention_raw)

_LOCK = threading.Lock()  # one parallel call at a time (the shared server); the GIL is released inside (nogil)


@njit(inline="always", cache=True)
def _overshoot(part, yd):  # pragma: no cover - compiled
    """How far ``part`` passes the stream's ``yd`` along its sign: ``max(s·part − |yd|, 0)``, s = sign(yd) (+1 at 0)."""
    over = (part - yd) if yd >= 0 else (yd - part)
    return over if over > 0.0 else 0.0


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def _raw_contributions(out, probs, c, rows, hi, lo, y):  # pragma: no cover - compiled; tested through its caller
    """``out`` (H, n_q, n_kv) holds ``c_i (s_i · W̃v_j)`` on entry and each part's raw contribution on exit.

    ``probs`` (H, n_q, n_kv), ``c`` (n_q,), ``rows`` (H, n_kv, D) every source's write before its weight,
    ``hi``/``lo`` (H, D) the largest and smallest write of any source by dimension, ``y`` (n_q, D) the stream.
    Per (head, query) row: the linear part times the weight; the two heaviest keys corrected in every
    dimension; then the dimensions where the third weight times the largest write along the stream's sign may
    still pass the stream, sorted by their threshold, and every other key above the lowest threshold checked
    in those dimensions up to its weight; last, the clamp at zero."""
    H, n_q, n_kv = probs.shape
    D = y.shape[1]
    for t in prange(H * n_q):
        h = t // n_q
        r = t - h * n_q
        cr = c[r]
        w1 = 0.0
        w2 = 0.0
        w3 = 0.0
        j1 = -1
        j2 = -1
        prow = probs[h, r]
        orow = out[h, r]
        yr = y[r]
        for j in range(n_kv):  # the linear part times the weight (vectorised)
            orow[j] *= prow[j]
        for j in range(n_kv):  # the three heaviest weights
            p = prow[j]
            if p > w3:
                if p > w1:
                    w3 = w2
                    w2 = w1
                    j2 = j1
                    w1 = p
                    j1 = j
                elif p > w2:
                    w3 = w2
                    w2 = p
                    j2 = j
                else:
                    w3 = p
        if w1 > 0.0:
            for jj in range(2):
                j = j1 if jj == 0 else j2
                if j < 0:
                    continue
                w = prow[j] * cr
                corr = 0.0
                for d in range(D):
                    corr += _overshoot(w * rows[h, j, d], yr[d])
                orow[j] -= 2.0 * corr
            w3 *= cr
        m = 0
        theta = np.empty(D, np.float32)
        dims = np.empty(D, np.int64)
        if w3 > 0.0:
            for d in range(D):
                yd = yr[d]
                u = hi[h, d] if yd >= 0 else -lo[h, d]
                tau = abs(yd)
                if u > 0.0 and w3 * u > tau:  # a key past the two heaviest may pass here
                    th = tau / u
                    k = m
                    while k > 0 and theta[k - 1] > th:  # kept sorted by threshold
                        theta[k] = theta[k - 1]
                        dims[k] = dims[k - 1]
                        k -= 1
                    theta[k] = th
                    dims[k] = d
                    m += 1
        if m > 0:
            low = theta[0]
            for j in range(n_kv):
                if j == j1 or j == j2:
                    continue
                w = prow[j] * cr
                if w <= low:
                    continue
                corr = 0.0
                for k in range(m):
                    if theta[k] >= w:  # this key cannot pass here, nor in any dimension after
                        break
                    corr += _overshoot(w * rows[h, j, dims[k]], yr[dims[k]])
                orow[j] -= 2.0 * corr
        for j in range(n_kv):
            orow[j] = max(orow[j], 0.0)


def raw_contributions(out, probs, c, rows, hi, lo, y) -> None:
    """Run the compiled loop in place on ``out`` (numpy float32 arrays, C-contiguous). Compiled on first use and
    cached on disk by numba (a later process loads it)."""
    with _LOCK:
        _raw_contributions(out, probs, c, rows, hi, lo, y)


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def _kept(raw, inv, floor):  # pragma: no cover - compiled; tested through its caller
    """The entries of ``raw`` (H, n, m) times ``inv`` (n,) at or above ``floor``, as (h, i, j) and weight in the
    order of :func:`torch.nonzero`; then the heads summed likewise, (i, j) and weight."""
    H, n, m = raw.shape
    counts = np.zeros(H * n, np.int64)
    for t in prange(H * n):
        i = t % n
        s = inv[i]
        k = 0
        for j in range(m):
            if raw[t // n, i, j] * s >= floor:
                k += 1
        counts[t] = k
    starts = np.cumsum(counts) - counts
    index = np.empty((counts.sum(), 3), np.int64)
    weight = np.empty(counts.sum(), np.float32)
    for t in prange(H * n):
        h = t // n
        i = t - h * n
        s = inv[i]
        k = starts[t]
        for j in range(m):
            v = raw[h, i, j] * s
            if v >= floor:
                index[k, 0] = h
                index[k, 1] = i
                index[k, 2] = j
                weight[k] = v
                k += 1
    summed = np.zeros((n, m), np.float32)
    scounts = np.zeros(n, np.int64)
    for i in prange(n):
        s = inv[i]
        k = 0
        for j in range(m):
            v = np.float32(0.0)
            for h in range(H):
                v += raw[h, i, j] * s
            summed[i, j] = v
            if v >= floor:
                k += 1
        scounts[i] = k
    sstarts = np.cumsum(scounts) - scounts
    sindex = np.empty((scounts.sum(), 2), np.int64)
    sweight = np.empty(scounts.sum(), np.float32)
    for i in prange(n):
        k = sstarts[i]
        for j in range(m):
            if summed[i, j] >= floor:
                sindex[k, 0] = i
                sindex[k, 1] = j
                sweight[k] = summed[i, j]
                k += 1
    return index, weight, sindex, sweight


def kept(raw, inv, floor: float):
    """:func:`_kept` under the module's lock (numpy float32 arrays, C-contiguous)."""
    with _LOCK:
        return _kept(raw, inv, np.float32(floor))
