"""The block route's passes under autograd (training), lean: a layer's scores with the mask added (0 or −∞) instead of
filled in place, and softpick's and sigmoid's weights (docs/methods.md#attention-kinds) written for the keys an
allow-set names, in elementwise passes without ``where`` or ``isfinite`` (which the CPU runs about ten times slower
than a multiply, forward and backward: docs/benchmarks.md#a-lab-step). Each gives the very numbers its kind's own
``weights`` gives from the same scores, and autograd the same gradients (tests/test_kinds_engine.py). The mask is
added wherever autograd is on, the weights taken only where nobody records the layer: a capture's path is unchanged.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from attnviz.core.spec import kinds


def masked(scores: torch.Tensor, allow: torch.Tensor) -> torch.Tensor:
    """``scores`` with −∞ added on the cells ``allow`` forbids and 0 elsewhere, out of place: the same numbers as
    ``masked_fill`` (a score of −0.0 comes back +0.0), and a gradient autograd passes through unchanged instead of
    masking it (a forbidden cell's is 0 either way: its weight is 0)."""
    bias = torch.zeros(allow.shape, dtype=scores.dtype, device=scores.device).masked_fill_(~allow, -math.inf)
    return scores + bias


def softpick(z: torch.Tensor, allowed: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`~attnviz.core.spec.kinds.Softpick`'s weights of scores ``z`` (−∞ on forbidden cells, finite elsewhere)
    with ``allowed`` the allow-set as 0 and 1. The kind picks, per cell, e^{−m}·expm1(z) (z ≤ 0) or −e^{z−m}·expm1(−z)
    (z > 0) by ``where``; each is exactly 0 where the other is picked (expm1(0) = 0), so their sum is the pick; a
    forbidden cell's is multiplied by 0."""
    m = z.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row with no allowed key: all zero (one per row)
    below = torch.exp(-m) * torch.expm1(z.clamp(max=0))
    above = -torch.exp(z - m) * torch.expm1(-torch.relu(z))  # relu: z = 0's gradient goes to ``below``, as picked
    shifted = (above + below) * allowed
    return torch.relu(shifted) / (shifted.abs().sum(dim=-1, keepdim=True) + eps)


def sigmoid(z: torch.Tensor, allow: torch.Tensor, bias: float | None) -> torch.Tensor:
    """:class:`~attnviz.core.spec.kinds.Sigmoid`'s weights of scores ``z`` (−∞ on forbidden cells): σ(−∞) is 0, so
    no ``where``; the bias −log n counts the keys of ``allow`` (the kind counts the finite scores: the same keys)."""
    if bias is None:
        b = -torch.log(allow.sum(dim=-1, keepdim=True).clamp(min=1).float())
    else:
        b = torch.tensor(float(bias), device=z.device)
    return torch.sigmoid(z + b)


def weigher(kind) -> Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] | None:
    """For a kind written here, a function of a block's allow-set (B or 1, H or 1, b, w) to the weights of that
    block's scores; None for any other kind (its own ``weights``)."""
    if isinstance(kind, kinds.Softpick):
        return lambda allow: lambda z: softpick(z, allow.to(z.dtype), kind.eps)
    if isinstance(kind, kinds.Sigmoid):
        return lambda allow: lambda z: sigmoid(z, allow, kind.bias)
    return None
