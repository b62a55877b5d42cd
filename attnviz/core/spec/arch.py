"""Per-layer architectures (docs/methods.md#per-layer-architectures) and the one-line architecture grammar (docs/methods.md#the-call-syntax).

``parse("mask0&bidir(k=8, k0=4)", n_layers=30)`` gives an :class:`Architecture`: the canonical
string plus one :class:`~attnviz.core.spec.masks.Mask` per layer, bottom layer first. Everything that shows
or stores an architecture (CLI, app, file names, metadata) goes through here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from attnviz.core.spec import masks as M
from attnviz.core.spec import syntax
from attnviz.errors import ArchitectureError, MaskError

_ITEM = re.compile(r"^(?P<call>[a-z0-9&\-]+(?:\([^()]*\))?)(?:\*(?P<count>[^*()]+))?$")

#: Mask types (one per list item) and named per-layer architectures, each a builder whose signature
#: gives its parameters, types and defaults (docs/methods.md#masks, docs/methods.md#per-layer-architectures).
MASKS = syntax.Registry("mask type", error=ArchitectureError)
NAMED = syntax.Registry("named architecture", error=ArchitectureError, skip=("n_layers",))


@MASKS.register("fwd")
def _fwd() -> M.Mask:
    return M.fwd()


@MASKS.register("back")
def _back() -> M.Mask:
    return M.back()


@MASKS.register("bidir")
def _bidir() -> M.Mask:
    return M.bidir()


@MASKS.register("nosink-fwd")
def _nosink_fwd(m: int = 1) -> M.Mask:
    return M.nosink(M.fwd(), m)


@MASKS.register("nosink-back")
def _nosink_back(m: int = 1) -> M.Mask:
    return M.nosink(M.back(), m)


@MASKS.register("nosink-bidir")
def _nosink_bidir(m: int = 1) -> M.Mask:
    return M.nosink(M.bidir(), m)


@MASKS.register("sliding")
def _sliding(w: int, dir: str = "fwd") -> M.Mask:  # noqa: A002 - the grammar's own name
    return M.sliding(w, dir)


@MASKS.register("dilated")
def _dilated(w: int, d: int) -> M.Mask:
    return M.dilated(w, d)


@MASKS.register("global")
def _global(w: int, g: int = 1, dir: str = "fwd") -> M.Mask:  # noqa: A002
    return M.global_sliding(w, g, dir)


@MASKS.register("stablemask")
def _stablemask(gamma: float | None = None, slopes: str | None = None, t: int | None = None) -> M.Mask:
    return M.stablemask(gamma, slopes, t)


def _check_k(k: int, n_layers: int) -> int:
    if not 0 <= k <= n_layers:
        raise ArchitectureError(f"k={k} but the model has {n_layers} layers (0 <= k <= {n_layers})")
    return n_layers - k


def _top(top: M.Mask, below: M.Mask, k: int, n_layers: int) -> list[M.Mask]:
    return [below] * _check_k(k, n_layers) + [top] * k


@NAMED.register("inplace-bidir")
def _inplace_bidir(k: int, n_layers: int) -> list[M.Mask]:
    return _top(M.bidir(), M.fwd(), k, n_layers)


@NAMED.register("inplace-back")
def _inplace_back(k: int, n_layers: int) -> list[M.Mask]:
    return _top(M.back(), M.fwd(), k, n_layers)


@NAMED.register("mask0-fwd")
def _mask0_fwd(k: int, n_layers: int) -> list[M.Mask]:
    return _top(M.nosink(M.fwd()), M.fwd(), k, n_layers)


@NAMED.register("mask0-bidir")
def _mask0_bidir(k: int, n_layers: int) -> list[M.Mask]:
    return _top(M.nosink(M.bidir()), M.fwd(), k, n_layers)


@NAMED.register("mask0-all")
def _mask0_all(k: int, n_layers: int) -> list[M.Mask]:
    return _top(M.nosink(M.bidir()), M.nosink(M.fwd()), k, n_layers)


@NAMED.register("mask0&bidir")
def _mask0_and_bidir(k: int, k0: int, n_layers: int) -> list[M.Mask]:
    bottom = _check_k(k, n_layers)
    if not 0 <= k0 <= k:
        raise ArchitectureError(f"k0={k0} must be between 0 and k={k}")
    return [M.fwd()] * bottom + [M.bidir()] * (k - k0) + [M.nosink(M.bidir())] * k0


_NAMED = NAMED.names()
#: The names a user can pick from, for selectors and help texts.
MASK_TYPES = MASKS.names()
NAMED_ARCHITECTURES = ("fwd",) + _NAMED
USAGE = "NAME, NAME(key=value, ...) or a per-layer list MASK*COUNT + MASK*COUNT"


@dataclass(frozen=True)
class Architecture:
    """A parsed architecture: its canonical one-line string and one mask per layer."""

    spec: str
    layers: tuple[M.Mask, ...]

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_names(self) -> list[str]:
        return [m.name for m in self.layers]

    @property
    def causal_compatible(self) -> bool:
        return all(m.causal_compatible for m in self.layers)

    def require_causal(self, purpose: str) -> "Architecture":
        """Refuse an architecture in which some query sees a later key, naming the first such layer.

        Perplexity, streaming and generation all predict a token from its prefix: under BACK/BIDIR
        a query reads the token it predicts, and a cached query would miss keys (or StableMask
        pseudo-slots) its full-sequence softmax had, so any number would mean something else.
        """
        for layer, mask in enumerate(self.layers):
            if not mask.causal_compatible:
                raise ArchitectureError(
                    f"cannot {purpose} with '{self.spec}': layer {layer} uses {mask.name}, which lets a query "
                    "see later keys (or, for StableMask, future pseudo-slots) and so read the token it predicts; "
                    "use a causal-compatible mask in every layer (fwd, nosink-fwd, sliding, dilated, global, "
                    "or StableMask's inference form stablemask(..., T=...))"
                )
        return self

    def as_list(self) -> str:
        """The same architecture written as a per-layer list (``fwd*22 + bidir*8``)."""
        runs: list[list] = []
        for m in self.layers:
            if runs and runs[-1][0] == m.name:
                runs[-1][1] += 1
            else:
                runs.append([m.name, 1])
        return " + ".join(f"{name}*{count}" for name, count in runs)


def _call(text: str, where: str) -> syntax.Call:
    parsed = syntax.call(text, "the architecture item", USAGE, error=ArchitectureError)
    if parsed.layers is not None:
        raise ArchitectureError(f"in '{where}': an architecture item takes no @layers; write a per-layer list "
                                "(fwd*20 + bidir*10)")
    return parsed


def mask_from_item(text: str, where: str | None = None) -> M.Mask:
    """One list item's mask, ``nosink-fwd(m=2)``."""
    where = where or text
    parsed = _call(text, where)
    if parsed.name not in MASKS:
        hint = " (named architectures cannot be list items)" if parsed.name in NAMED else ""
        raise ArchitectureError(
            f"unknown mask type '{parsed.name}' in '{where}'{hint}; expected one of: {', '.join(MASK_TYPES)}"
        )
    try:
        return MASKS.build(parsed)
    except MaskError as err:
        raise ArchitectureError(f"in '{where}': {err}") from None


