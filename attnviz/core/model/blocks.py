"""A decoder layer's two blocks, attention and MLP, and the modules whose outputs the residual stream adds.

Score attribution reads these outputs as the residual stream's sources (:mod:`attnviz.effects.schemes`); the
``patch`` intervention replaces them (docs/methods.md#patch). Which modules they are is the model's anatomy
(:mod:`attnviz.core.model.anatomy`): the block itself, or its post-norm where the stream adds the norm's output
(Gemma 2 and 3, OLMo 2 and 3, Exaone 4, GLM-4). A model whose layers do not add up is refused with one line.
"""

from __future__ import annotations

import torch

from attnviz.core.model import anatomy
from attnviz.core.model.anatomy import output_tensor  # noqa: F401 - a block's output as the residual stream adds it

KINDS = ("attn", "mlp")


def family(model) -> str:
    """The model's family label, or an :class:`~attnviz.errors.InputError` when its blocks cannot be mapped."""
    return anatomy.of(model).family


def layers(model) -> torch.nn.ModuleList:
    """The decoder layers, bottom first."""
    return anatomy.of(model).layer_list


def source_modules(model, layer: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The modules whose outputs are ``layer``'s attention and MLP writes into the residual stream."""
    found = anatomy.of(model)[layer]
    return found.attn_write, found.mlp_write


def with_output(out, value: torch.Tensor):
    """``out`` with its residual-stream tensor replaced by ``value`` (a tuple keeps its other parts)."""
    return (value, *out[1:]) if isinstance(out, tuple) else value
