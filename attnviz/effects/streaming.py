"""Token-by-token decoding with a real KV cache and StreamingLLM's cache policies (docs/methods.md#cache-policies).

The cache is transformers' own ``DynamicCache``; a policy only drops entries from it. After each
step the cache is cut back to the policy's size, as StreamingLLM's ``eval_long_ppl.py`` does with
its ``StartRecentKVCache``: the next token then attends to at most ``cache_size`` kept entries plus
itself. Kept entries keep the positions they were encoded with (keys are cached after RoPE), and the
new token gets its true position, so texts shorter than the model's context need no re-indexing.
Masks follow those positions (``engine.Feed(kv_positions=...)``), so a causal-compatible
architecture such as NoSink-FWD stays exact under eviction.

The next token's log-probability is read before it enters the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from transformers import DynamicCache

from attnviz.core.spec import arch as arch_mod
from attnviz.core import engine
from attnviz.core.spec import syntax
from attnviz.core.loading.models import LoadedModel
from attnviz.errors import InputError

MAX_TOKENS = 1000  # the text `attnviz stream` reads by default

#: The cache policies by name, each a builder whose signature gives its parameters.
POLICIES = syntax.Registry("cache policy")


@dataclass(frozen=True)
class Policy:
    """``dense`` (keep all), ``window(w=W)`` (the last W), ``sink(s=S, w=W)`` (the first S and the last W)."""

    name: str  # its name in POLICIES: "dense", "window" or "sink"
    s: int = 0
    w: int = 0

    def __post_init__(self):
        if self.name != "dense" and self.w <= 0:
            raise InputError(f"in '{self.spec}': the window w must be positive, got {self.w}")
        if self.s < 0:
            raise InputError(f"in '{self.spec}': the sink size s must be >= 0, got {self.s}")

    @property
    def spec(self) -> str:
        return {"dense": "dense", "window": f"window(w={self.w})", "sink": f"sink(s={self.s}, w={self.w})"}[self.name]

    @property
    def cache_size(self) -> int | None:
        return None if self.name == "dense" else self.s + self.w

    def keep(self, n: int) -> list[int] | None:
        """Indices of the cache entries to keep out of ``n``, or None to keep all."""
        size = self.cache_size
        if size is None or n <= size:
            return None
        return list(range(self.s)) + list(range(n - self.w, n))

    def check(self, loaded: LoadedModel, n_tokens: int | None = None) -> "Policy":
        """Refuse a cache larger than the model's context, or (given ``n_tokens``) than the text."""
        if self.name == "dense":
            return self
        if self.cache_size > loaded.max_tokens:
            raise InputError(f"{self.spec} keeps {self.cache_size} entries, more than {loaded.model_id}'s context "
                             f"({loaded.max_tokens})")
        if n_tokens is not None and self.cache_size > n_tokens:
            raise InputError(f"{self.spec} keeps {self.cache_size} entries but the text has only {n_tokens} tokens: "
                             "the policy would never evict anything; use a smaller size")
        return self


@POLICIES.register("dense")
def dense() -> Policy:
    """Keep every entry."""
    return Policy("dense")


@POLICIES.register("window")
def window(w: int) -> Policy:
    """Keep the last ``w`` entries."""
    return Policy("window", 0, w)


@POLICIES.register("sink")
def sink(s: int, w: int) -> Policy:
    """Keep the first ``s`` entries (the sinks) and the last ``w`` (StreamingLLM)."""
    return Policy("sink", s, w)


def parse_policy(text: str) -> Policy:
    """``dense``, ``window(w=128)`` or ``sink(s=4, w=124)``; ``sink(s=0, w=W)`` keeps what ``window(w=W)`` keeps."""
    parsed = syntax.call(text or "", "cache policy", "dense, window(w=W) or sink(s=S, w=W)")
    if parsed.layers is not None:
        raise InputError(f"a cache policy acts on every layer: drop '@{parsed.layers}' from '{parsed.text}'")
    return POLICIES.build(parsed)


def as_policy(policy: "Policy | str") -> Policy:
    return parse_policy(policy) if isinstance(policy, str) else policy


@dataclass
class Step:
    """One decoding step: the token fed, its position, the next-token log-probabilities, and for
    each recorded layer the new token's attention (H, n_kv) over ``kv_positions``."""

    token: int
    position: int
    logprobs: torch.Tensor
    kv_positions: list[int]
    maps: dict[int, np.ndarray] = field(default_factory=dict)


