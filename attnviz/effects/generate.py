"""Greedy generation with the KV cache under a causal-compatible architecture and a cache policy.

Every step goes through :class:`~attnviz.effects.streaming.CachedDecoder`: one new token against
transformers' ``DynamicCache``, never a re-run of the prefix. Only causal-compatible architectures
are allowed (FWD, NoSink-FWD, causal windows): under BIDIR, BACK or StableMask a token's
representation depends on tokens that do not exist yet while generating, so "generation" would
silently mean something else. Each step records the new token's attention over the cache, so the
sink can be seen staying, or being evicted, as the text grows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from attnviz.tokens import tokenize
from attnviz.core.spec import arch as arch_mod
from attnviz.core.loading.models import LoadedModel
from attnviz.effects.streaming import CachedDecoder, Policy, Step
from attnviz.errors import InputError

MAX_NEW_TOKENS = 128


@dataclass
class Generation:
    """Cached greedy generation: the prompt and new tokens, and every step's attention row."""

    prompt_ids: list[int]
    new_ids: list[int]
    text: str
    steps: list[Step] = field(repr=False)
    policy: str = "dense"
    arch: str = "fwd"
    model: str = ""
    intervene: str | None = None  # the interventions (docs/methods.md#interventions), if any

    def as_json(self) -> dict:
        """What `attnviz generate` prints (docs/cli.md)."""
        return {"model": self.model, "arch": self.arch, "policy": self.policy, "text": self.text,
                **({"intervene": self.intervene} if self.intervene else {}),
                "new_ids": self.new_ids, "prompt_tokens": len(self.prompt_ids)}

    def attention_rows(self, layer: int, head: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(values, evicted): (steps, positions) matrices. ``values`` holds each step's attention
        (mean over heads when ``head`` is None) at the positions in its cache, NaN elsewhere;
        ``evicted`` marks positions that existed but had left the cache."""
        n = self.steps[-1].position + 1
        values = np.full((len(self.steps), n), np.nan)
        evicted = np.zeros((len(self.steps), n), dtype=bool)
        for row, step in enumerate(self.steps):
            probs = step.maps[layer]
            values[row, step.kv_positions] = probs.mean(0) if head is None else probs[head]
            evicted[row, :step.position + 1] = True
            evicted[row, step.kv_positions] = False
        return values, evicted


ROW_OVERHEAD = 36  # bytes per cached position per step besides the maps: its entry in ``kv_positions``


def estimate_bytes(loaded: LoadedModel, n_steps: int, policy: Policy, n_layers: int | None = None) -> int:
    """What a generation's recorded rows hold: every step keeps each recorded layer's (H, cache) fp32
    attention row, so dense generation grows with n²: ~1 GB at 1,300 steps on the default model."""
    per_position = (loaded.n_layers if n_layers is None else n_layers) * loaded.n_heads * 4 + ROW_OVERHEAD
    size = policy.cache_size
    cells = sum(min(p, size + 1) if size else p for p in range(1, n_steps + 1))  # the cache and the new token
    return cells * per_position


def generate(loaded: LoadedModel, text: str, recipe: str | arch_mod.Architecture = "fwd",
             policy: Policy | str = "dense", max_new_tokens: int = 20, record: set[int] | None = None,
             on_step: Callable[[int, int], None] | None = None, max_bytes: int | None = None) -> Generation:
    """Greedy continuation with the KV cache: the prompt is fed token by token under the policy too,
    so every row of the attention view (prompt and new tokens) is what the cache really held.

    ``max_bytes`` refuses, before running, a generation whose recorded rows (:func:`estimate_bytes`)
    would exceed it, saying which prompt length would fit (the app passes its per-capture limit)."""
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise InputError(f"max_new_tokens must be between 1 and {MAX_NEW_TOKENS}, got {max_new_tokens}")
    import dataclasses

    from attnviz.recipe import Recipe

    prepend = None
    if isinstance(recipe, Recipe):  # the BOS control applies to the prompt here, not to the decoder
        prepend, recipe = recipe.prepend, dataclasses.replace(recipe, prepend=None)
    ids, _ = tokenize(loaded, text, loaded.max_tokens - max_new_tokens, prepend)
    decoder = CachedDecoder(loaded, recipe, policy, record=set(range(loaded.n_layers)) if record is None else record)
    if max_bytes is not None:
        layers = len(decoder.record)
        need = estimate_bytes(loaded, len(ids) + max_new_tokens - 1, decoder.policy, layers)
        if need > max_bytes:
            fit = next((n for n in range(len(ids), 0, -16)
                        if estimate_bytes(loaded, n + max_new_tokens - 1, decoder.policy, layers) <= max_bytes), 0)
            raise InputError(f"recording every step's attention over the cache for {len(ids)} prompt tokens would "
                             f"take ~{need / 2**20:,.0f} MB, more than the {max_bytes / 2**20:,.0f} MB allowed: a "
                             f"prompt of at most ~{fit} tokens fits, or a cache policy such as window(w=...)")
    eos = getattr(loaded.model.generation_config, "eos_token_id", None)
    eos = set(eos if isinstance(eos, list) else [eos]) - {None}
    steps, new = [], []
    total = len(ids) + max_new_tokens - 1

    def feed(token: int) -> None:
        if steps:  # only the newest step's next-token distribution is read: 200 KB a step otherwise
            steps[-1].logprobs = None
        steps.append(decoder.step(token))
        if on_step:
            on_step(len(steps), total)

    for token in ids:
        feed(token)
    while True:
        new.append(int(steps[-1].logprobs.argmax()))
        if len(new) == max_new_tokens or new[-1] in eos:
            break
        feed(new[-1])
    return Generation(list(ids), new, loaded.tokenizer.decode(new), steps, decoder.policy.spec,
                      decoder.architecture.spec, loaded.model_id, decoder.interventions.spec or None)
