"""Attention kinds (docs/methods.md#attention-kinds): what turns a row of scaled scores into the weights a query puts
on the keys its mask allows, one more axis of a recipe beside the mask.

Each kind is a small frozen object named in the call syntax (``softmax``, ``sink(logit=0)``, ``softpick``,
``sigmoid(bias=0)``, ``gate(headwise)``) with one method, :meth:`Kind.weights`: scores ``z`` (..., n_kv) with the
mask's −inf on forbidden keys (and StableMask's pseudo-logits where the recipe has them) to weights of the same
shape. A row may sum to less than 1 (a learned sink, softpick, sigmoid) or more (sigmoid): the maps show it as it is,
the remainder being the row's discarded mass.

- ``softmax``: p = exp(z) / Σ exp(z).
- ``sink(logit=s)``: a logit per head outside the keys, p = exp(z) / (exp(s) + Σ exp(z)) (gpt-oss's learned sink;
  ``sink(logit=0)`` is softmax-off-by-one, Miller 2023). ``logit`` None: the model's own learned one per head.
- ``softpick`` (Zuhri et al. 2025): p_k = ReLU(exp(z_k) − 1) / (Σ_j |exp(z_j) − 1| + ε), computed with the row's
  maximum m as ReLU(exp(z_k − m) − exp(−m)) / (Σ_j |exp(z_j − m) − exp(−m)| + ε); forbidden keys take no part.
- ``sigmoid(bias=b)`` (Ramapuram et al. 2024): p_k = σ(z_k + b); b None: −log of the keys the row allows.
- ``gate`` (Qiu et al. 2025, position G1): the weights are the softmax's; the head's output is multiplied by
  σ(x W_g) before the output projection (one gate a head dimension, or one a head with ``headwise``), x the layer's
  normalised input: a gate changes what the head writes, not its map.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from attnviz.errors import InputError

EPS = 1e-6  # softpick's ε


@dataclass(frozen=True)
class Kind:
    name: ClassVar[str] = ""

    @property
    def spec(self) -> str:
        return self.name

    def weights(self, z: torch.Tensor, sink: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    @property
    def sums_to_one(self) -> bool:
        return False


@dataclass(frozen=True)
class Softmax(Kind):
    name: ClassVar[str] = "softmax"

    def weights(self, z, sink=None):
        return torch.softmax(z.float(), dim=-1)

    @property
    def sums_to_one(self) -> bool:
        return True


@dataclass(frozen=True)
class Sink(Kind):
    """A logit outside the keys: ``logit`` a number (the same in every head), or None for the model's own learned
    one per head (given to :meth:`weights` as ``sink``, shape (heads,))."""

    name: ClassVar[str] = "sink"
    logit: float | None = None

    @property
    def spec(self) -> str:
        return "sink" if self.logit is None else f"sink(logit={self.logit:g})"

    def weights(self, z, sink=None):
        z = z.float()
        if self.logit is not None:
            s = torch.full(z.shape[:-1] + (1,), float(self.logit), device=z.device)
        elif sink is None:
            raise InputError("sink: this layer has no learned sink logit; give one, sink(logit=0)")
        else:  # (heads,) against z (..., heads, q, k)
            s = sink.float().to(z.device).view(-1, 1, 1).expand(z.shape[:-1] + (1,))
        both = torch.cat([z, s], dim=-1)
        return torch.softmax(both, dim=-1)[..., :-1]


@dataclass(frozen=True)
class Softpick(Kind):
    name: ClassVar[str] = "softpick"
    eps: float = EPS

    def weights(self, z, sink=None):
        z = z.float()
        allowed = torch.isfinite(z)
        m = torch.where(allowed, z, torch.full_like(z, -math.inf)).amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row with no allowed key: all zero
        # exp(z - m) - exp(-m) = exp(-m)·(e^z - 1), with expm1 where the difference would cancel (z near 0):
        # exp(-m)·expm1(z) for z <= 0, -exp(z - m)·expm1(-z) above; neither overflows where the other might
        zs = torch.where(allowed, z, torch.zeros_like(z))
        below = torch.exp(-m) * torch.expm1(zs.clamp(max=0))
        above = -torch.exp(zs - m) * torch.expm1(-zs.clamp(min=0))
        shifted = torch.where(allowed, torch.where(zs > 0, above, below), torch.zeros_like(z))
        return torch.relu(shifted) / (shifted.abs().sum(dim=-1, keepdim=True) + self.eps)


@dataclass(frozen=True)
class Sigmoid(Kind):
    name: ClassVar[str] = "sigmoid"
    bias: float | None = None

    @property
    def spec(self) -> str:
        return "sigmoid" if self.bias is None else f"sigmoid(bias={self.bias:g})"

    def weights(self, z, sink=None):
        z = z.float()
        allowed = torch.isfinite(z)
        if self.bias is None:
            b = -torch.log(allowed.sum(dim=-1, keepdim=True).clamp(min=1).float())
        else:
            b = torch.tensor(float(self.bias), device=z.device)
        return torch.where(allowed, torch.sigmoid(z + b), torch.zeros_like(z))


@dataclass(frozen=True)
class Gate(Kind):
    """The softmax's weights; the head's output gated by σ(x W_g) (elementwise, or one scalar a head)."""

    name: ClassVar[str] = "gate"
    headwise: bool = False

    @property
    def spec(self) -> str:
        return "gate(headwise)" if self.headwise else "gate"

    def weights(self, z, sink=None):
        return torch.softmax(z.float(), dim=-1)

    @property
    def sums_to_one(self) -> bool:
        return True

    @staticmethod
    def gated(out: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
        """A head's output (..., heads, q, d) times σ of its gate logits ((..., heads, q, d) elementwise, or
        (..., heads, q, 1) headwise)."""
        return out * torch.sigmoid(gate_logits.to(out.dtype))


KINDS = {k.name: k for k in (Softmax, Sink, Softpick, Sigmoid, Gate)}
_CALL = re.compile(r"^([a-z]+)(?:\((.*)\))?$")


def parse(text) -> Kind:
    """A kind from its call syntax: ``softmax``, ``sink``, ``sink(logit=0)``, ``softpick``, ``softpick(eps=1e-6)``,
    ``sigmoid``, ``sigmoid(bias=0)``, ``gate``, ``gate(headwise)``; refused in one line otherwise."""
    if isinstance(text, Kind):
        return text
    if not isinstance(text, str):
        raise InputError(f"an attention kind is a name such as softmax or sink(logit=0), not {text!r}")
    match = _CALL.match(re.sub(r"\s+", "", text.lower()))
    if match is None or match.group(1) not in KINDS:
        raise InputError(f"unknown attention kind {text!r}: expected one of {', '.join(KINDS)}")
    name, args = match.group(1), [a for a in (match.group(2) or "").split(",") if a]
    if name == "gate":
        if args not in ([], ["headwise"], ["elementwise"]):
            raise InputError(f"gate takes headwise or elementwise, not {','.join(args)!r}")
        return Gate(headwise=args == ["headwise"])
    allowed = {"sink": "logit", "softpick": "eps", "sigmoid": "bias"}.get(name)
    values = {}
    for arg in args:
        key, _, value = arg.partition("=")
        if key != allowed or not value:
            raise InputError(f"{name} takes {allowed + '=' if allowed else 'no arguments'}"
                             f"{'a number' if allowed else ''}, not {arg!r}")
        try:
            number = float(value)
        except ValueError:
            raise InputError(f"{name}({key}=...) is a number, not {value!r}") from None
        if not math.isfinite(number) or (key == "eps" and number <= 0):
            raise InputError(f"{name}({key}=...) is a finite number{' above 0' if key == 'eps' else ''}, not {value}")
        values[key] = number
    return KINDS[name](**values)


@functools.lru_cache(maxsize=64)
def _parsed(spec: str) -> Kind:
    return parse(spec)


def own(config) -> Kind:
    """A model's own kind, from its config: what a lab model was trained with (``attnviz_kind`` in its config.json),
    gpt-oss's learned sink, Qwen3-Next's gate, else the softmax. A recipe without a kind runs this one."""
    config = getattr(config, "config", config)
    spec = getattr(config, "attnviz_kind", None)
    if spec:
        return _parsed(str(spec))
    family = getattr(config, "model_type", "")
    return Sink() if family == "gpt_oss" else Gate() if family == "qwen3_next" else Softmax()


def sink_logits(kind: Kind, learned, n_heads: int, device) -> "torch.Tensor | None":
    """The logits (heads,) of the sink column the kind adds to each row, dropped after the softmax: a model's own
    learned ones (``learned``, gpt-oss's), one number in every head, or None (no such column: a model's learned sink
    left out is a what-if, as a mask is)."""
    if not isinstance(kind, Sink):
        return None
    if kind.logit is not None:
        return torch.full((n_heads,), float(kind.logit), device=device)
    if learned is None:
        raise InputError("sink: this model has no learned sink logits; give one, sink(logit=0)")
    return learned


def weigher(kind: Kind):
    """The kind's own ``weights`` where a row is not a softmax (softpick, sigmoid), else None: the softmax (with its
    sink column for ``sink``; the gate's map is the softmax's)."""
    return kind.weights if isinstance(kind, (Softpick, Sigmoid)) else None


def check(kind: Kind, config, stable: bool) -> Kind:
    """Refuse, in one line, a kind this model or mask cannot run: a gate without the gate's trained weights (or
    another kind on a gated model, whose gate is in its own attention code), a learned sink without learned logits,
    and sigmoid under StableMask (sigmoid has no normalisation for its pseudo-logits to take mass from)."""
    mine = own(config)
    family = getattr(getattr(config, "config", config), "model_type", "this model")
    if isinstance(kind, Gate) != isinstance(mine, Gate) or (isinstance(kind, Gate) and kind != mine):
        if isinstance(mine, Gate):
            raise InputError(f"{family} is trained with {mine.spec}, applied in its own attention code: "
                             f"{kind.spec} cannot replace it")
        raise InputError(f"{kind.spec} needs the gate's trained weights, which {family} does not have "
                         "(a model trained with it: Qwen3-Next, or a lab model trained with gate)")
    if isinstance(kind, Sink) and kind.logit is None and not (isinstance(mine, Sink) and mine.logit is None):
        raise InputError(f"sink needs learned sink logits, which {family} does not have: give one, sink(logit=0)")
    if isinstance(kind, Sigmoid) and stable:
        raise InputError("sigmoid cannot combine with StableMask: a sigmoid row has no normalisation for the "
                         "pseudo-logits to take mass from (docs/methods.md#attention-kinds)")
    return kind


def eager(kind: Kind, query, key, value, attention_mask, scaling: float, learned=None):
    """A layer's attention under ``kind`` written out plainly (outside a run: the model's own forward, training):
    scores, the mask's −inf (a boolean mask, or transformers' additive one), the kind's weights, the values.
    Returns ``(output (B, n_q, H, d), weights (B, H, n_q, n_kv))`` as transformers' eager attention does."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    z = torch.matmul(query.float() * scaling, key.float().transpose(-1, -2))  # scaled as the engine scales
    n_q, n_kv = z.shape[-2:]
    if attention_mask is None:
        attention_mask = torch.ones(n_q, n_kv, dtype=torch.bool, device=z.device).tril(n_kv - n_q)
    if attention_mask.dtype == torch.bool:
        z = z.masked_fill(~attention_mask[..., :n_kv], -math.inf)
    else:
        additive = attention_mask[..., :n_kv].float()
        z = torch.where(additive > torch.finfo(attention_mask.dtype).min / 2, z + additive, -math.inf)
    sink = sink_logits(kind, learned, z.shape[1], z.device)
    weigh = weigher(kind)
    if weigh is not None:
        w = weigh(z)
    elif sink is not None:
        w = Sink().weights(z, sink=sink)
    else:
        w = torch.softmax(z, dim=-1)
    w = torch.nan_to_num(w)  # a row with no allowed key: zero, not NaN
    return torch.matmul(w.to(value.dtype), value).transpose(1, 2).contiguous(), w
