"""Per-layer architectures (SPEC §2) and the one-line architecture grammar (SPEC §7).

``parse("mask0&bidir(k=8, k0=4)", n_layers=30)`` gives an :class:`Architecture`: the canonical
string plus one :class:`~attnviz.masks.Mask` per layer, bottom layer first. Everything that shows
or stores an architecture (CLI, app, file names, metadata) goes through here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import masks as M
from .errors import ArchitectureError, MaskError

_ITEM = re.compile(r"^(?P<name>[a-z0-9&\-]+)(?:\((?P<params>[^()]*)\))?(?:\*(?P<count>[^*()]+))?$")
_NAMED = ("inplace-bidir", "inplace-back", "mask0-fwd", "mask0-bidir", "mask0-all", "mask0&bidir")

# mask name -> (allowed parameters, builder)
_MASK_TYPES = {
    "fwd": ((), lambda p: M.fwd()),
    "back": ((), lambda p: M.back()),
    "bidir": ((), lambda p: M.bidir()),
    "nosink-fwd": (("m",), lambda p: M.nosink(M.fwd(), p.get("m", 1))),
    "nosink-back": (("m",), lambda p: M.nosink(M.back(), p.get("m", 1))),
    "nosink-bidir": (("m",), lambda p: M.nosink(M.bidir(), p.get("m", 1))),
    "sliding": (("w", "dir"), lambda p: M.sliding(p["w"], p.get("dir", "fwd"))),
    "dilated": (("w", "d"), lambda p: M.dilated(p["w"], p["d"])),
    "global": (("w", "g", "dir"), lambda p: M.global_sliding(p["w"], p.get("g", 1), p.get("dir", "fwd"))),
    "stablemask": (("gamma", "slopes", "t"), lambda p: M.stablemask(p.get("gamma"), p.get("slopes"), p.get("t"))),
}
_REQUIRED = {"sliding": ("w",), "dilated": ("w", "d"), "global": ("w",)}

#: The names a user can pick from, for selectors and help texts.
MASK_TYPES = tuple(_MASK_TYPES)
NAMED_ARCHITECTURES = ("fwd",) + _NAMED


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


def _value(key: str, raw: str, where: str):
    if key in ("dir", "slopes"):
        return raw
    try:
        number = float(raw)
    except ValueError:
        raise ArchitectureError(f"in '{where}': {key}={raw} is not a number") from None
    if key == "gamma":
        return number
    if number != int(number):
        raise ArchitectureError(f"in '{where}': {key}={raw} must be a whole number")
    return int(number)


def _params(text: str | None, allowed: tuple[str, ...], where: str) -> dict:
    params: dict = {}
    if not text:
        return params
    for part in text.split(","):
        key, eq, raw = part.partition("=")
        if not eq or not key or not raw:
            raise ArchitectureError(f"in '{where}': expected key=value, got '{part}'")
        if key not in allowed:
            expected = ", ".join(allowed) if allowed else "no parameters"
            raise ArchitectureError(f"in '{where}': unknown parameter '{key}' (expected {expected})")
        if key in params:
            raise ArchitectureError(f"in '{where}': parameter '{key}' given twice")
        params[key] = _value(key, raw, where)
    return params


def mask_from_item(name: str, params_text: str | None, where: str) -> M.Mask:
    if name not in _MASK_TYPES:
        hint = " (named architectures cannot be list items)" if name in _NAMED else ""
        raise ArchitectureError(
            f"unknown mask type '{name}' in '{where}'{hint}; expected one of: {', '.join(MASK_TYPES)}"
        )
    allowed, build = _MASK_TYPES[name]
    params = _params(params_text, allowed, where)
    missing = [k for k in _REQUIRED.get(name, ()) if k not in params]
    if missing:
        raise ArchitectureError(f"in '{where}': {name} needs {', '.join(k + '=' for k in missing)}")
    try:
        return build(params)
    except MaskError as err:
        raise ArchitectureError(f"in '{where}': {err}") from None


def _named(name: str, params: dict, n_layers: int, where: str) -> list[M.Mask]:
    if "k" not in params:
        raise ArchitectureError(f"in '{where}': {name} needs k= (number of converted top layers)")
    k = params["k"]
    if not 0 <= k <= n_layers:
        raise ArchitectureError(f"k={k} but the model has {n_layers} layers (0 <= k <= {n_layers})")
    bottom = n_layers - k
    fwd, nosink_fwd, nosink_bidir = M.fwd(), M.nosink(M.fwd()), M.nosink(M.bidir())
    if name == "mask0&bidir":
        if "k0" not in params:
            raise ArchitectureError(f"in '{where}': mask0&bidir needs k0= (top layers with NoSink-BIDIR)")
        k0 = params["k0"]
        if not 0 <= k0 <= k:
            raise ArchitectureError(f"k0={k0} must be between 0 and k={k}")
        return [fwd] * bottom + [M.bidir()] * (k - k0) + [nosink_bidir] * k0
    top = {
        "inplace-bidir": M.bidir(), "inplace-back": M.back(), "mask0-fwd": nosink_fwd,
        "mask0-bidir": nosink_bidir, "mask0-all": nosink_bidir,
    }[name]
    below = nosink_fwd if name == "mask0-all" else fwd
    return [below] * bottom + [top] * k


def parse(spec: str, n_layers: int) -> Architecture:
    """Parse the SPEC §7 grammar for a model with ``n_layers`` layers.

    Decisions the SPEC leaves open: a lone list item without ``*COUNT`` fills every layer; a list
    item written without a count inside a longer list counts 1; ``mask0-all(k=0)`` is NoSink-FWD
    everywhere, as SPEC §7 says.
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
        name, params_text, count = match["name"], match["params"], match["count"]
        if name in _NAMED:
            if count is not None:
                raise ArchitectureError(f"named architecture '{name}' cannot take *{count}")
            params = _params(params_text, ("k", "k0") if name == "mask0&bidir" else ("k",), items[0])
            layers = _named(name, params, n_layers, items[0])
            canonical = f"{name}({', '.join(f'{k}={v}' for k, v in params.items())})"
            return Architecture(canonical, tuple(layers))
        if count is None:
            mask = mask_from_item(name, params_text, items[0])
            return Architecture(mask.name, (mask,) * n_layers)

    layers: list[M.Mask] = []
    for item in items:
        match = _ITEM.match(item)
        if not match:
            raise ArchitectureError(f"cannot read list item '{item}'; expected MASK*COUNT, e.g. 'bidir*4'")
        mask = mask_from_item(match["name"], match["params"], item)
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

    The k-sweep of seed 000 (SPEC §8) runs one template for k = 0..L.
    """
    match = _ITEM.match(re.sub(r"\s+", "", template.lower()))
    if not match or match["name"] not in _NAMED or match["count"]:
        raise ArchitectureError(
            f"a k-sweep needs a named architecture ({', '.join(_NAMED)}), got '{template.strip()}'"
        )
    params = [p for p in (match["params"] or "").split(",") if p and not p.startswith("k=")]
    return parse(f"{match['name']}({', '.join([f'k={k}'] + params)})", n_layers)


def named(name: str, n_layers: int, k: int | None = None, k0: int | None = None) -> Architecture:
    """Build a named architecture from UI controls rather than a string."""
    params = [f"k={k}"] if k is not None else []
    if k0 is not None:
        params.append(f"k0={k0}")
    return parse(f"{name}({', '.join(params)})" if params else name, n_layers)
