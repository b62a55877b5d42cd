"""A region of one layer's map at full resolution: what a long text's max-pooled
heatmap zooms into, with every cell and token label.

The region is cut out of the layer's query blocks as they are computed (a block reducer), so the
layer's full map never exists; the forward stops after that layer, since later layers cannot
change it: a region of layer 3 costs 4 layers, not 30. Under causal-compatible masks it also stops
at the region's last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnviz.tokens import tokenize
from attnviz.core import engine
from attnviz.core.loading.models import LoadedModel
from attnviz.errors import InputError
from attnviz.plan import Sizes
from attnviz.recipe import Recipe
from attnviz.core.record.reduce import BlockReducer

MAX_SIDE = 96  # cells a side: every cell of a zoomed region gets a hover value (figures.style.HOVER_MAX)


@dataclass
class Region:
    layer: int
    queries: tuple[int, int]  # [start, stop) token positions
    keys: tuple[int, int]
    values: np.ndarray  # (H, stop - start, stop - start) float32 probabilities
    allowed: np.ndarray  # (queries, keys) bool
    row_tokens: list[str]
    col_tokens: list[str]
    mask: str
    arch: str
    model: str


class _Crop(BlockReducer):
    """Engine block reducer keeping one rectangle of one layer's map, on the layer's device until
    :meth:`finish` copies it to the host once."""

    def __init__(self, queries: tuple[int, int], keys: tuple[int, int]):
        self.queries, self.keys = queries, keys
        self.only_rows = queries  # the engine skips the layer's other query blocks: the forward stops after it
        self.values = self.allowed = None

    def add(self, layer, q0, probs, allow, n_q, k0=0, n_kv=None):
        (r0, r1), (c0, c1) = self.queries, self.keys
        if self.values is None:
            self.values = torch.zeros((probs.shape[1], r1 - r0, c1 - c0), dtype=torch.float32, device=probs.device)
            self.allowed = torch.zeros((r1 - r0, c1 - c0), dtype=torch.bool, device=probs.device)
        a, b = max(q0, r0), min(q0 + probs.shape[2], r1)
        c, d = max(k0, c0), min(k0 + probs.shape[3], c1)
        if a < b and c < d:
            self.values[:, a - r0:b - r0, c - c0:d - c0] = probs[0, :, a - q0:b - q0, c - k0:d - k0]
            self.allowed[a - r0:b - r0, c - c0:d - c0] = allow[0, 0, a - q0:b - q0, c - k0:d - k0]

    def finish(self, layer):
        """The region on the host, copied once (the engine and :func:`region` both ask)."""
        if not isinstance(self.values, np.ndarray):
            self.values, self.allowed = self.values.cpu().numpy(), self.allowed.cpu().numpy()
        return self.values, self.allowed


class _Done(Exception):
    """Raised after the region's layer: the rest of the forward is not needed."""


def check_range(name: str, span: tuple[int, int], n: int) -> tuple[int, int]:
    start, stop = int(span[0]), int(span[1])
    if not 0 <= start < stop <= n:
        raise InputError(f"the {name} range {start}..{stop} is not inside the text's 0..{n} tokens")
    if stop - start > MAX_SIDE:
        raise InputError(f"the {name} range spans {stop - start} tokens; a zoomed region shows at most {MAX_SIDE}")
    return start, stop


