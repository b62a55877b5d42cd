"""Training-free interventions beyond masks (docs/methods.md#interventions): what a layer does with its scores, its
probabilities or its heads' outputs, given as its own string beside the architecture.

Each intervention is a small named object with its documented name (docs/methods.md#interventions), in the style of transformers'
mask predicates: it says which layers it acts in and transforms one thing (scores before the
softmax, an extra logit, probabilities after it, or the heads' outputs). The engine's one attention
function applies them (:mod:`attnviz.core.engine`); no model is ever patched. Several compose, joined
with ``;``, each with ``@LAYERS`` (``20-29``, ``0,5,7``; every layer when left out):

    sinkscale(beta=0.3)@20-29; ablate(heads=0,3)@5

- ``sinklogit(b=B)``: one extra logit B in every row's softmax, dropped after it (a key with a zero
  value, as gpt-oss's learned sinks): rows sum to less than 1. B = 0 is softmax-off-by-one.
- ``sinkscale(key=K, beta=β)``: ACT's calibration (Yu et al. 2024): A'[i,K] = β·A[i,K], the removed
  mass spread over the row's other keys in proportion to their weights.
- ``temperature(t=T)``: scores divided by T before the softmax.
- ``ablate(heads=H…, how=zero|mean)``: those heads' outputs (before W_O) replaced by zero or by
  their mean over the forward's positions.
- ``headwindow(heads=H…, s=S, w=W)``: those heads see only the first S keys and the last W (StreamingLLM's
  sink + window cache, per head); the others keep the layer's mask.
- ``patch(block=mlp|attn, tokens=T, value=zero|mean)``: the block's output, where the residual stream adds it,
  replaced at the token positions T (``0``, ``0,1`` or ``sink``, the layer's own sink key) by zero or by its
  mean over the other positions (activation patching; the write modules are the model anatomy's,
  :mod:`attnviz.core.model.anatomy`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from attnviz.core.spec import syntax
from attnviz.errors import InputError

#: Every intervention by name; parameters, types and defaults are read from each class's fields.
INTERVENTIONS = syntax.Registry("intervention")


@dataclass(frozen=True, kw_only=True)
class Intervention:
    """One intervention; ``layers`` None means every layer."""

    name: ClassVar[str] = ""
    changes_probabilities: ClassVar[bool] = True  # False: only the heads' outputs change (SDPA may compute it)
    layers: tuple[int, ...] | None = None

    def applies(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def check(self, n_layers: int, n_heads: int) -> None:
        """Refuse what does not exist in a model of this size (the layers are checked by the parser)."""

    def outside(self, n_tokens: int) -> str:
        """What it names past the end of a text of ``n_tokens`` tokens ("" when nothing): it would change nothing."""
        return ""

    def scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Scaled scores (B, H, b, w) before the softmax."""
        return scores

    def extra_logit(self) -> float | None:
        """One more logit every row's softmax sees, dropped after it."""
        return None

    def probabilities(self, probs: torch.Tensor, k0: int) -> torch.Tensor:
        """Probabilities (B, H, b, w) of keys k0 .. k0 + w - 1 (every key these rows may see)."""
        return probs

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Every head's attention output (B, H, n, d), before the output projection W_O."""
        return out

    def patches(self, block: str) -> bool:
        """Whether it replaces the output of ``block`` ("attn" or "mlp") where the residual stream adds it."""
        return False

    def block_output(self, out: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                     sink_key: int) -> torch.Tensor:
        """A block's output (B, n, d) as the residual stream adds it, for rows at ``positions`` (B, n) of which
        ``valid`` (B, n) are real tokens; ``sink_key`` is the layer's own sink key (docs/methods.md#auto-key)."""
        return out

    def key_mask(self, q_pos: torch.Tensor, kv_pos: torch.Tensor, n_heads: int) -> torch.Tensor | None:
        """A per-head allow-set (H, n_q, n_kv) and-ed with the layer's mask, from the positions (n_q,) and (n_kv,)
        of the queries and keys; None: every key the mask allows."""
        return None

    def arguments(self) -> str:
        call = INTERVENTIONS.spec(self)
        return call[len(self.name) + 1:-1] if call.endswith(")") else ""

    @property
    def spec(self) -> str:
        where = "" if self.layers is None else "@" + syntax.ranges(self.layers)
        return INTERVENTIONS.spec(self) + where


