"""Attention mask types of docs/methods.md#masks, as small composable predicates.

A predicate has FlexAttention's `mask_mod` signature ``(batch_idx, head_idx, q_idx, kv_idx) -> bool``
and is evaluated on broadcast index tensors, so one call builds a whole ``n x n`` matrix (the same
non-vmap trick transformers' ``masking_utils`` uses). ``q_idx``/``kv_idx`` are *positions counted
from the first real token*, so NoSink and global tokens mean the same thing under left or right
padding. Predicates compose with ``and_masks`` / ``or_masks`` (transformers' ``masking_utils`` composition,
written out here so that reading an architecture never imports transformers' compiler-bound module:
2 s of start-up) and ``not_mask``.

A :class:`Mask` wraps a predicate with its name written in the one-line grammar of docs/methods.md#the-call-syntax
(``nosink-bidir(m=2)``), so every figure, file name and CLI answer says the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from attnviz.errors import MaskError

Predicate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

__all__ = [
    "Mask", "and_masks", "or_masks", "not_mask", "fwd", "back", "bidir", "nosink", "sliding",
    "dilated", "global_sliding", "stablemask", "custom", "keep_self_if_empty",
]


# --- predicates -------------------------------------------------------------------------------

def causal(b, h, q, kv):
    return kv <= q


def anticausal(b, h, q, kv):
    return kv >= q


def everything(b, h, q, kv):
    return torch.ones(torch.broadcast_shapes(q.shape, kv.shape), dtype=torch.bool, device=q.device)


def _compose(predicates, start: bool, combine, what: str) -> Predicate:
    """Predicates folded with ``combine`` from ``start``, as transformers' ``masking_utils`` composes them."""
    if not all(callable(p) for p in predicates):
        raise MaskError(f"every part of {what} must be a mask predicate, got {predicates}")

    def composed(b, h, q, kv):
        result = q.new_full((), start, dtype=torch.bool)
        for pred in predicates:
            result = combine(result, pred(b, h, q, kv).to(result.device))
        return result

    return composed


def and_masks(*predicates: Predicate) -> Predicate:
    """The intersection of predicates: transformers' ``masking_utils.and_masks``, same signature and result."""
    return _compose(predicates, True, torch.logical_and, "and_masks")


def or_masks(*predicates: Predicate) -> Predicate:
    """The union of predicates: transformers' ``masking_utils.or_masks``, same signature and result."""
    return _compose(predicates, False, torch.logical_or, "or_masks")


def not_mask(pred: Predicate) -> Predicate:
    def inverted(b, h, q, kv):
        return ~pred(b, h, q, kv)

    return inverted


def hide_first_keys(m: int) -> Predicate:
    """NoSink: keys 0..m-1 hidden from every *later* query (a query keeps itself)."""

    def visible(b, h, q, kv):
        return ~((kv < m) & (q > kv))

    return visible


def within(w: int) -> Predicate:
    def near(b, h, q, kv):
        return (q - kv) < w

    return near


def within_symmetric(half: int) -> Predicate:
    def near(b, h, q, kv):
        return (q - kv).abs() <= half

    return near


def on_stride(d: int, span: int) -> Predicate:
    def strided(b, h, q, kv):
        return ((q - kv) % d == 0) & ((q - kv) < span)

    return strided


def global_tokens(g: int) -> Predicate:
    def glob(b, h, q, kv):
        return (q < g) | (kv < g)

    return glob


