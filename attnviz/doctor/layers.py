"""What the checks hold the model to, through the engine's named sites (:mod:`attnviz.core.engine.sites`) only: every decoder
layer's input and output kept, or its input fed (:func:`layer_io`: two routes given the same layer input); stock
transformers' eager forward (:func:`stock`); the model switched to another attention (:func:`implementation`) or cast
to float32 (:func:`in_float32`) for the ``with`` block and back after."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from attnviz.core.engine import sites
from attnviz.core.loading.models import LoadedModel


def layer_count(model) -> int | None:
    """The decoder layers the model anatomy finds (:mod:`attnviz.core.model.anatomy`), or None for a family it cannot map:
    the anatomy's own probe forward is run here, before any check feeds a layer input."""
    from attnviz.core.model import anatomy
    from attnviz.errors import InputError

    try:
        return len(anatomy.of(model).layers)
    except InputError:
        return None


@dataclass
class LayerIO:
    """What every decoder layer received and returned in one forward, by layer index."""

    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)


@contextlib.contextmanager
def layer_io(model, feed: dict[int, torch.Tensor] | None = None):
    """Keep every decoder layer's input and output hidden states of this thread's forwards inside (the sites
    ``resid_pre`` and ``resid_post``); with ``feed``, each layer named there gets that input instead of the one the
    layer below handed on (the same layer input for two routes)."""
    seen = LayerIO()

    def before(index: int):
        def fn(value):
            given = feed.get(index) if feed is not None else None
            seen.inputs[index] = (value if given is None else given).detach().clone()
            return given  # None: the layer reads its own input
        return fn

    def after(index: int):
        def fn(value):
            seen.outputs[index] = value.detach().clone()
        return fn

    n = layer_count(model) or 0
    pairs = [(sites.Site("resid_pre", i), before(i)) for i in range(n)]
    pairs += [(sites.Site("resid_post", i), after(i)) for i in range(n)]
    with sites.hooks(model, pairs):
        yield seen


@contextlib.contextmanager
def implementation(model, name: str):
    """The model's attention switched to transformers' ``name`` ("eager", "sdpa") inside, and back after."""
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def stock(loaded: LoadedModel, ids: list[int], feed: dict[int, torch.Tensor] | None = None
          ) -> tuple[list[np.ndarray], LayerIO]:
    """Stock transformers' eager ``output_attentions`` of ``ids`` ((H, n, n) float32 per layer) and every
    layer's input and output; with ``feed``, the layers get those inputs (:func:`layer_io`)."""
    model = loaded.model
    with implementation(model, "eager"), layer_io(model, feed) as seen, torch.inference_mode():
        out = model(torch.tensor([ids], device=model.device), output_attentions=True)
    return [a[0].float().cpu().numpy() for a in out.attentions], seen


@contextlib.contextmanager
def in_float32(model):
    """The model in float32 inside, and every parameter and buffer back in its own dtype after: a bfloat16
    model keeps some buffers in float32 (the rotary frequencies), which ``model.to(bfloat16)`` would round."""
    def tables():
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                yield from ((table, key, t) for key, t in table.items() if t is not None)

    before = [(table, key, t.dtype) for table, key, t in tables()]
    model.float()
    try:
        yield
    finally:
        for table, key, dtype in before:
            if table[key].dtype != dtype:
                table[key].data = table[key].data.to(dtype)
