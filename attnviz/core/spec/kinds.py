"""Attention kinds (docs/methods.md#attention-kinds): what turns a row of scaled scores into the weights a query puts
on the keys its mask allows, one more axis of a recipe beside the mask.

Each kind is one frozen class registered in :data:`KINDS`, the call syntax's registry: its name, its arguments (its
fields), how the help writes it (``forms``), its help line (``line``: the definition and its paper), and what the
rest of attnviz reads of it (the family that trains it, whether its rows are its own weights, whether it combines
with StableMask, the app's what-ifs). Adding a kind is one class here: the parser, the lab, the recipe, the app's lists
and the command line's help read the registry (:func:`names`, :func:`help`). :meth:`Kind.weights` takes scores ``z``
(..., n_kv) with the mask's −inf on forbidden keys (and StableMask's pseudo-logits where the recipe has them) to
weights of the same shape; a row may sum to less than 1 (a learned sink, softpick, relu) or more (sigmoid, relu): the
maps show it as it is, the remainder being the row's discarded mass.
"""

from __future__ import annotations

import functools
import math
import re
import typing
from dataclasses import dataclass
from typing import ClassVar

import torch

from attnviz.core.spec import syntax
from attnviz.errors import InputError

EPS = 1e-6  # softpick's ε


class Kinds(syntax.Registry):
    """The call syntax's registry of attention kinds: its usage is each kind as the help writes it, and an argument
    that is not a number is refused as "is a number" (the kinds' own words) before the registry converts it."""

    def usage(self) -> str:
        return help()

    def build(self, parsed: syntax.Call, **extra):
        if parsed.name in self:
            for p in self.parameters(parsed.name):
                raw = parsed.args.get(p.name)
                if raw is not None and float in (p.type, *typing.get_args(p.type)):
                    try:
                        float(raw)
                    except ValueError:
                        raise InputError(f"{parsed.name}({p.name}=...) is a number, not {raw!r}") from None
        return super().build(parsed, **extra)


#: Every attention kind by name, in the order the help and the app list them.
KINDS = Kinds("attention kind")


def _finite(kind: str, key: str, value, above: float | None = None) -> None:
    if value is not None and (not math.isfinite(value) or (above is not None and value <= above)):
        raise InputError(f"{kind}({key}=...) is a finite number{f' above {above:g}' if above is not None else ''}, "
                         f"not {value:g}")


