"""Greedy generation under an architecture, for showing what a mask does to the output.

Only causal-compatible architectures (no query ever sees a later key: FWD, NoSink-FWD, causal
windows) are allowed: under BIDIR, BACK or StableMask a token's representation depends on tokens
that do not exist yet while generating, so "generation" would silently mean something else. Each
step re-runs the whole prefix through :func:`engine.forward` (no KV cache), which keeps every mask
exact and is fast enough for the short continuations a demo needs.
"""

from __future__ import annotations

import torch

from . import arch as arch_mod
from . import engine
from .capture import tokenize
from .errors import ArchitectureError, InputError
from .models import LoadedModel

MAX_NEW_TOKENS = 128


def check_generation(architecture: arch_mod.Architecture) -> None:
    for layer, mask in enumerate(architecture.layers):
        if not mask.causal_compatible:
            raise ArchitectureError(
                f"cannot generate with '{architecture.spec}': layer {layer} uses {mask.name}, which lets a query "
                "see later keys (or, for StableMask, future pseudo-slots); generation needs a causal-compatible "
                "mask in every layer (fwd, nosink-fwd, sliding, dilated, global)"
            )


def generate(loaded: LoadedModel, text: str, arch: str | arch_mod.Architecture = "fwd",
             max_new_tokens: int = 20) -> tuple[list[int], str]:
    """Greedy continuation of ``text``: (new token ids, decoded text)."""
    architecture = arch if isinstance(arch, arch_mod.Architecture) else arch_mod.parse(arch, loaded.n_layers)
    check_generation(architecture)
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise InputError(f"max_new_tokens must be between 1 and {MAX_NEW_TOKENS}, got {max_new_tokens}")
    ids, _ = tokenize(loaded, text, loaded.max_tokens - max_new_tokens)
    sequence = torch.tensor([ids])
    new: list[int] = []
    eos = getattr(loaded.model.generation_config, "eos_token_id", None)
    eos = set(eos if isinstance(eos, list) else [eos]) - {None}
    for _ in range(max_new_tokens):
        output, _ = engine.forward(loaded.model, sequence, list(architecture.layers), record=set())
        token = int(output.logits[0, -1].argmax())
        new.append(token)
        sequence = torch.cat([sequence, torch.tensor([[token]])], dim=1)
        if token in eos:
            break
    return new, loaded.tokenizer.decode(new)