@INTERVENTIONS.register()
@dataclass(frozen=True, kw_only=True)
class SinkLogit(Intervention):
    """One extra logit ``b`` in every row's softmax, dropped after it (docs/methods.md#sinklogit)."""

    name: ClassVar[str] = "sinklogit"
    b: float = 0.0

    def extra_logit(self) -> float:
        return self.b


@INTERVENTIONS.register()
@dataclass(frozen=True, kw_only=True)
class SinkScale(Intervention):
    """ACT's calibration: key ``key``'s weight times ``beta``, the rest spread (docs/methods.md#sinkscale)."""

    name: ClassVar[str] = "sinkscale"
    key: int = 0
    beta: float = 1.0

    def __post_init__(self):
        if not 0.0 <= self.beta <= 1.0:
            raise InputError(f"sinkscale beta must be between 0 and 1, got {self.beta:g}")
        if self.key < 0:
            raise InputError(f"sinkscale key must be a token position >= 0, got {self.key}")

    def outside(self, n_tokens: int) -> str:
        return f"key {self.key}" if self.key >= n_tokens else ""

    def probabilities(self, probs: torch.Tensor, k0: int) -> torch.Tensor:
        c = self.key - k0
        if not 0 <= c < probs.shape[-1]:
            return probs  # these rows cannot see key K: nothing to move
        col = probs[..., c:c + 1]
        rest = probs.sum(-1, keepdim=True) - col
        moved = (1.0 - self.beta) * col
        has_rest = rest > 0
        spread = probs * torch.where(has_rest, 1.0 + moved / torch.where(has_rest, rest, 1.0), 1.0)
        is_key = torch.arange(probs.shape[-1], device=probs.device) == c
        return torch.where(is_key, torch.where(has_rest, self.beta * col, col), spread)


@INTERVENTIONS.register()
@dataclass(frozen=True, kw_only=True)
class Temperature(Intervention):
    """Scores divided by ``t`` before the softmax (docs/methods.md#temperature)."""

    name: ClassVar[str] = "temperature"
    t: float = 1.0

    def __post_init__(self):
        if self.t <= 0:
            raise InputError(f"temperature t must be > 0, got {self.t:g}")

    def scores(self, scores: torch.Tensor) -> torch.Tensor:
        return scores / self.t


@INTERVENTIONS.register()
@dataclass(frozen=True, kw_only=True)
class Ablate(Intervention):
    """Those heads' outputs replaced by zero or their mean over positions (docs/methods.md#ablate)."""

    name: ClassVar[str] = "ablate"
    changes_probabilities: ClassVar[bool] = False
    heads: tuple[int, ...]
    how: str = "zero"

    def __post_init__(self):
        object.__setattr__(self, "heads", tuple(sorted(set(int(h) for h in self.heads))))
        object.__setattr__(self, "how", str(self.how).strip().lower())
        if not self.heads:
            raise InputError("ablate needs heads=..., e.g. ablate(heads=0,3)")
        if self.how not in ("zero", "mean"):
            raise InputError(f"ablate how must be zero or mean, got '{self.how}'")

    def check(self, n_layers: int, n_heads: int) -> None:
        bad = [h for h in self.heads if not 0 <= h < n_heads]
        if bad:
            raise InputError(f"head {bad[0]} does not exist: the model has heads 0..{n_heads - 1}")

    def output(self, out: torch.Tensor) -> torch.Tensor:
        chosen = torch.zeros(out.shape[1], dtype=torch.bool, device=out.device)
        chosen[list(self.heads)] = True
        replacement = out.mean(dim=2, keepdim=True) if self.how == "mean" else torch.zeros_like(out[:, :, :1])
        return torch.where(chosen[None, :, None, None], replacement, out)