def region(loaded: LoadedModel, text: str, recipe: "str | Recipe", layer: int, queries: tuple[int, int], keys: tuple[int, int],
           on_layer=None, block_bytes: int | None = None,
           resume_from: tuple[int, torch.Tensor] | None = None) -> Region:
    """Layer ``layer``'s probabilities for ``queries`` × ``keys`` (half-open token ranges) at full
    resolution, under ``recipe`` (an architecture string or a recipe: a region of a capture is made with the
    capture's own recipe, which :func:`of_capture` passes); ``on_layer(done, total)`` reports progress up
    to that layer. ``block_bytes``: one query block's fp32 scores, else the plan's (:class:`attnviz.core.sizing.sizes.Sizes`).
    ``resume_from`` (layer c <= ``layer``, its input hidden states (n, d)), kept by a forward of the
    same text under the same settings, runs only layers c..``layer`` (:func:`engine.resume`)."""
    from attnviz import recipe as recipe_mod

    built = recipe_mod.build(loaded, recipe)
    architecture, variant = built.architecture, built.variant
    if not 0 <= layer < loaded.n_layers:
        raise InputError(f"layer {layer} does not exist: the model has layers 0..{loaded.n_layers - 1}")
    ids, tokens = tokenize(loaded, text, prepend=built.recipe.prepend)
    queries, keys = check_range("query", queries, len(ids)), check_range("key", keys, len(ids))
    crop = _Crop(queries, keys)

    def step(done: int) -> None:
        if on_layer:
            on_layer(done + 1, layer + 1)
        if done == layer:
            raise _Done

    # Under masks where no query sees a later key, up to this layer, the region's rows and keys depend
    # only on the tokens up to the last of them: the rest of the text is not run (a region near the
    # start of a 32k-token text costs a short forward). Other masks need the whole text.
    upto = max(queries[1], keys[1]) if all(m.causal_compatible for m in architecture.layers[:layer + 1]) else len(ids)
    input_ids = torch.tensor([ids[:upto]])
    record = engine.Record(frozenset({layer}), reducer=crop, on_layer=step, sizes=Sizes.given(block_bytes))
    if resume_from is not None and not (variant is None and resume_from[0] <= layer
                                        and resume_from[1].shape[0] == len(ids)):
        resume_from = None  # not this text's, not below the layer, or a residual variant: run from the start
    try:
        if resume_from is not None:
            start, hidden = resume_from
            engine.resume(loaded.model, hidden[:upto], start, input_ids, built.computes, record)
        else:
            built.forward(loaded, input_ids, record, engine.Feed(last_logits_only=True))
    except _Done:
        pass
    values, allowed = crop.finish(layer)
    return Region(layer, queries, keys, values, allowed, tokens[queries[0]:queries[1]], tokens[keys[0]:keys[1]],
                  architecture.layer_names[layer], architecture.spec, loaded.model_id)


def of_capture(loaded: LoadedModel, cap, layer: int, queries: tuple[int, int], keys: tuple[int, int],
               on_layer=None) -> Region:
    """The region of a capture's layer: cut from its full maps when it kept them, else recomputed
    with everything the capture was made with (architecture, intervention, BOS control, residual
    variant), so its cells are the capture's own, from the capture's nearest kept layer input below
    the layer when it kept some (``Keep(checkpoints=...)``)."""
    if layer in cap.probs:
        return from_capture(cap, layer, queries, keys)
    start = resumes_at(cap, layer)
    made_with = cap.recipe or Recipe.from_meta(cap.meta, cap.arch)
    return region(loaded, cap.text, made_with, layer, queries, keys, on_layer=on_layer,
                  resume_from=(start, cap.checkpoints[start]) if start else None)


def resumes_at(cap, layer: int) -> int:
    """The first layer :func:`of_capture` runs for a region of ``layer``: the capture's nearest kept
    layer input at or below it, else 0 (the embeddings)."""
    return max((c for c in cap.checkpoints if c <= layer), default=0)


def from_capture(cap, layer: int, queries: tuple[int, int], keys: tuple[int, int]) -> Region:
    """The same region cut from a capture that kept full maps (no forward needed)."""
    queries = check_range("query", queries, len(cap.row_tokens))
    keys = check_range("key", keys, cap.n_tokens)
    (a, b), (c, d) = queries, keys
    return Region(layer, queries, keys, cap.layer_probs(layer)[:, a:b, c:d], cap.allowed[layer][a:b, c:d],
                  cap.row_tokens[a:b], cap.tokens[c:d], cap.layer_masks[layer], cap.arch, cap.meta.get("model", ""))
