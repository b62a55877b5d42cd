"""Training-free interventions beyond masks (SPEC §12): what a layer does with its scores, its
probabilities or its heads' outputs, given as its own string beside the architecture.

Each intervention is a small named object with the SPEC's name, in the style of transformers'
mask predicates: it says which layers it acts in and transforms one thing (scores before the
softmax, an extra logit, probabilities after it, or the heads' outputs). The engine's one attention
function applies them (:mod:`attnviz.engine`); no model is ever patched. Several compose, joined
with ``;``, each with ``@LAYERS`` (``20-29``, ``0,5,7``; every layer when left out):

    sinkscale(beta=0.3)@20-29; ablate(heads=0,3)@5

- ``sinklogit(b=B)``: one extra logit B in every row's softmax, dropped after it (a key with a zero
  value, as gpt-oss's learned sinks): rows sum to less than 1. B = 0 is softmax-off-by-one.
- ``sinkscale(key=K, beta=β)``: ACT's calibration (Yu et al. 2024): A'[i,K] = β·A[i,K], the removed
  mass spread over the row's other keys in proportion to their weights.
- ``temperature(t=T)``: scores divided by T before the softmax.
- ``ablate(heads=H…, how=zero|mean)``: those heads' outputs (before W_O) replaced by zero or by
  their mean over the forward's positions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from .errors import InputError


@dataclass(frozen=True, kw_only=True)
class Intervention:
    """One intervention; ``layers`` None means every layer."""

    name = ""
    changes_probabilities = True  # False: only the heads' outputs change (SDPA may compute the layer)
    layers: tuple[int, ...] | None = None

    def applies(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

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

    def arguments(self) -> str:
        return ""

    @property
    def spec(self) -> str:
        args = self.arguments()
        where = "" if self.layers is None else "@" + _ranges(self.layers)
        return f"{self.name}({args}){where}" if args else f"{self.name}{where}"


@dataclass(frozen=True, kw_only=True)
class SinkLogit(Intervention):
    name = "sinklogit"
    b: float = 0.0

    def extra_logit(self) -> float:
        return self.b

    def arguments(self) -> str:
        return f"b={_num(self.b)}"


@dataclass(frozen=True, kw_only=True)
class SinkScale(Intervention):
    name = "sinkscale"
    key: int = 0
    beta: float = 1.0

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

    def arguments(self) -> str:
        return f"key={self.key}, beta={_num(self.beta)}"


@dataclass(frozen=True, kw_only=True)
class Temperature(Intervention):
    name = "temperature"
    t: float = 1.0

    def scores(self, scores: torch.Tensor) -> torch.Tensor:
        return scores / self.t

    def arguments(self) -> str:
        return f"t={_num(self.t)}"


@dataclass(frozen=True, kw_only=True)
class Ablate(Intervention):
    name = "ablate"
    changes_probabilities = False
    heads: tuple[int, ...] = ()
    how: str = "zero"

    def output(self, out: torch.Tensor) -> torch.Tensor:
        chosen = torch.zeros(out.shape[1], dtype=torch.bool, device=out.device)
        chosen[list(self.heads)] = True
        replacement = out.mean(dim=2, keepdim=True) if self.how == "mean" else torch.zeros_like(out[:, :, :1])
        return torch.where(chosen[None, :, None, None], replacement, out)

    def arguments(self) -> str:
        return f"heads={','.join(map(str, self.heads))}, how={self.how}"


KINDS = {cls.name: cls for cls in (SinkLogit, SinkScale, Temperature, Ablate)}
USAGE = ("sinklogit(b=B), sinkscale(key=K, beta=B), temperature(t=T) or ablate(heads=H,..., how=zero|mean), "
         "each with an optional @LAYERS (20-29, 0,5,7), joined with ';'")


@dataclass(frozen=True)
class Interventions:
    """The parsed, checked interventions of one string; ``spec`` is its canonical form (metadata,
    file names and cache keys)."""

    items: tuple[Intervention, ...] = ()
    spec: str = field(default="")

    def at(self, layer: int) -> tuple[Intervention, ...]:
        return tuple(i for i in self.items if i.applies(layer))

    def __bool__(self) -> bool:
        return bool(self.items)


NONE = Interventions()


def parse(text: str | None, n_layers: int, n_heads: int) -> Interventions:
    """``text`` → :class:`Interventions` for a model of ``n_layers`` layers and ``n_heads`` heads;
    anything wrong is an :class:`InputError` that says what to write instead."""
    if text is None or not str(text).strip() or str(text).strip().lower() == "none":
        return NONE
    items = []
    for part in (p.strip() for p in str(text).split(";")):
        if not part:
            continue
        match = re.fullmatch(r"([A-Za-z_]\w*)\s*(?:\((.*)\))?\s*(?:@\s*(.+))?", part)
        if not match:
            raise InputError(f"cannot read the intervention '{part}': write {USAGE}")
        name, args, where = match.group(1).lower(), match.group(2) or "", match.group(3)
        if name not in KINDS:
            raise InputError(f"unknown intervention '{name}': use {USAGE}")
        layers = None if where is None else _layers(where, n_layers, part)
        items.append(_build(name, _arguments(args, part), layers, n_heads, part))
    result = tuple(items)
    return Interventions(result, "; ".join(i.spec for i in result))


def resolve(value, n_layers: int, n_heads: int) -> Interventions:
    """A string, None or already parsed :class:`Interventions`."""
    return value if isinstance(value, Interventions) else parse(value, n_layers, n_heads)


def _build(name: str, args: dict[str, str], layers, n_heads: int, part: str) -> Intervention:
    allowed = {"sinklogit": {"b"}, "sinkscale": {"key", "beta"}, "temperature": {"t"}, "ablate": {"heads", "how"}}[name]
    unknown = set(args) - allowed
    if unknown:
        raise InputError(f"{name} takes {', '.join(sorted(allowed))}, not {', '.join(sorted(unknown))} (in '{part}')")
    if name == "sinklogit":
        return SinkLogit(b=_float(args.get("b", "0"), "b", part), layers=layers)
    if name == "sinkscale":
        beta = _float(args.get("beta", "1"), "beta", part)
        if not 0.0 <= beta <= 1.0:
            raise InputError(f"sinkscale beta must be between 0 and 1, got {_num(beta)}")
        key = _int(args.get("key", "0"), "key", part)
        if key < 0:
            raise InputError(f"sinkscale key must be a token position >= 0, got {key}")
        return SinkScale(key=key, beta=beta, layers=layers)
    if name == "temperature":
        t = _float(args.get("t", "1"), "t", part)
        if t <= 0:
            raise InputError(f"temperature t must be > 0, got {_num(t)}")
        return Temperature(t=t, layers=layers)
    heads = tuple(sorted({_int(h, "heads", part) for h in args.get("heads", "").split(",") if h.strip()}))
    if not heads:
        raise InputError(f"ablate needs heads=..., e.g. ablate(heads=0,3) (in '{part}')")
    bad = [h for h in heads if not 0 <= h < n_heads]
    if bad:
        raise InputError(f"head {bad[0]} does not exist: the model has heads 0..{n_heads - 1}")
    how = args.get("how", "zero").strip().lower()
    if how not in ("zero", "mean"):
        raise InputError(f"ablate how must be zero or mean, got '{how}'")
    return Ablate(heads=heads, how=how, layers=layers)


def _arguments(text: str, part: str) -> dict[str, str]:
    """``a=1, heads=0,3`` → {"a": "1", "heads": "0,3"}: a piece without '=' continues the last value."""
    out: dict[str, str] = {}
    last = None
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if "=" in piece:
            key, value = (s.strip() for s in piece.split("=", 1))
            out[key.lower()] = value
            last = key.lower()
        elif last is not None:
            out[last] += "," + piece
        else:
            raise InputError(f"cannot read '{piece}' in '{part}': arguments are name=value")
    return out


def _layers(text: str, n_layers: int, part: str) -> tuple[int, ...]:
    chosen = set()
    for piece in (p.strip() for p in text.split(",")):
        bounds = piece.split("-")
        try:
            lo, hi = (int(bounds[0]), int(bounds[-1])) if len(bounds) <= 2 else (None, None)
        except ValueError:
            lo = hi = None
        if lo is None:
            raise InputError(f"cannot read the layers '{text}' in '{part}': write 20-29 or 0,5,7")
        for layer in (lo, hi):
            if not 0 <= layer < n_layers:
                raise InputError(f"layer {layer} does not exist: the model has layers 0..{n_layers - 1}")
        chosen.update(range(lo, hi + 1))
    return tuple(sorted(chosen))


def _ranges(layers: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) → '0-2,5'."""
    out, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            out.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ",".join(out)


def _float(value: str, name: str, part: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise InputError(f"{name} must be a number, got '{value}' (in '{part}')") from None


def _int(value: str, name: str, part: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise InputError(f"{name} must be a whole number, got '{value}' (in '{part}')") from None


def _num(x: float) -> str:
    return f"{x:g}"