@dataclass(frozen=True)
class Kind:
    """One attention kind. Its class declares what the rest of attnviz reads (docs/methods.md#attention-kinds)."""

    name: ClassVar[str] = ""
    forms: ClassVar[tuple[str, ...]] = ()  # how the help writes it: ("sigmoid", "sigmoid(bias=b)")
    line: ClassVar[str] = ""  # its help line: the definition in a few words, with its paper
    what_ifs: ClassVar[tuple[str, ...]] = ()  # what the app offers on any model (no trained parameters needed)
    weighs: ClassVar[bool] = False  # its rows are its own weights, not a softmax's (the engine calls ``weights``)
    softmax_map: ClassVar[bool] = False  # its map is a softmax's (what score attribution and Linformer explain)
    with_stablemask: ClassVar[bool] = True  # False: StableMask's pseudo-logits have no normalisation to take from
    stock: ClassVar[str] = ""  # the transformers family whose own kind this is, in its default form
    in_code: ClassVar[bool] = False  # applied in the model's own attention code (trained weights): not a what-if

    @property
    def spec(self) -> str:
        return KINDS.spec(self)

    def weights(self, z: torch.Tensor, sink: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def trained_as(self) -> str:
        """The stock family a lab model of this kind is built as: its ``stock`` family in its default form, else
        ``"llama"`` with the kind in ``config.attnviz_kind`` (docs/lab.md#the-family-per-kind)."""
        return self.stock if self.stock and self == type(self)() else "llama"

    def needs(self, mine: "Kind", family: str) -> str:
        """Why a model of ``family`` whose own kind is ``mine`` cannot run this kind ("" when it can)."""
        return ""


@KINDS.register()
@dataclass(frozen=True)
class Softmax(Kind):
    name: ClassVar[str] = "softmax"
    forms: ClassVar[tuple[str, ...]] = ("softmax",)
    line: ClassVar[str] = "exp(z) / Σ exp(z)"
    what_ifs: ClassVar[tuple[str, ...]] = ("softmax",)
    softmax_map: ClassVar[bool] = True

    def weights(self, z, sink=None):
        return torch.softmax(z.float(), dim=-1)


@KINDS.register()
@dataclass(frozen=True)
class Sink(Kind):
    """A logit outside the keys: ``logit`` a number (the same in every head), or None for the model's own learned one
    per head (given to :meth:`weights` as ``sink``, (heads,)); ``init`` where the lab starts a learned one (gpt-oss's
    N(0, 0.02²) when None)."""

    name: ClassVar[str] = "sink"
    forms: ClassVar[tuple[str, ...]] = ("sink", "sink(logit=c)", "sink(init=c)")
    line: ClassVar[str] = ("exp(z) / (exp(c) + Σ exp(z)): a logit outside the keys, learned per head (gpt-oss) or c "
                           "(c = 0: softmax-off-by-one, Miller 2023)")
    what_ifs: ClassVar[tuple[str, ...]] = ("sink(logit=0)",)
    stock: ClassVar[str] = "gpt_oss"
    logit: float | None = None
    init: float | None = None

    def __post_init__(self):
        _finite("sink", "logit", self.logit), _finite("sink", "init", self.init)
        if self.logit is not None and self.init is not None:
            raise InputError("sink takes logit= (a fixed logit) or init= (where a learned one starts), not both")

    def trained_as(self) -> str:  # a learned sink, wherever it starts, is gpt-oss's
        return self.stock if self.logit is None else "llama"

    @property
    def softmax_map(self) -> bool:  # a model's own learned sink is the softmax it was trained with
        return self.logit is None

    def needs(self, mine, family):
        if self.logit is None and not (isinstance(mine, Sink) and mine.logit is None):
            return f"sink needs learned sink logits, which {family} does not have: give one, sink(logit=0)"
        return ""

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


@KINDS.register()
@dataclass(frozen=True)
class Softpick(Kind):
    name: ClassVar[str] = "softpick"
    forms: ClassVar[tuple[str, ...]] = ("softpick",)
    line: ClassVar[str] = "ReLU(exp(z) − 1) / (Σ |exp(z) − 1| + ε) (Zuhri et al. 2025)"
    what_ifs: ClassVar[tuple[str, ...]] = ("softpick",)
    weighs: ClassVar[bool] = True
    eps: float | None = None  # None: EPS

    def __post_init__(self):
        _finite("softpick", "eps", self.eps, above=0)
        if self.eps == EPS:
            object.__setattr__(self, "eps", None)  # one object, and one spec, for the default

    def weights(self, z, sink=None):
        z = z.float()
        allowed = torch.isfinite(z)
        m = torch.where(allowed, z, torch.full_like(z, -math.inf)).amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row with no allowed key: all zero
        x = torch.where(allowed, self.numerators(z, m), torch.zeros_like(z))
        return torch.relu(x) / (x.abs().sum(dim=-1, keepdim=True) + (EPS if self.eps is None else self.eps))

    @staticmethod
    def numerators(z, m, up_to: float = 80.0):
        """e^{z−m} − e^{−m} as e^{−m}·expm1(z), exact near z = 0; in a row whose maximum m passes ``up_to`` (expm1
        could overflow; e^{−m} < 10⁻³⁴) the difference; −e^{−m} on a forbidden cell. engine/lean.py: the same."""
        if not bool((big := m > up_to).any()):
            return torch.expm1(z) * torch.exp(-m)
        near = torch.expm1(z.clamp(max=up_to)) * torch.exp(-m)  # clamped: no inf, no NaN gradient
        return torch.where(big, torch.exp(z - m) - torch.exp(-m), near)


@KINDS.register()
@dataclass(frozen=True)
class Sigmoid(Kind):
    name: ClassVar[str] = "sigmoid"
    forms: ClassVar[tuple[str, ...]] = ("sigmoid", "sigmoid(bias=b)")
    line: ClassVar[str] = "σ(z + b), b = −log n by default (Ramapuram et al. 2024)"
    what_ifs: ClassVar[tuple[str, ...]] = ("sigmoid", "sigmoid(bias=0)")
    weighs: ClassVar[bool] = True
    with_stablemask: ClassVar[bool] = False
    bias: float | None = None

    def __post_init__(self):
        _finite("sigmoid", "bias", self.bias)

    def weights(self, z, sink=None):
        z = z.float()
        allowed = torch.isfinite(z)
        if self.bias is None:
            b = -torch.log(allowed.sum(dim=-1, keepdim=True).clamp(min=1).float())
        else:
            b = torch.tensor(float(self.bias), device=z.device)
        return torch.where(allowed, torch.sigmoid(z + b), torch.zeros_like(z))


@KINDS.register()
@dataclass(frozen=True)
class Gate(Kind):
    """The softmax's weights; the head's output gated by σ(x W_g) (elementwise, or one scalar a head)."""

    name: ClassVar[str] = "gate"
    forms: ClassVar[tuple[str, ...]] = ("gate", "gate(headwise)")
    line: ClassVar[str] = "the softmax's map, the head's output times σ(x W_g) (Qiu et al. 2025); needs trained gates"
    words: ClassVar[dict[str, str]] = {"headwise": "headwise=true", "elementwise": "headwise=false"}
    softmax_map: ClassVar[bool] = True
    stock: ClassVar[str] = "qwen3_next"
    in_code: ClassVar[bool] = True
    headwise: bool = False

    @property
    def spec(self) -> str:
        return "gate(headwise)" if self.headwise else "gate"

    def trained_as(self) -> str:
        if self.headwise:
            raise InputError("gate(headwise) cannot be trained: no transformers family has a headwise gate "
                             "(Qwen3-Next's is elementwise: gate)")
        return super().trained_as()

    def needs(self, mine, family):
        if mine != self:
            return (f"{self.spec} needs the gate's trained weights, which {family} does not have "
                    "(a model trained with it: Qwen3-Next, or a lab model trained with gate)")
        return ""

    def weights(self, z, sink=None):
        return torch.softmax(z.float(), dim=-1)

    @staticmethod
    def gated(out: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
        """A head's output (..., heads, q, d) times σ of its gate logits ((..., heads, q, d) elementwise, or
        (..., heads, q, 1) headwise)."""
        return out * torch.sigmoid(gate_logits.to(out.dtype))


@KINDS.register()
@dataclass(frozen=True)
class Relu(Kind):
    """ReLU attention divided by the row's length, not by its sum (docs/methods.md#attention-kinds says why)."""

    name: ClassVar[str] = "relu"
    forms: ClassVar[tuple[str, ...]] = ("relu",)
    line: ClassVar[str] = "ReLU(z) / n, n the keys the row allows (Wortsman et al. 2023)"
    what_ifs: ClassVar[tuple[str, ...]] = ("relu",)
    weighs: ClassVar[bool] = True
    with_stablemask: ClassVar[bool] = False

    def weights(self, z, sink=None):
        z = z.float()  # ReLU(−∞) is 0: a forbidden key's weight
        return torch.relu(z) / torch.isfinite(z).sum(dim=-1, keepdim=True).clamp(min=1).float()


def names() -> tuple[str, ...]:
    """Every kind's name, in the registry's order."""
    return KINDS.names()


def help(trained: bool = False) -> str:  # noqa: A001 - the registry's help, as the command line and the app show it
    """Every kind as the help writes it: ``softmax, sink, sink(logit=c), ...``; ``trained``: those the lab trains
    (a form with a placeholder, ``sink(logit=c)``, stands for its kind)."""
    return ", ".join(form for name in KINDS.names() for form in KINDS.entries[name].forms
                     if not trained or _trains(form.split("(")[0] if "=" in form else form))


def _trains(spec: str) -> bool:
    try:
        return bool(parse(spec).trained_as())
    except InputError:
        return False


def lines() -> str:
    """One line a kind, ``form: definition``, for the app's help (Markdown)."""
    return "\n".join(f"- `{'`, `'.join(KINDS.entries[n].forms)}`: {KINDS.entries[n].line}" for n in KINDS.names())


def what_ifs() -> list[str]:
    """The kinds the app offers on any model, written in the call syntax: those without trained parameters."""
    return [form for name in KINDS.names() for form in KINDS.entries[name].what_ifs]


_ARGS = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\((.*)\)\s*$", re.S)


def parse(text) -> Kind:
    """A kind from its call syntax through :data:`KINDS`: ``softmax``, ``sink``, ``sink(logit=0)``, ``softpick``,
    ``softpick(eps=1e-6)``, ``sigmoid``, ``sigmoid(bias=0)``, ``gate``, ``gate(headwise)``, ``relu``; a kind's bare
    words (``headwise``) stand for their arguments; refused in one line otherwise."""
    if isinstance(text, Kind):
        return text
    if not isinstance(text, str):
        raise InputError(f"an attention kind is a name such as softmax or sink(logit=0), not {text!r}")
    match = _ARGS.match(text)
    if match and match[1].lower() in KINDS:
        name = match[1].lower()
        words = getattr(KINDS.entries[name], "words", {})
        pieces = [p.strip() for p in match[2].split(",") if p.strip()]
        bare = [p for p in pieces if "=" not in p]
        if bare and words:
            unknown = [p for p in bare if p.lower() not in words]
            if unknown:
                raise InputError(f"{name} takes {' or '.join(words)}, not {unknown[0]!r}")
            text = f"{name}({', '.join(words.get(p.lower(), p) for p in pieces)})"
    parsed = syntax.call(text, "the attention kind", help())
    if parsed.layers is not None:
        raise InputError(f"an attention kind applies to every layer: write {parsed.text.split('@')[0].strip()}, "
                         "not @layers")
    return KINDS.build(parsed)


@functools.lru_cache(maxsize=64)
def _parsed(spec: str) -> Kind:
    return parse(spec)


def own(config) -> Kind:
    """A model's own kind, from its config: what a lab model was trained with (``attnviz_kind`` in its config.json),
    the kind whose ``stock`` family it is (gpt-oss's learned sink, Qwen3-Next's gate), else the softmax. A recipe
    without a kind runs this one."""
    config = getattr(config, "config", config)
    spec = getattr(config, "attnviz_kind", None)
    if spec:
        return _parsed(str(spec))
    family = getattr(config, "model_type", "")
    return next((made() for made in KINDS.entries.values() if made.stock and made.stock == family), Softmax())


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
    """The kind's own ``weights`` where a row is not a softmax (``weighs``: softpick, sigmoid, relu), else None: the
    softmax (with its sink column for ``sink``; the gate's map is the softmax's)."""
    return kind.weights if kind.weighs else None


def check(kind: Kind, config, stable: bool) -> Kind:
    """Refuse, in one line, a kind this model or mask cannot run: another kind on a model whose own kind is in its
    attention code (a gated model), what the kind ``needs`` that the model has not (the gate's trained weights, learned
    sink logits), and a kind without ``with_stablemask`` under StableMask (sigmoid, relu: no normalisation for the
    pseudo-logits to take mass from)."""
    mine = own(config)
    family = getattr(getattr(config, "config", config), "model_type", "this model")
    if mine.in_code and kind != mine:
        raise InputError(f"{family} is trained with {mine.spec}, applied in its own attention code: "
                         f"{kind.spec} cannot replace it")
    why = kind.needs(mine, family)
    if why:
        raise InputError(why)
    if stable and not kind.with_stablemask:
        raise InputError(f"{kind.name} cannot combine with StableMask: a {kind.name} row has no normalisation for "
                         "the pseudo-logits to take mass from (docs/methods.md#attention-kinds)")
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