class CachedDecoder:
    """Feeds tokens one at a time through a ``DynamicCache`` under an architecture and a policy."""

    def __init__(self, loaded: LoadedModel, recipe: "str | arch_mod.Architecture | Recipe" = "fwd",
                 policy: Policy | str = "dense", record: set[int] | frozenset[int] = frozenset()):
        from attnviz.recipe import build

        built = build(loaded, recipe).only("decoding with a KV cache", "intervene", "kind")
        self.loaded, self.recipe = loaded, built.recipe
        self.architecture = built.architecture.require_causal("decode with a KV cache")
        self.policy = as_policy(policy).check(loaded)
        self.interventions, self.kind = built.interventions, built.kind
        self.record = set(record)
        self.cache = DynamicCache()
        self.positions: list[int] = []  # the position each cache entry was encoded at
        self.kv: torch.Tensor | None = None  # the same positions, (1, n), on the model's device
        self.next_position = 0
        self._indices: dict = {}

    def step(self, token: int) -> Step:
        """Feed one token. On an accelerator the step waits for nothing: the token and positions are
        made on the model's device by fill kernels (no host-to-device copy, each of which would wait
        for the device), the eviction index is made once per device, and the log-probabilities stay
        on the device (``Step.logprobs``) until someone reads them. Recorded maps come to the host."""
        position = self.next_position
        device = self.loaded.model.device
        new = torch.full((1, 1), position, dtype=torch.long, device=device)
        kv = new if self.kv is None else torch.cat([self.kv, new], 1)
        output, run = engine.forward(self.loaded.model, torch.full((1, 1), token, dtype=torch.long, device=device),
                                     engine.Computes(tuple(self.architecture.layers), self.interventions, self.kind),
                                     engine.Record(layers=frozenset(self.record), storage_dtype=torch.float32),
                                     engine.Feed(past_key_values=self.cache, kv_positions=kv))
        seen = self.positions + [position]
        step = Step(token, position, torch.log_softmax(output.logits[0, -1].float(), -1), seen,
                    {layer: probs[0, :, 0].numpy() for layer, probs in run.probs.items()})
        self.positions, self.kv, self.next_position = seen, kv, position + 1
        self._evict()
        return step

    def _evict(self) -> None:
        keep = self.policy.keep(len(self.positions))
        if keep is None:
            return
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, self._index(keep, layer.keys.device))
            layer.values = layer.values.index_select(-2, self._index(keep, layer.values.device))
        self.kv = self.kv.index_select(1, self._index(keep, self.kv.device))
        self.positions = [self.positions[i] for i in keep]

    def _index(self, keep: list[int], device: torch.device) -> torch.Tensor:
        """The eviction index on ``device``: a full cache always keeps the same slots, so it is copied
        there once, not once a layer and step (each copy from the host waits for the device)."""
        key = (keep[-1], len(keep), device)
        if key not in self._indices:
            self._indices[key] = torch.tensor(keep, device=device)
        return self._indices[key]


@dataclass
class StreamResult:
    policy: str
    arch: str
    token_nll: np.ndarray = field(repr=False)  # NLL of token t+1 given the cache after step t
    cache_size: int | None
    intervene: str | None = None  # the interventions (docs/methods.md#interventions), if any

    @property
    def tokens(self) -> int:
        return int(self.token_nll.size)

    @property
    def perplexity(self) -> float:
        return math.exp(float(self.token_nll.mean()))

    def running_perplexity(self) -> np.ndarray:
        """exp(running mean NLL) against the predicted token's position (1 .. n-1)."""
        return np.exp(np.cumsum(self.token_nll) / np.arange(1, self.tokens + 1))

    def as_json(self, curve: bool = False) -> dict:
        doc = {"policy": self.policy, "arch": self.arch, "perplexity": round(self.perplexity, 6),
               "tokens": self.tokens, "cache_size": self.cache_size}
        if self.intervene:
            doc["intervene"] = self.intervene
        if curve:
            doc["running_perplexity"] = [round(float(x), 4) for x in self.running_perplexity()]
        return doc


@dataclass
class Comparison:
    """Several policies streamed over the same tokens (`attnviz stream --compare`), each with its running curve."""

    model: str
    results: list[StreamResult]

    def as_json(self) -> dict:
        return {"model": self.model, "arch": self.results[0].arch, "tokens": self.results[0].tokens,
                "policies": [r.as_json(curve=True) for r in self.results]}


def stream(loaded: LoadedModel, ids: list[int], policy: Policy | str = "dense",
           recipe: "str | arch_mod.Architecture | Recipe" = "fwd",
           on_step: Callable[[int, int], None] | None = None) -> StreamResult:
    """Streaming perplexity of ``ids`` under a cache policy (StreamingLLM's protocol, docs/methods.md#cache-policies)
    and a recipe (``recipe``: an architecture string, or a recipe with its interventions)."""
    if len(ids) < 2:
        raise InputError(f"the text has {len(ids)} token(s); at least 2 are needed to predict one")
    policy = as_policy(policy).check(loaded, len(ids))
    if policy.name == "dense" and len(ids) > loaded.max_tokens:
        raise InputError(f"the text is {len(ids)} tokens, longer than {loaded.model_id}'s context "
                         f"({loaded.max_tokens}): use a window or sink policy, or --max-tokens")
    decoder = CachedDecoder(loaded, recipe, policy)
    nll = torch.empty(len(ids) - 1, device=loaded.model.device)  # on the device, read once at the end
    for t in range(len(ids) - 1):
        step = decoder.step(ids[t])
        nll[t] = -step.logprobs[ids[t + 1]]
        if on_step:
            on_step(t + 1, len(ids) - 1)
    return StreamResult(policy.spec, decoder.architecture.spec, nll.cpu().numpy().astype(np.float64), policy.cache_size,
                        decoder.interventions.spec or None)
