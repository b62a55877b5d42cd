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
few dimensions d where a single part outweighs the whole stream (``s_d t_d > |y_d|``). Those are found from a bound
(the row's largest probability times the largest write of any source in d) and computed exactly, a query block at a
time. The result equals the written-out computation to rounding (tests/test_flow.py checks it against stock
transformers' hooks on several families).
"""

from __future__ import annotations

import torch

CANDIDATES = 1 << 22  # (query, dimension) pairs of the exact correction made at once: (pairs, n_kv) floats


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
        linear = (sign @ w_out[h]) @ v.T  # (n_q, n_kv): s_i · W̃ v_j
        raw = a * linear
        written = v @ w_out[h].T  # (n_kv, D): W̃ v_j, every source's write before its weight
        # the correction's dimensions: those where some source's weighted write may pass the stream's size
        most = torch.stack((written.max(0).values, -written.min(0).values))  # (2, D): largest write either way
        reach = a.max(1).values[:, None] * torch.where(sign > 0, most[0], most[1])  # (n_q, D)
        rows, dims = torch.nonzero(reach > size, as_tuple=True)
        step = max(1, CANDIDATES // max(n_kv, 1))
        for s in range(0, rows.numel(), step):
            r, d = rows[s:s + step], dims[s:s + step]
            over = (a[r] * (sign[r, d, None] * written[:, d].T) - size[r, d, None]).clamp(min=0)  # (pairs, n_kv)
            raw.index_add_(0, r, over, alpha=-2.0)
        out[h] = raw.clamp(min=0)
    return out
