"""Named sites: the one way attnviz reads or replaces an activation inside a model (docs/methods.md#sites).

Every layer of the model anatomy (:mod:`attnviz.core.model.anatomy`) has named points, as TransformerLens names its hook
points, found on the model's own modules (no modelling code is patched):

- ``embed``: the embedding's write (the first layer's input, Gemma's scaling included; layer 0 only);
- ``resid_pre``: the residual stream entering layer l; ``resid_mid``: the stream between its attention and its MLP
  (not where the blocks run in parallel); ``resid_post``: the layer's output;
- ``attn_in`` / ``mlp_in``: what the block itself reads (after its pre-norm);
- ``q_in`` / ``k_in``: what the query or the key projection alone reads (where the family has one of its own);
- ``attn_out`` / ``mlp_out``: the block's write as the stream adds it, post-norm and residual multiplier included;
- ``attn_block``: the attention block's own output, before a post-norm and the multiplier;
- ``head_z``: every head's output before the output projection, (B, n, H, d).

The queries, keys and values after rotation are read where attention is computed, by the engine's recorders
(``Record(qkv=True)``), not here.

A site's function ``fn(value)`` sees the activation (B, n, ...) as named above and returns a replacement or None
(read only). :func:`hooks` holds a list of ``(site, fn)`` for the ``with`` block and acts in the thread that entered
it only: the shared server runs several visitors' forwards on one loaded model at once. :func:`install` registers
functions once per model for every thread (the engine's own: they read the thread's active run).
:func:`module_hooks` is :func:`hooks` on a module that is not a site (a q/k norm inside an attention module).
``put`` / ``save`` make the usual functions: replace chosen batch rows at chosen positions, save a copy.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from attnviz.core.model import anatomy as anatomy_mod
from attnviz.core.model.modules import output_linear, projection
from attnviz.errors import InputError

NAMES = ("embed", "resid_pre", "resid_mid", "resid_post", "attn_in", "mlp_in", "q_in", "k_in", "attn_block", "attn_out",
         "mlp_out", "head_z")
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Site:
    """One named point of one layer (``embed`` is layer 0's)."""

    name: str
    layer: int = 0

    def __post_init__(self):
        if self.name not in NAMES:
            raise InputError(f"unknown site '{self.name}': expected one of {', '.join(NAMES)}")
        if self.name == "embed" and self.layer != 0:
            raise InputError("the embedding's write is a site of layer 0 only")

    def __str__(self) -> str:
        return self.name if self.name == "embed" else f"{self.name}.{self.layer}"


def site(name: str, layer: int = 0) -> Site:
    return Site(str(name).strip().lower(), int(layer))


@dataclass(frozen=True)
class _Module:
    """A module that is not a named site (:func:`module_hooks`): its first input where ``pre``, else its output."""

    module: torch.nn.Module
    pre: bool


def _where(model, s: Site) -> tuple[torch.nn.Module, bool, float]:
    """The module a site is read on, whether it is that module's input (a pre-hook), and the factor the stream
    multiplies its output by (Granite's residual multiplier for the writes; 1 elsewhere)."""
    found = anatomy_mod.of(model)
    if not -len(found.layers) <= s.layer < len(found.layers):
        raise InputError(f"layer {s.layer} does not exist: the model has layers 0..{len(found.layers) - 1}")
    L = found[s.layer]
    if s.name == "resid_mid" and L.parallel:
        raise InputError(f"{found.family}'s MLP reads the layer's input (parallel blocks): there is no stream between "
                         "its attention and its MLP")
    if s.name in ("q_in", "k_in"):
        return projection(L.attn, s.name[0]), True, 1.0
    post_norm = L.attn_write is not L.attn
    return {"embed": (L.module, True, 1.0), "resid_pre": (L.module, True, 1.0),
            "resid_mid": (L.mlp_norm or L.mlp, True, 1.0), "resid_post": (L.module, False, 1.0),
            "attn_in": (L.attn, True, 1.0), "mlp_in": (L.mlp, True, 1.0),
            "attn_block": (L.attn_write if post_norm else L.attn, post_norm, 1.0),
            "attn_out": (L.attn_write, False, L.scale), "mlp_out": (L.mlp_write, False, L.scale),
            "head_z": (output_linear(L.attn), True, 1.0)}[s.name]


def check(model, s: Site) -> None:
    """Refuse, in one line, a site this model does not have (a layer past the top, ``resid_mid`` of parallel blocks,
    ``q_in`` / ``k_in`` of a fused projection), before any forward."""
    _where(model, s)


def _heads(model) -> int:
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    return int(config.num_attention_heads)


_UNSEEN = object()  # a pre-hook called without its keyword arguments (:func:`_wrap`)


def _wrap(model, s: Site, fn: Callable, owner: int | None, first: bool = False):
    """A torch hook around ``fn``: the thread check, the argument and tuple handling, the site's shape, written once."""
    module, pre, factor = (s.module, s.pre, 1.0) if isinstance(s, _Module) else _where(model, s)
    heads = _heads(model) if isinstance(s, Site) and s.name == "head_z" else 0

    def present(value):
        if heads:
            return value.unflatten(-1, (heads, -1))
        return value * factor if factor != 1.0 else value

    def back(new, old):
        if heads:
            new = new.flatten(-2)
        elif factor != 1.0:
            new = new / factor
        return new.to(old.dtype)

    if pre:
        def hook(mod, args, kwargs=_UNSEEN):
            # torch marks a hook as taking keywords a step after adding it, and unmarks it a step after removing it:
            # a forward in another thread at that moment calls it without them (``_UNSEEN``)
            if owner is not None and threading.get_ident() != owner:
                return None
            unseen = kwargs is _UNSEEN
            if args:
                value = args[0]
            elif unseen:
                return None  # the value was passed by keyword, which this call does not show
            else:
                name = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
                value = kwargs[name]
            new = fn(present(value))
            if new is None:
                return None
            new = back(new, value)
            if unseen:
                return (new, *args[1:])
            return ((new, *args[1:]), kwargs) if args else (args, {**kwargs, name: new})
        return module.register_forward_pre_hook(hook, with_kwargs=True, prepend=first)

    def hook(mod, args, out):
        if owner is not None and threading.get_ident() != owner:
            return None
        value = out[0] if isinstance(out, tuple) else out
        new = fn(present(value))
        if new is None:
            return None
        new = back(new, value)
        return (new, *out[1:]) if isinstance(out, tuple) else new
    return module.register_forward_hook(hook, prepend=first)


@contextmanager
def unmasked():
    """Inside, a forward's error comes out as itself where torch's clean-up after it raised another: after an error
    in a module's forward, torch loops over the module's forward hooks without a copy, and another thread adding or
    removing one at that moment (the shared server's other visitors) raises "OrderedDict mutated during iteration"
    (or "changed size"), with the first error as its context."""
    try:
        yield
    except RuntimeError as err:
        context = err.__context__
        if str(err).endswith("during iteration") and isinstance(context, Exception):
            raise context from None
        raise


@contextmanager
def hooks(model, pairs: Iterable[tuple[Site, Callable]]):
    """Inside, every forward of this thread calls each ``fn(value)`` at its site (read, or replace by returning a
    tensor); other threads' forwards on the same model are untouched. Removed on leaving, whatever happens."""
    owner = threading.get_ident()
    handles = []
    try:
        for s, fn in pairs:
            handles.append(_wrap(model, s, fn, owner))
        with unmasked():
            yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def module_hooks(pairs: Iterable[tuple[torch.nn.Module, Callable]], inputs: bool = False):
    """:func:`hooks` on a module that is not a named site (score attribution passes an attention module's q/k norms
    through, :mod:`attnviz.effects.schemes`): ``fn(value)`` sees the module's output (its first input where
    ``inputs``) as the module has it, returns a replacement or None, in this thread only. Not for a site's value."""
    with hooks(None, [(_Module(module, inputs), fn) for module, fn in pairs]):
        yield


def at_module(module: torch.nn.Module, inputs: bool = False):
    """A module that is not a named site, as a place in :func:`hooks`' pairs beside the sites (its output; its first
    input where ``inputs``): one head's slice of a projection's output (path patching's head receivers)."""
    return _Module(module, inputs)


def install(model, key: str, pairs: Iterable[tuple[Site, Callable]], first: bool = False) -> None:
    """Register ``pairs`` once per model (``key`` names the set), for every thread: for the engine's own functions,
    which read the thread's active run and do nothing outside one. Under a lock: sessions may ask at once.
    ``first``: before every other function at the same module (a replacement others should see)."""
    flag = f"_attnviz_sites_{key}"
    with _LOCK:
        if model.__dict__.get(flag):
            return
        pairs = list(pairs)  # made inside the lock: a refusal registers nothing
        for s, fn in pairs:
            _wrap(model, s, fn, None, first)
        model.__dict__[flag] = True


def save(into: dict, key=None, first_row: bool = False, host: bool = False, dtype=None) -> Callable:
    """A read-only function that saves a copy of the site's value in ``into[key]`` (the last forward's)."""
    def fn(value):
        kept = value[0] if first_row else value
        kept = kept.detach().to("cpu" if host else kept.device, dtype=dtype or kept.dtype, copy=True)
        into[key] = kept
        return None
    return fn


def put(source: torch.Tensor, rows: Iterable[int], positions: Iterable | None = None, heads: Iterable | None = None,
        source_row: int | None = 0) -> Callable:
    """A function that replaces, in batch row ``rows[i]``, the value at ``positions[i]`` (an int, a list, or None:
    every position) and head ``heads[i]`` (``head_z`` only; None: the whole vector) with ``source``'s (its row
    ``source_row``, or the same row where None)."""
    rows = list(rows)
    positions = [None] * len(rows) if positions is None else list(positions)
    heads = [None] * len(rows) if heads is None else list(heads)

    def fn(value):
        value = value.clone()
        for row, where, head in zip(rows, positions, heads):
            src = source[row if source_row is None else source_row].to(value.device, value.dtype)
            index = (slice(None) if where is None else where,) + (() if head is None else (head,))
            value[row][index] = src[index]
        return value
    return fn