def parse(spec: str, n_layers: int) -> Architecture:
    """Parse the docs/methods.md#the-call-syntax grammar for a model with ``n_layers`` layers.

    Decisions the definitions (docs/methods.md#the-call-syntax) leave open: a lone list item without ``*COUNT`` fills every layer; a list
    item written without a count inside a longer list counts 1; ``mask0-all(k=0)`` is NoSink-FWD
    everywhere, as docs/methods.md#the-call-syntax says.
    """
    if not isinstance(n_layers, int) or n_layers < 1:
        raise ArchitectureError(f"number of layers must be a positive integer, got {n_layers!r}")
    if not isinstance(spec, str) or not spec.strip():
        raise ArchitectureError("empty architecture string; expected e.g. 'fwd' or 'mask0-bidir(k=8)'")
    text = re.sub(r"\s+", "", spec.lower())
    items = text.split("+")
    if any(not item for item in items):
        raise ArchitectureError(f"empty item in '{spec.strip()}' (a '+' with nothing on one side)")

    if len(items) == 1:
        match = _ITEM.match(items[0])
        if not match:
            raise ArchitectureError(f"cannot read '{items[0]}'; expected NAME, NAME(key=value, ...) or NAME*COUNT")
        call, count = match["call"], match["count"]
        parsed = _call(call, items[0])
        if parsed.name in NAMED:
            if count is not None:
                raise ArchitectureError(f"named architecture '{parsed.name}' cannot take *{count}")
            layers = NAMED.build(parsed, n_layers=n_layers)
            values = {k: syntax.convert(int, v, k, items[0], ArchitectureError) for k, v in parsed.args.items()}
            canonical = f"{parsed.name}({', '.join(f'{k}={v}' for k, v in values.items())})"
            return Architecture(canonical, tuple(layers))
        if count is None:
            mask = mask_from_item(call, items[0])
            return Architecture(mask.name, (mask,) * n_layers)

    layers: list[M.Mask] = []
    for item in items:
        match = _ITEM.match(item)
        if not match:
            raise ArchitectureError(f"cannot read list item '{item}'; expected MASK*COUNT, e.g. 'bidir*4'")
        mask = mask_from_item(match["call"], item)
        count = match["count"] if match["count"] is not None else "1"
        if not count.isdigit() or int(count) < 1:
            raise ArchitectureError(f"in '{item}': count '{count}' must be a positive whole number")
        layers.extend([mask] * int(count))
    if len(layers) != n_layers:
        raise ArchitectureError(
            f"the per-layer list covers {len(layers)} layers but the model has {n_layers}"
        )
    arch = Architecture("", tuple(layers))
    return Architecture(arch.as_list(), arch.layers)


def resolve(arch: "str | Architecture", n_layers: int) -> Architecture:
    """An architecture string or object, checked against the model's layer count."""
    architecture = arch if isinstance(arch, Architecture) else parse(arch, n_layers)
    if architecture.n_layers != n_layers:
        raise ArchitectureError(f"architecture has {architecture.n_layers} layers but the model has {n_layers}")
    return architecture


def with_k(template: str, k: int, n_layers: int) -> Architecture:
    """A named architecture at depth k: ``mask0-bidir`` or ``mask0&bidir(k0=2)`` with ``k=`` filled in.

    The k-sweep of seed 000 (docs/methods.md#evaluation) runs one template for k = 0..L.
    """
    match = _ITEM.match(re.sub(r"\s+", "", template.lower()))
    parsed = _call(match["call"], template) if match and not match["count"] else None
    if parsed is None or parsed.name not in NAMED:
        raise ArchitectureError(
            f"a k-sweep needs a named architecture ({', '.join(_NAMED)}), got '{template.strip()}'"
        )
    params = [f"{key}={value}" for key, value in parsed.args.items() if key != "k"]
    return parse(f"{parsed.name}({', '.join([f'k={k}'] + params)})", n_layers)


def named(name: str, n_layers: int, k: int | None = None, k0: int | None = None) -> Architecture:
    """Build a named architecture from UI controls rather than a string."""
    params = [f"k={k}"] if k is not None else []
    if k0 is not None:
        params.append(f"k0={k0}")
    return parse(f"{name}({', '.join(params)})" if params else name, n_layers)
