"""The engine's forward: a run made for one call (:func:`make_run`), the model run under it (:func:`forward`), and
a forward resumed from a layer's kept input (:func:`resume`). Above the run's state (:mod:`attnviz.core.engine.run`), the
attention function (:mod:`attnviz.core.engine.attention`) and the layer hooks (:mod:`attnviz.core.engine.hooks`), which import
nothing from here."""

from __future__ import annotations

import contextlib
import inspect

import torch

from dataclasses import dataclass

from attnviz.core.model import anatomy, head
from attnviz.core.record import recorders as recorders_mod
from attnviz.core.engine.attention import prepare
from attnviz.core.engine.hooks import hook_blocks, checkpoint_inputs, resumable_layers
from attnviz.core.spec import kinds
from attnviz.core.spec.interventions import BLOCKS
from attnviz.core.engine.run import Computes, Feed, Record, Run, active, n_layers
from attnviz.core.sizing.sizes import Sizes
from attnviz.errors import InputError


def forward(model, input_ids: torch.Tensor, computes, record: Record = Record(), feed: Feed = Feed()):
    """One forward pass under per-layer masks and interventions (``computes``: a :class:`Computes` or a list
    of masks), recording what ``record`` asks; returns ``(model_output, run)``. Recorded layers compute
    their softmax in blocks of query rows (the plan's block size, ``record.sizes``)."""
    with contextlib.nullcontext() if feed.grad else torch.inference_mode():
        run = make_run(model, input_ids, computes, record, feed)
        cached = feed.past_key_values is not None
        if cached != (feed.kv_positions is not None):
            raise ValueError("a cached forward takes past_key_values and kv_positions together")
        new_positions = run.positions[:, -input_ids.shape[1]:] if cached else run.positions
        target = model if feed.lm_head else model.base_model
        last_only = {"logits_to_keep": 1} if feed.last_logits_only and feed.lm_head and "logits_to_keep" in \
            inspect.signature(model.forward).parameters else {}
        if run.checkpoint_layers:
            checkpoint_inputs(model)
        with active(run):
            output = target(input_ids=input_ids.to(model.device), position_ids=new_positions.to(model.device),
                            attention_mask=None if cached else run.valid.long().to(model.device),
                            past_key_values=feed.past_key_values, use_cache=cached,
                            output_hidden_states=feed.hidden_states, **last_only)
    return output, run


def make_run(model, input_ids: torch.Tensor, computes, record: Record = Record(), feed: Feed = Feed()) -> Run:
    """The per-call state of :func:`forward` (positions, masks, what to record), checked.

    Code that runs the layers itself (residual variants) makes one and enters :func:`active`.
    """
    if getattr(model.config, "is_encoder_decoder", False):
        raise InputError(f"{type(model).__name__} is an encoder-decoder model: this view takes decoder-only models "
                         "(encoder-decoders are captured on the heatmaps page or with `attnviz capture`)")
    prepare(model)
    computes = Computes.of(computes)
    masks, total = list(computes.masks), n_layers(model)
    if len(masks) != total:
        raise ValueError(f"{len(masks)} masks for a model with {total} layers")
    attention_mask, kv_positions = feed.attention_mask, feed.kv_positions
    if kv_positions is not None:
        if attention_mask is not None:
            raise ValueError("a cached forward takes kv_positions and no attention_mask")
        positions = kv_positions.long()
        valid = torch.ones_like(positions, dtype=torch.bool)
    else:
        valid = (torch.ones_like(input_ids) if attention_mask is None else attention_mask).bool()
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    if any(a.patches(block) for a in computes.interventions.items for block in BLOCKS):
        hook_blocks(model)
    for mask in {id(m): m for m in masks}.values():
        if mask.horizon is not None and int(positions.max()) + 1 > mask.horizon:
            raise InputError(f"{mask.name} was set for at most T={mask.horizon} tokens but the text reaches "
                             f"{int(positions.max()) + 1}: raise T or shorten the text")
    def model_window(layer: int) -> int | None:  # before the layer's attention reports its own (an embedding patch)
        try:
            return anatomy.of(model)[layer].window
        except InputError:
            return None

    return Run(masks, frozenset(range(total) if record.layers is None else record.layers), positions, valid,
               recorders=record.recorders if record.recorders is not None else recorders_mod.for_record(record),
               on_layer=record.on_layer, model_window=model_window,
               keep_graph=record.keep_graph, interventions=computes.interventions,
               # the model's own kind looked up once a run, not at every layer's call
               kind=computes.kind if computes.kind is not None else kinds.own(getattr(model, "config", None)),
               sizes=record.sizes or Sizes.given(record.block_bytes, record.whole_allow_bytes),
               unpadded=True if kv_positions is not None or attention_mask is None else None,
               checkpoint_layers=frozenset(record.checkpoints))


