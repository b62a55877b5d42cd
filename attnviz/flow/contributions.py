"""Proximity contributions (docs/methods.md#contributions): how much each part of a sum in the residual stream
makes the sum what it is, as Ferrando & Voita (2024) define it with the L1 distance.

For a sum ``y = Σ_k x_k`` (plus constants that are no part: biases), part k's raw contribution is
``max(‖y‖₁ − ‖y − x_k‖₁, 0)``; the raw contributions of one sum are normalised to add up to 1.

After a layer's attention the parts are the stream before it and every head's write from every source token,
``c_i · A_ij · W̃ v_j`` (``W̃`` the head's slice of the output projection with the post-norm's gain folded in, ``c_i``
the layer's residual scale over the post-norm's frozen scale of query i). Written out, that is an (n, n, H, d)
tensor per layer. It is never made here: with ``s = sign(y)`` (+1 at zero),

    ‖y‖₁ − ‖y − t‖₁ = Σ_d s_d t_d − 2 Σ_d max(s_d t_d − |y_d|, 0),

so the first sum is one matrix product per head, ``c_i A_ij (s_i W̃)·v_j``, and the second is non-zero only on the
few dimensions d where a single part outweighs the whole stream (``s_d t_d > |y_d|``): a row's few heaviest sources
are checked in every dimension, more of them and then all only where a bound (the next weight times the largest
write of any source in d) says one may pass. Both are computed exactly, a block of queries at a time. The result equals the written-out computation to rounding (tests/test_flow.py checks it against stock
transformers' hooks on several families).
"""

from __future__ import annotations

import torch

CANDIDATES = 1 << 22  # floats of the exact correction made at once
TOP = 4  # each row's heaviest sources, corrected in every dimension
NEXT = 32  # the next tier, corrected where the bound says a key past the first may pass


def proximity(parts: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The written-out definition: ``parts`` (P, ..., d) of ``whole`` (..., d) → normalised (P, ...) contributions.
    The reference the fast paths are tested against (and the MLP's two parts use: nothing n² there)."""
    raw = (whole.abs().sum(-1) - (whole - parts).abs().sum(-1)).clamp(min=0)
    return normalised(raw, raw.sum(0))


def normalised(raw: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``raw / total``, 0 where nothing contributes (a zero stream)."""
    return torch.where(total > 0, raw / total.clamp(min=torch.finfo(raw.dtype).tiny), torch.zeros_like(raw))


def raw_part(part: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """One part's raw contribution, ``max(‖y‖₁ − ‖y − x‖₁, 0)`` over the last dimension."""
    return (whole.abs().sum(-1) - (whole - part).abs().sum(-1)).clamp(min=0)


@torch.no_grad()
def attention_raw(y: torch.Tensor, probs: torch.Tensor, value: torch.Tensor, w_out: torch.Tensor,
                  c: torch.Tensor) -> torch.Tensor:
    """Raw contributions (H, n_q, n_kv) of every head's write from every source token to the stream ``y``.

    ``y`` (n_q, D) the stream after the attention, ``probs`` (H, n_q, n_kv), ``value`` (H_kv, n_kv, d),
    ``w_out`` (H, D, d) each head's output projection (post-norm gain folded in), ``c`` (n_q,) the per-query factor.
    Everything float32 on one device; nothing (n_q, n_kv, D) is made."""
    n_heads, n_q, n_kv = probs.shape
    group = n_heads // value.shape[0]
    sign = torch.where(y >= 0, 1.0, -1.0)
    size = y.abs()
    out = torch.empty_like(probs)
    for h in range(n_heads):
        v = value[h // group]  # (n_kv, d)
        a = probs[h] * c[:, None]  # (n_q, n_kv): c_i A_ij
        raw = a * ((sign @ w_out[h]) @ v.T)  # the linear sum: c_i A_ij (s_i · W̃ v_j)
        written = v @ w_out[h].T  # (n_kv, D): W̃ v_j, every source's write before its weight
        _correct(raw, a, written, sign, size)
        out[h] = raw.clamp(min=0)
    return out


def _correct(raw: torch.Tensor, a: torch.Tensor, written: torch.Tensor, sign: torch.Tensor, size: torch.Tensor) -> None:
    """Subtract 2 Σ_d max(s_d t_d − |y_d|, 0) from ``raw`` (n_q, n_kv) in place, t = a_ij · written_j.

    In tiers, each exact: a row's :data:`TOP` heaviest keys in every dimension; in the (query, dimension) pairs where
    the next weight times the largest write of any source in that dimension may still pass the stream, its
    :data:`NEXT` heaviest keys; where even the weight after those may, every key."""
    n_q, n_kv = a.shape
    first, second = min(TOP, n_kv), min(NEXT, n_kv)
    weights, keys = a.topk(min(second + 1, n_kv), dim=1)
    most = torch.stack((written.max(0).values, -written.min(0).values))  # (2, D): the largest write either way
    bound = torch.where(sign > 0, most[0], most[1])  # (n_q, D)
    none = torch.zeros_like(size, dtype=torch.bool)
    loose = weights[:, first, None] * bound > size if n_kv > first else none  # a key past the first tier may pass
    looser = weights[:, second, None] * bound > size if n_kv > second else none  # ... past the second tier
    step = max(1, CANDIDATES // (first * written.shape[1]))
    for q0 in range(0, n_q, step):  # the first tier, where no other key can pass
        q = slice(q0, q0 + step)
        over = weights[q, :first, None] * sign[q, None, :] * written[keys[q, :first]] - size[q, None, :]
        over = over.clamp(min=0).masked_fill(loose[q, None, :], 0.0).sum(-1)  # (rows, first)
        raw[q].scatter_add_(1, keys[q, :first], -2.0 * over)
    rows, dims = torch.nonzero(loose & ~looser, as_tuple=True)
    step = max(1, CANDIDATES // second)
    for s in range(0, rows.numel(), step):  # the second tier, where no key past it can pass
        r, d = rows[s:s + step], dims[s:s + step]
        ks = keys[r, :second]  # (pairs, second)
        over = (weights[r, :second] * sign[r, d, None] * written[ks, d[:, None]] - size[r, d, None]).clamp(min=0)
        raw.index_put_((r[:, None].expand_as(ks), ks), -2.0 * over, accumulate=True)
    rows, dims = torch.nonzero(looser, as_tuple=True)
    step = max(1, CANDIDATES // max(n_kv, 1))
    for s in range(0, rows.numel(), step):  # every key, where one past the second tier may pass
        r, d = rows[s:s + step], dims[s:s + step]
        over = (a[r] * (sign[r, d, None] * written[:, d].T) - size[r, d, None]).clamp(min=0)  # (pairs, n_kv)
        raw.index_add_(0, r, over, alpha=-2.0)