@INTERVENTIONS.register()
@dataclass(frozen=True, kw_only=True)
class HeadWindow(Intervention):
    """Those heads see only the first ``s`` keys and the last ``w`` (docs/methods.md#headwindow)."""

    name: ClassVar[str] = "headwindow"
    heads: tuple[int, ...]
    s: int = 4
    w: int = 64

    def __post_init__(self):
        object.__setattr__(self, "heads", tuple(sorted(set(int(h) for h in self.heads))))
        if not self.heads:
            raise InputError("headwindow needs heads=..., e.g. headwindow(heads=0,3, s=4, w=64)")
        if self.s < 0 or self.w < 1:
            raise InputError(f"headwindow needs s >= 0 and w >= 1, got s={self.s}, w={self.w}")

    def check(self, n_layers: int, n_heads: int) -> None:
        bad = [h for h in self.heads if not 0 <= h < n_heads]
        if bad:
            raise InputError(f"head {bad[0]} does not exist: the model has heads 0..{n_heads - 1}")

    def key_mask(self, q_pos: torch.Tensor, kv_pos: torch.Tensor, n_heads: int) -> torch.Tensor:
        i, j = q_pos[:, None], kv_pos[None, :]
        window = (j < self.s) | ((j <= i) & (j > i - self.w))  # (n_q, n_kv)
        chosen = torch.zeros(n_heads, dtype=torch.bool, device=q_pos.device)
        chosen[list(self.heads)] = True
        return window[None] | ~chosen[:, None, None]


BLOCKS = ("mlp", "attn", "embed")  # what patch replaces: a block's write, or the embedding's


@INTERVENTIONS.register()
@dataclass(frozen=True, kw_only=True)
class Patch(Intervention):
    """A block's output replaced at some tokens by zero or its mean elsewhere (docs/methods.md#patch). ``block``
    ``embed`` is the embedding's write (the first layer's input); ``rows``: the batch rows it changes (None: every
    row), so that one batch holds several patches, one a row (the causal scan)."""

    name: ClassVar[str] = "patch"
    changes_probabilities: ClassVar[bool] = False  # its own layer's attention is untouched: SDPA may compute it
    block: str = "mlp"
    tokens: str = "0"
    value: str = "zero"
    rows: tuple[int, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "block", str(self.block).strip().lower())
        object.__setattr__(self, "value", str(self.value).strip().lower())
        if self.block not in BLOCKS:
            raise InputError(f"patch block must be {', '.join(BLOCKS[:-1])} or {BLOCKS[-1]}, got '{self.block}'")
        if self.value not in ("zero", "mean"):
            raise InputError(f"patch value must be zero or mean, got '{self.value}'")
        if self.rows is not None and (not self.rows or min(self.rows) < 0):
            raise InputError(f"patch rows are batch rows such as 0 or 0,2; got {self.rows!r}")
        text = str(self.tokens).replace(" ", "").lower()
        if text != "sink":
            try:
                chosen = sorted({int(t) for t in text.split(",") if t})
            except ValueError:
                chosen = []
            if not chosen or chosen[0] < 0:
                raise InputError(f"patch tokens must be positions such as 0 or 0,1, or sink; got '{self.tokens}'")
            text = ",".join(map(str, chosen))
        object.__setattr__(self, "tokens", text)

    def check(self, n_layers: int, n_heads: int) -> None:
        if self.block == "embed" and self.layers not in (None, (0,)):
            raise InputError("patch(block=embed) replaces the first layer's input: give it @0 or no layers")

    def patches(self, block: str) -> bool:
        return block == self.block

    def outside(self, n_tokens: int) -> str:
        past = [] if self.tokens == "sink" else [t for t in self.positions(0) if t >= n_tokens]
        return f"token{'s' * (len(past) > 1)} {','.join(map(str, past))}" if past else ""

    def positions(self, sink_key: int) -> list[int]:
        """The patched token positions: the listed ones, or the layer's sink key."""
        return [sink_key] if self.tokens == "sink" else [int(t) for t in self.tokens.split(",")]

    def block_output(self, out, positions, valid, sink_key):
        chosen = torch.isin(positions, torch.tensor(self.positions(sink_key), device=positions.device))  # (B, n)
        if self.rows is not None:
            if max(self.rows) >= out.shape[0]:
                raise InputError(f"patch rows {self.rows} past the batch's {out.shape[0]} rows")
            mine = torch.zeros(out.shape[0], dtype=torch.bool, device=chosen.device)
            mine[list(self.rows)] = True
            chosen = chosen & mine[:, None]
        if not bool(chosen.any()):
            return out
        if self.value == "zero":
            replacement = torch.zeros_like(out)
        else:
            # counted and summed in float32: in bfloat16 a count of 3,000 reads 3,008 (docs/methods.md#devices)
            others = (valid & ~chosen).to(torch.float32)[..., None]  # (B, n, 1)
            count = others.sum(1, keepdim=True)
            if not bool((count > 0).all()):
                raise InputError("patch(value=mean) needs other positions in the same forward to average over; a "
                                 "token fed alone (decoding with a KV cache) has none: use value=zero there")
            replacement = ((out.float() * others).sum(1, keepdim=True) / count).to(out.dtype).expand_as(out)
        return torch.where(chosen[..., None], replacement, out)