# --- mask types -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Mask:
    """A named mask type. ``stable`` holds StableMask's gamma (a float) or ``"alibi"``.

    ``causal_compatible`` says whether no query ever sees a later key, which is what KV-cached
    generation needs.
    """

    name: str
    predicate: Predicate = field(compare=False, repr=False)
    causal_compatible: bool = False
    stable: float | str | None = None
    size: int | None = None  # custom matrices only: the n they were written for
    horizon: int | None = None  # SM-I: the maximum training length T

    def allow(self, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
        """Boolean allow tensor for broadcast position tensors (no keep-self repair)."""
        if self.size is not None:
            top = int(max(q_pos.max().item(), kv_pos.max().item())) + 1
            if top > self.size:
                raise MaskError(
                    f"custom mask '{self.name}' is {self.size}x{self.size} but the text has {top} tokens"
                )
        zero = torch.zeros((), dtype=torch.long, device=q_pos.device)
        allow = self.predicate(zero, zero, q_pos, kv_pos)
        return allow.expand(torch.broadcast_shapes(allow.shape, q_pos.shape, kv_pos.shape))

    @property
    def causal_type(self) -> bool:
        """No allowed later key (FWD, NoSink-FWD, causal windows, StableMask): the layers a model's
        own sliding window bounds (docs/methods.md#per-layer-architectures)."""
        return self.causal_compatible or self.stable is not None

    def matrix(self, n: int) -> np.ndarray:
        """The ``n x n`` boolean matrix, rows = queries, with the keep-self rule applied."""
        pos = torch.arange(n)
        allow = self.allow(pos[:, None], pos[None, :])
        return keep_self_if_empty(allow).numpy()

    def pseudo_logits(self, kv_pos: torch.Tensor, n_heads: int) -> torch.Tensor:
        """StableMask's P for future keys, per head: ``-gamma_h * j`` (docs/methods.md#stablemask), shape (H, ...) over
        ``kv_pos``'s shape: (H, B, n) for the positions (B, n) of a batch."""
        gammas = stable_gammas(self.stable, n_heads).to(kv_pos.device)
        return -gammas.view(-1, *([1] * kv_pos.dim())) * kv_pos.float()

    def inference_logits(self, q_pos: torch.Tensor, n_heads: int) -> torch.Tensor:
        """SM-I's one extra logit per row (docs/methods.md#stablemask): tau_i = logsumexp_{j=i+1..T-1} (-gamma_h j), in
        closed form (a geometric sum), -inf where i >= T - 1. (B, H, n_q, 1) for (B, n_q) positions."""
        g = stable_gammas(self.stable, n_heads).to(q_pos.device, torch.float64)[None, :, None]  # (1, H, 1)
        i = q_pos.double()[:, None, :]  # (B, 1, n_q)
        count = self.horizon - 1 - i  # future slots j = i+1 .. T-1
        tau = -g * (i + 1) + torch.log(-torch.expm1(-g * count.clamp(min=1))) - torch.log(-torch.expm1(-g))
        return torch.where(count > 0, tau, torch.full_like(tau, float("-inf"))).float()[..., None]


_SMALL_ALLOW = 1 << 16  # allow-sets up to this many cells are fixed without asking the device first


def keep_self_if_empty(allow: torch.Tensor, first: int | None = None) -> torch.Tensor:
    """A query whose every key is masked keeps its own key (the last ``n_q`` keys are the queries'; for some
    rows of a larger allow-set, ``first`` is the key of the first row's own).

    This is what seed 000's reference code does for row 0 under NoSink: no NaN, and no silent
    uniform leak over future keys as a -inf-everywhere row would give.
    """
    n_q, n_k = allow.shape[-2], allow.shape[-1]
    first = n_k - n_q if first is None else first
    empty = ~allow.any(-1, keepdim=True)
    # Whether any row is empty is a host read (on a GPU, a wait for the device): worth it to skip two
    # n x n passes on a long text, not on a decoding step's single row, which stays sync-free.
    if allow.numel() > _SMALL_ALLOW and not bool(empty.any()):
        return allow
    diagonal = torch.zeros(n_q, n_k, dtype=torch.bool, device=allow.device)
    diagonal[torch.arange(n_q, device=allow.device), torch.arange(first, first + n_q, device=allow.device)] = True
    return allow | (empty & diagonal)


def alibi_slopes(n_heads: int) -> list[float]:
    """The standard ALiBi slopes (Press et al.; StableMask's ``get_slopes``), docs/methods.md#stablemask.

    For H a power of two, 2^(-8(h+1)/H); otherwise the slopes of the largest power of two p < H
    followed by every other slope of the 2p-head set until there are H.
    """
    def power_of_two(h: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / h) for i in range(h)]

    p = 1 << (n_heads.bit_length() - 1)
    if p == n_heads:
        return power_of_two(n_heads)
    return power_of_two(p) + power_of_two(2 * p)[0::2][: n_heads - p]


def stable_gammas(stable: float | str | None, n_heads: int) -> torch.Tensor:
    """Per-head gamma: a scalar for every head, or the ALiBi slopes."""
    if stable == "alibi":
        return torch.tensor(alibi_slopes(n_heads))
    return torch.full((n_heads,), float(stable))


