"""The block route's passes under autograd (training), lean: a layer's scores with the mask added (0 or −∞) instead of
filled in place, and softpick's and sigmoid's weights (docs/methods.md#attention-kinds) written for the keys an
allow-set names, in elementwise passes without ``where`` or ``isfinite`` (which the CPU runs about ten times slower
than a multiply, forward and backward: docs/benchmarks.md#a-lab-step). Each gives the very numbers its kind's own
``weights`` gives from the same scores, and the same gradients: autograd's, bit for bit, except softpick's, written
out and equal to float rounding (tests/test_kinds_engine.py). The mask is added wherever autograd is on, the weights
taken only where nobody records the layer: a capture's path is unchanged.
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
    with ``allowed`` the allow-set as 0 and 1, its gradient written out (:class:`_Softpick`)."""
    return _Softpick.apply(z, allowed, eps)


class _Softpick(torch.autograd.Function):
    """Softpick's row in lean passes. Forward: x = e^{−m}·expm1(z) (the kind's own numerators,
    :meth:`~attnviz.core.spec.kinds.Softpick.numerators`) times the allow-set, S = Σ|x| + ε, p = ReLU(x)/S: the
    kind's numbers bit for bit, in seven passes where the kind's ``where``s took some seventeen. Backward, with g the
    weights' gradient: ∂L/∂x = (g·[x > 0] − (Σ g·p)·sgn x)/S (0 on a forbidden cell, where x is exactly 0); x depends
    on z through e^{z−m} = x + e^{−m} and on the row's maximum m through −x, whose gradient goes to the maximum's
    cell (the first where several tie: a subgradient as valid as autograd's, which shares it among them; p depends on
    m only through ε·e^{m}, so it is small). Eight passes where autograd takes some thirty; the same gradient to
    float rounding (tests/test_kinds_engine.py)."""

    @staticmethod
    def forward(ctx, z, allowed, eps):
        m, top = z.max(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row with no allowed key: all zero (one per row)
        x = kinds.Softpick.numerators(z, m).mul_(allowed)
        total = x.abs().sum(dim=-1, keepdim=True) + eps
        p = torch.relu(x).div_(total)
        ctx.save_for_backward(m, top, x, total, p)
        return p

    @staticmethod
    def backward(ctx, grad):
        m, top, x, total, p = ctx.saved_tensors
        c = (grad * p).sum(dim=-1, keepdim=True)
        d_x = torch.ops.aten.threshold_backward(grad, x, 0).addcmul_(torch.sgn(x), c, value=-1).div_(total)
        d_z = d_x * x
        d_m = -d_z.sum(dim=-1, keepdim=True)
        d_z.addcmul_(d_x, torch.exp(-m))  # d_x·(x + e^{−m}) = d_x·e^{z−m}
        return d_z.scatter_add_(-1, top, d_m), None, None


def sigmoid(z: torch.Tensor, allow: torch.Tensor, bias: float | None) -> torch.Tensor:
    """:class:`~attnviz.core.spec.kinds.Sigmoid`'s weights of scores ``z`` (−∞ on forbidden cells): σ(−∞) is 0, so
    no ``where``; the bias −log n counts the keys of ``allow`` (the kind counts the finite scores: the same keys)."""
    if bias is None:
        b = -torch.log(allow.sum(dim=-1, keepdim=True).clamp(min=1).float())
    else:
        b = torch.tensor(float(bias), device=z.device)
    return torch.sigmoid(z + b)


def relu(z: torch.Tensor, allow: torch.Tensor) -> torch.Tensor:
    """:class:`~attnviz.core.spec.kinds.Relu`'s weights of scores ``z`` (−∞ on forbidden cells): ReLU(−∞) is 0, so
    no ``where``; n counts the keys of ``allow`` (the kind counts the finite scores: the same keys)."""
    return torch.relu(z) / allow.sum(dim=-1, keepdim=True).clamp(min=1).float()


def weigher(kind) -> Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] | None:
    """For a kind written here, a function of a block's allow-set (B or 1, H or 1, b, w) to the weights of that
    block's scores; None for any other kind (its own ``weights``)."""
    if isinstance(kind, kinds.Softpick):
        eps = kinds.EPS if kind.eps is None else kind.eps
        return lambda allow: lambda z: softpick(z, allow.to(z.dtype), eps)
    if isinstance(kind, kinds.Sigmoid):
        return lambda allow: lambda z: sigmoid(z, allow, kind.bias)
    if isinstance(kind, kinds.Relu):
        return lambda allow: lambda z: relu(z, allow)
    return None
