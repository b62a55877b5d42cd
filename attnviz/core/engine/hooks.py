"""The engine's own functions at the named sites (:mod:`attnviz.core.engine.sites`), installed once per model and read by the
active run: ``patch`` replacing a block's write (or the embedding's), a layer's input kept to resume a later
forward from (:func:`attnviz.core.engine.forward.resume`). Outside a run they do nothing; a run is the thread's own, so the
shared server's sessions on one model never see each other's."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from attnviz.core.model import anatomy
from attnviz.core.engine import sites
from attnviz.core.model.anatomy import decoder_layers
from attnviz.core.spec.interventions import BLOCKS
from attnviz.core.engine.run import Run, current, n_layers

_SITE = {"attn": "attn_out", "mlp": "mlp_out", "embed": "embed"}


def _patch(layer: int, block: str):
    """The active run's ``patch`` interventions of that layer and block, on the site's value."""
    def fn(value):
        run = current()
        if not isinstance(run, Run):
            return None
        acts = [a for a in run.interventions.at(layer) if a.patches(block)]
        if not acts:
            return None
        n = value.shape[1]
        positions = run.positions_on(value.device)[:, -n:]
        valid = run.valid_on(value.device)[:, -n:]
        for intervention in acts:
            value = intervention.block_output(value, positions, valid, run.sink_key(layer))
        return value
    return fn


def hook_blocks(model) -> None:
    """Install, once per model, the functions that apply a run's ``patch`` interventions (a family whose blocks are
    not mapped is refused here, with one line: :func:`attnviz.core.model.anatomy.of`)."""
    anatomy.of(model)
    sites.install(model, "patch", [(sites.Site(_SITE[block], index), _patch(index, block))
                                   for index in range(n_layers(model)) for block in BLOCKS
                                   if block != "embed" or index == 0], first=True)


def _checkpoint(index: int):
    def fn(value):
        run = current()
        if isinstance(run, Run) and index in run.checkpoint_layers:
            run.checkpoints[index] = value[0].detach().to("cpu", copy=True)  # one copy a kept layer
        return None
    return fn


def resumable_layers(model) -> torch.nn.ModuleList:
    """The layers a forward can resume from, or a ``ValueError`` that says why not."""
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(anatomy.of(model).why_not_resumable if not getattr(model.config, "is_encoder_decoder", False)
                         else f"{model.config.model_type} models cannot resume a forward from a layer's input")
    return layers


def checkpoint_inputs(model) -> None:
    """Install, once per model, the functions that keep the inputs of the layers a run names in
    ``checkpoint_layers`` (on the host, the batch's first row)."""
    layers = resumable_layers(model)
    sites.install(model, "inputs", [(sites.Site("resid_pre", index), _checkpoint(index))
                                    for index in range(len(layers))])


@contextmanager
def layer_input_norms(model):
    """Inside, every forward of this thread records, per decoder layer, the norm of each token's residual stream
    entering it ((n,) float32 on the host, by layer index, of the batch's first row): the massive activations'
    measure (Sun et al. 2024) without keeping a hidden state, so a long text costs n floats a layer. Other threads'
    forwards (the shared server's sessions) are not read; a model the anatomy does not map reads nothing."""
    norms: dict[int, "torch.Tensor"] = {}

    def norm_of(index):
        def fn(value):
            norms[index] = torch.linalg.vector_norm(value[0], dim=-1, dtype=torch.float32).cpu().numpy()
        return fn

    layers = decoder_layers(model)
    with sites.hooks(model, [(sites.Site("resid_pre", index), norm_of(index)) for index in range(len(layers or []))]):
        yield norms