def _positive_int(value, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or int(value) != value or value < minimum:
        raise MaskError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _direction(direction: str) -> str:
    if direction not in ("fwd", "bidir"):
        raise MaskError(f"dir must be 'fwd' or 'bidir', got {direction!r}")
    return direction


def fwd() -> Mask:
    return Mask("fwd", causal, causal_compatible=True)


def back() -> Mask:
    return Mask("back", anticausal)


def bidir() -> Mask:
    return Mask("bidir", everything)


def nosink(base: Mask, m: int = 1) -> Mask:
    """NoSink-X: X with the first m keys hidden from later queries (docs/methods.md#masks)."""
    m = _positive_int(m, "m")
    name = f"nosink-{base.name}" + (f"(m={m})" if m != 1 else "")
    return Mask(name, and_masks(base.predicate, hide_first_keys(m)), base.causal_compatible, base.stable,
                horizon=base.horizon)


def sliding(w: int, direction: str = "fwd") -> Mask:
    """Causal local window ``i - j < w``; the bidirectional one is ``|i - j| <= w // 2``."""
    w = _positive_int(w, "w")
    if _direction(direction) == "bidir":
        return Mask(f"sliding(w={w}, dir=bidir)", within_symmetric(w // 2))
    return Mask(f"sliding(w={w})", and_masks(causal, within(w)), causal_compatible=True)


def dilated(w: int, d: int) -> Mask:
    """Longformer dilated window: every d-th key, w of them, counting the query itself."""
    w, d = _positive_int(w, "w"), _positive_int(d, "d")
    return Mask(f"dilated(w={w}, d={d})", and_masks(causal, on_stride(d, w * d)), causal_compatible=True)


def global_sliding(w: int, g: int = 1, direction: str = "fwd") -> Mask:
    """Sliding window plus g global tokens that see and are seen by everyone (within FWD)."""
    w, g = _positive_int(w, "w"), _positive_int(g, "g", minimum=0)
    if _direction(direction) == "bidir":
        return Mask(f"global(w={w}, g={g}, dir=bidir)", or_masks(within_symmetric(w // 2), global_tokens(g)))
    pred = and_masks(causal, or_masks(within(w), global_tokens(g)))
    return Mask(f"global(w={w}, g={g})", pred, causal_compatible=True)


def stablemask(gamma: float | None = None, slopes: str | None = None, T: int | None = None) -> Mask:
    """StableMask (docs/methods.md#stablemask): causal allow-set plus pseudo-attention ``-gamma*j`` on future keys.

    The pseudo-slots take part in the softmax and are zeroed after it, without renormalising, so
    rows sum to less than one. Not causal-compatible: a cached query would not see the future slots
    its full-sequence softmax had. With ``T`` it is SM-I, the inference variant: the future slots up
    to the training length T become one extra logit per row that does not depend on the current
    length, so it works with a KV cache (causal-compatible) and equals StableMask at n = T.
    """
    suffix = "" if T is None else f", T={_positive_int(T, 'T', minimum=2)}"
    if slopes is not None:
        if slopes != "alibi":
            raise MaskError(f"stablemask slopes must be 'alibi', got {slopes!r}")
        if gamma is not None:
            raise MaskError("stablemask takes gamma or slopes=alibi, not both")
        return Mask(f"stablemask(slopes=alibi{suffix})", causal, T is not None, stable="alibi", horizon=T)
    gamma = 0.5 if gamma is None else float(gamma)
    if not gamma > 0:
        raise MaskError(f"stablemask gamma must be > 0, got {gamma}")
    return Mask(f"stablemask(gamma={gamma:g}{suffix})", causal, T is not None, stable=gamma, horizon=T)


def custom(allow: np.ndarray | torch.Tensor | Predicate, name: str = "custom") -> Mask:
    """A user mask: a boolean ``n x n`` matrix (rows = queries) or a predicate.

    A matrix is validated (square, boolean, no empty row) and raises :class:`MaskError` otherwise:
    a hand-written matrix with an empty row is almost surely a mistake, so we say so rather than
    repair it. A predicate gets the general keep-self rule at capture time.
    """
    if callable(allow):
        return Mask(name, allow)
    matrix = torch.as_tensor(np.asarray(allow))
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise MaskError(f"custom mask must be a square n x n matrix, got shape {tuple(matrix.shape)}")
    if matrix.dtype != torch.bool:
        if not bool(((matrix == 0) | (matrix == 1)).all()):
            raise MaskError("custom mask must be boolean (or 0/1)")
        matrix = matrix.bool()
    empty = (~matrix.any(1)).nonzero().flatten().tolist()
    if empty:
        raise MaskError(f"custom mask leaves query row(s) {empty[:5]} with no key to attend to")
    n = matrix.shape[0]
    upper = bool(torch.triu(matrix, 1).any())

    def lookup(b, h, q, kv):
        return matrix.to(q.device)[q.clamp(0, n - 1), kv.clamp(0, n - 1)]

    return Mask(name, lookup, causal_compatible=not upper, size=n)