@dataclass
class Resumed:
    """What :func:`resume` made: the run (what it recorded) and the last layer's output (B, n, d), before the final
    norm; :meth:`logits` reads the model's head on it."""

    run: Run
    hidden: torch.Tensor

    def logits(self, model, last_only: bool = True) -> torch.Tensor:
        return head_logits(model, self.hidden, last_only)


def resume(model, hidden: torch.Tensor, start: int, input_ids: torch.Tensor, computes,
           record: Record = Record()) -> Resumed:
    """Layers ``start``.. of :func:`forward` of ``input_ids`` (1, n), run from ``hidden`` (n, d): the
    input of layer ``start`` that an earlier forward of the same tokens, masks and interventions kept
    (``Run.checkpoints``). The layers below are not run again; like :func:`forward`, ``record.on_layer`` may
    stop it after any layer. A batch resumes too: ``input_ids`` (B, n) with ``hidden`` (B, n, d) or (n, d), the
    same input for every row. Returns what it made (:class:`Resumed`)."""
    resumable_layers(model)
    found = anatomy.of(model)
    run = make_run(model, input_ids, computes, record)
    with active(run), torch.inference_mode():
        h = hidden.to(model.device)
        h = h[None].expand(input_ids.shape[0], -1, -1) if h.dim() == 2 else h
        positions = run.positions.to(model.device)
        # the keyword arguments the base model calls a layer with (the anatomy's probe saw them), made again;
        # the masks come from the run, so the attention mask is None as in every attnviz forward
        made = {"position_ids": positions, "use_cache": False, "output_attentions": False,
                "cache_position": torch.arange(positions.shape[-1], device=positions.device)}
        for layer in found.layers[start:n_layers(model)]:
            kwargs = {name: made.get(name) for name in found.layer_kwargs}
            if "position_embeddings" in kwargs:
                kwargs["position_embeddings"] = found.position_embeddings(h, positions, layer)
            given = layer.module(h, **kwargs)
            h = given[0] if isinstance(given, tuple) else given
    return Resumed(run, h)


@torch.no_grad()
def head_logits(model, hidden: torch.Tensor, last_only: bool = True) -> torch.Tensor:
    """The next-token logits of a last layer's output ``hidden`` (B, n, d), as the model's own forward makes them
    (the model's head, written once in :mod:`attnviz.core.model.head`: its final norm, its output layer with its bias,
    the families' scalings). (B, V) of the last position, or (B, n, V) with ``last_only=False``. :func:`check_head`
    checks it on a model."""
    logits = head.logits(model, hidden[:, -1:] if last_only else hidden)
    return logits[:, -1] if last_only else logits


def check_head(model, hidden: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Refuse, in one line, a model whose logits :func:`head_logits` does not make again from the last layer's output
    ``hidden`` (expected (B, V), the model's own, within 1e-3 relative in float32 and the dtype's decomposition limit
    in half precision, :func:`attnviz.core.model.precision.decomposition_tolerance`): ``what`` resumes forwards and reads
    them. Checked once per model and dtype (kept on the model): the head does not change between texts."""
    from attnviz.core.model import precision

    dtype = next(model.parameters()).dtype
    checked = model.__dict__.setdefault("_attnviz_head_checked", {})
    if dtype not in checked:
        limit = max(1e-3, precision.decomposition_tolerance(dtype))
        made, want = head_logits(model, hidden).float(), expected.float()
        miss = float((made - want).norm() / want.norm().clamp(min=1e-30))
        checked[dtype] = "" if miss <= limit else (
            f"{anatomy.of(model).family}'s logits are not its final norm and output embedding of its last layer (off "
            f"by {miss:.3g} relative, limit {limit:.3g} in {precision.name(dtype)}), so a resumed forward cannot read "
            "them")
    if checked[dtype]:
        raise InputError(f"{what}: {checked[dtype]}")


def checked_head(model, ids: torch.Tensor, top_input: torch.Tensor, expected: torch.Tensor, computes,
                 what: str) -> None:
    """:func:`check_head` of a resumed top layer: resume layer L − 1 from ``top_input`` (its kept input, (n, d)) for
    ``ids`` (1, n) and compare its logits with ``expected`` (1, V), the same forward's own. Once per model."""
    dtype = next(model.parameters()).dtype
    if dtype in model.__dict__.get("_attnviz_head_checked", {}):
        return check_head(model, top_input, expected, what)  # the kept answer: nothing is run
    top = resume(model, top_input, n_layers(model) - 1, ids, computes)
    check_head(model, top.hidden, expected, what)