USAGE = ("sinklogit(b=B), sinkscale(key=K, beta=B), temperature(t=T), ablate(heads=H,..., how=zero|mean), "
         "headwindow(heads=H,..., s=S, w=W) or patch(block=mlp|attn|embed, tokens=0|0,1|sink, value=zero|mean), "
         "each with an optional @LAYERS (20-29, 0,5,7), joined with ';'")


@dataclass(frozen=True)
class Interventions:
    """The parsed, checked interventions of one string; ``spec`` is its canonical form (metadata,
    file names and cache keys)."""

    items: tuple[Intervention, ...] = ()
    spec: str = field(default="")

    def at(self, layer: int) -> tuple[Intervention, ...]:
        return tuple(i for i in self.items if i.applies(layer))

    def masks_heads(self, layer: int) -> bool:
        """Whether some intervention at ``layer`` gives heads key masks of their own (``key_mask``: headwindow)."""
        return any(type(a).key_mask is not Intervention.key_mask for a in self.at(layer))

    def __bool__(self) -> bool:
        return bool(self.items)

    def plus(self, *more: Intervention) -> "Interventions":
        """These and ``more``, applied after them."""
        items = self.items + tuple(more)
        return Interventions(items, "; ".join(i.spec for i in items))


NONE = Interventions()


def parse(text: str | None, n_layers: int, n_heads: int) -> Interventions:
    """``text`` → :class:`Interventions` for a model of ``n_layers`` layers and ``n_heads`` heads;
    anything wrong is an :class:`InputError` that says what to write instead."""
    if text is None or not str(text).strip() or str(text).strip().lower() == "none":
        return NONE
    items = []
    for part in syntax.split(str(text)):
        parsed = syntax.call(part, "the intervention", USAGE)
        layers = None if parsed.layers is None else tuple(syntax.layers(parsed.layers, n_layers, part))
        item = INTERVENTIONS.build(parsed, layers=layers)
        item.check(n_layers, n_heads)
        items.append(item)
    result = tuple(items)
    return Interventions(result, "; ".join(i.spec for i in result))


def resolve(value, n_layers: int, n_heads: int) -> Interventions:
    """A string, None or already parsed :class:`Interventions`."""
    return value if isinstance(value, Interventions) else parse(value, n_layers, n_heads)
