"""A decoder layer's two blocks, attention and MLP, and the modules whose outputs the residual stream adds.

Score attribution reads these outputs as the residual stream's sources (:mod:`attnviz.effects.schemes`); the
``patch`` intervention replaces them (docs/methods.md#patch). Gemma 2 adds its blocks' outputs after their
post-norms, so those norms are the modules here; GPT-2's blocks are ``attn`` and ``mlp`` of ``transformer.h``;
the others' are ``self_attn`` and ``mlp`` of ``model.layers``. A family not listed is refused with one line.
"""

from __future__ import annotations

import torch

from attnviz.errors import InputError

FAMILIES = ("llama", "mistral", "qwen2", "phi3", "gemma2", "gpt_oss", "gpt2")
KINDS = ("attn", "mlp")


def family(model) -> str:
    """The model's family, or an :class:`InputError` when its blocks are not mapped here."""
    name = getattr(model.config, "model_type", "?")
    if name not in FAMILIES:
        raise InputError(f"block outputs are mapped for {', '.join(FAMILIES)} models; this model is {name}, "
                         "whose blocks are not worked out here")
    return name


def layers(model) -> torch.nn.ModuleList:
    """The decoder layers, bottom first."""
    return model.transformer.h if family(model) == "gpt2" else model.model.layers


def source_modules(model, layer: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The modules whose outputs are ``layer``'s attention and MLP writes into the residual stream."""
    block = layers(model)[layer]
    kind = family(model)
    if kind == "gemma2":
        return block.post_attention_layernorm, block.post_feedforward_layernorm
    if kind == "gpt2":
        return block.attn, block.mlp
    return block.self_attn, block.mlp


def output_tensor(out) -> torch.Tensor:
    """A block's output as the residual stream adds it: attention and MoE blocks return tuples."""
    return out[0] if isinstance(out, tuple) else out


def with_output(out, value: torch.Tensor):
    """``out`` with its residual-stream tensor replaced by ``value`` (a tuple keeps its other parts)."""
    return (value, *out[1:]) if isinstance(out, tuple) else value
