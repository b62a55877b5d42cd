"""Hooks on a model's layers, registered once per model and read by the active run: ``patch`` replacing a block's
write, a layer's input kept to resume a later forward from (:func:`resume`: a long capture's regions)."""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

import torch

from attnviz.core import anatomy, blocks
from attnviz.core.anatomy import decoder_layers
from attnviz.core.run import Run, _RUN, n_layers

# The shared server's sessions share one loaded model: hooks are registered on it once, under this lock
_HOOKS = threading.Lock()


def _patch_block(layer: int, kind: str, module, args, out):
    """A forward hook on a block's output module (:mod:`attnviz.core.blocks`): the active run's ``patch``
    interventions of that layer and block replace the output where the residual stream adds it."""
    run = _RUN.get()
    if not isinstance(run, Run):
        return None
    acts = [a for a in run.interventions.at(layer) if a.patches(kind)]
    if not acts:
        return None
    value = blocks.output_tensor(out)
    n = value.shape[1]
    positions = run.positions[:, -n:].to(value.device)
    valid = run.valid_on(value.device)[:, -n:]
    for intervention in acts:
        value = intervention.block_output(value, positions, valid, run.sink_key(layer))
    return blocks.with_output(out, value)


def _hook_blocks(model) -> None:
    """Hook every layer's attention and MLP output modules once, so that a run's ``patch`` interventions
    apply; the hooks read the active run, so runs of other sessions on the same model are untouched. A family
    whose blocks are not mapped is refused here, with one line (:func:`attnviz.core.blocks.family`)."""
    with _HOOKS:  # once, however many sessions ask at the same time
        if getattr(model, "_attnviz_patches_blocks", False):
            return
        for index in range(n_layers(model)):
            for kind, module in zip(blocks.KINDS, blocks.source_modules(model, index)):
                module.register_forward_hook(functools.partial(_patch_block, index, kind))
        model._attnviz_patches_blocks = True


def _keep_input(index: int, module, args, kwargs) -> None:
    run = _RUN.get()
    if isinstance(run, Run) and index in run.checkpoint_layers:
        hidden = args[0] if args else kwargs["hidden_states"]
        run.checkpoints[index] = hidden[0].detach().to("cpu", copy=True)  # one copy a kept layer


def _resumable_layers(model) -> torch.nn.ModuleList:
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(anatomy.of(model).resumable if not getattr(model.config, "is_encoder_decoder", False)
                         else f"{model.config.model_type} models cannot resume a forward from a layer's input")
    return layers


def _keep_layer_inputs(model) -> None:
    """Hook every decoder layer once, so that a run asking for ``checkpoint_layers`` keeps their inputs;
    the hook reads the active run, so runs of other sessions on the same model are untouched."""
    layers = _resumable_layers(model)
    with _HOOKS:  # once, however many sessions ask at the same time
        if not getattr(model, "_attnviz_keeps_inputs", False):
            for index, layer in enumerate(layers):
                layer.register_forward_pre_hook(functools.partial(_keep_input, index), with_kwargs=True)
            model._attnviz_keeps_inputs = True


@contextmanager
def layer_input_norms(model):
    """Inside, every forward of this thread records, per decoder layer, the norm of each token's residual stream
    entering it ((n,) float32 on the host, by layer index, of the batch's first row): the massive activations'
    measure (Sun et al. 2024) without keeping a hidden state, so a long text costs n floats a layer. Hooks on the
    anatomy's layers, removed after; other threads' forwards (the shared server's sessions) are not read."""
    norms: dict[int, "torch.Tensor"] = {}
    owner = threading.get_ident()

    def keep(index, module, args, kwargs):
        if threading.get_ident() == owner:
            hidden = args[0] if args else kwargs["hidden_states"]
            norms[index] = torch.linalg.vector_norm(hidden[0], dim=-1, dtype=torch.float32).cpu().numpy()

    layers = decoder_layers(model)  # None for a model the anatomy does not map: nothing is read
    handles = [layer.register_forward_pre_hook(functools.partial(keep, index), with_kwargs=True)
               for index, layer in enumerate(layers or [])]
    try:
        yield norms
    finally:
        for handle in handles:
            handle.remove()
