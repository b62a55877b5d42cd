"""KV-cache compression what-if (docs/methods.md#kv-cache-compression, the kvpress protocol) on the same engine as everything else.

A text is split into a context (its first C tokens) and a continuation (the rest). The context is
prefilled once under the architecture, recording every layer's attention, from which each press
scores the context keys of every (layer, KV head). A compressed cache keeps the top
int((1 - r)·C) of them (as kvpress does): the continuation's rows then see only those context keys (and their own
earlier keys), which is a per-head key mask (:attr:`attnviz.core.engine.Run.head_masks`), so the whole text
runs as one masked forward and the kept keys can be drawn over the same heatmaps.

What is scored: the continuation tokens from C + 1 on, each predicted by a continuation row (row C
predicts token C + 1). Token C itself is predicted by the context's last row, which no compression
touches. Measures against the dense cache (r = 0): NLL, perplexity, accuracy, the mean KL divergence
of the next-token distributions, and ``kept_key0``, the share of (layer, KV head) pairs that keep
key 0 (the sink).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import numpy as np
import torch

from attnviz.core.spec import arch as arch_mod
from attnviz.core import engine
from attnviz.core.loading.models import LoadedModel
from attnviz.errors import InputError
from attnviz.kv.presses import DEFAULTS, Context, Press, SnapKV, parse

RATIOS = (0.0, 0.25, 0.5, 0.75, 0.9)
MAX_TOKENS = 1024  # the text the command and the sweep read (context + continuation)
MAP_SIDE = 96  # the context's maps are kept max-pooled to at most this many cells a side, for the figures


@dataclass
class Prefill:
    """The context's per-layer attention and keys, and the whole text's ids."""

    ids: list[int]
    context: int
    layers: list[Context] = field(repr=False)


@dataclass
class Row:
    press: str
    ratio: float
    nll: float
    accuracy: float
    kl: float
    kept_key0: float
    kept: dict[int, np.ndarray] = field(repr=False, default_factory=dict)  # layer -> (H_kv, C) bool

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)

    def as_json(self) -> dict:
        return {"press": self.press, "ratio": self.ratio, "perplexity": round(self.perplexity, 6),
                "accuracy": round(self.accuracy, 6), "kl": round(self.kl, 6), "kept_key0": round(self.kept_key0, 6)}


@dataclass
class Compression:
    model: str
    arch: str
    context: int
    continuation: int  # tokens scored
    dense: Row
    rows: list[Row]
    maps: dict[int, np.ndarray] = field(repr=False, default_factory=dict)  # layer -> (H_kv, m, m) pooled context map
    pool: int = 1  # context tokens per map cell a side

    def as_json(self) -> dict:
        return {"model": self.model, "arch": self.arch, "context": self.context, "continuation": self.continuation,
                "dense": {"perplexity": round(self.dense.perplexity, 6), "accuracy": round(self.dense.accuracy, 6)},
                "presses": [r.as_json() for r in self.rows]}


def check(loaded: LoadedModel, n_tokens: int, context: int, ratios, presses: list[Press]) -> None:
    """Bad input, refused before anything runs (docs/methods.md#kv-cache-compression)."""
    for r in ratios:
        if not 0.0 <= float(r) < 1.0:
            raise InputError(f"a compression ratio must be in [0, 1), got {r}")
    if not 1 <= context < n_tokens - 1:
        raise InputError(f"the context ({context} tokens) must be shorter than the text ({n_tokens} tokens) by at "
                         "least 2, so that a continuation is left to score")
    for press in presses:
        if isinstance(press, SnapKV) and context <= press.window:
            relation = "equal to" if context == press.window else "shorter than"
            raise InputError(f"the context must be longer than snapkv's window ({press.window}), as in kvpress: "
                             f"{context} tokens is {relation} snapkv's window")


def prefill(loaded: LoadedModel, ids: list[int], context: int, recipe) -> Prefill:
    """Run the context once, keeping every layer's attention (fp32) and keys: what the presses score."""
    architecture = arch_mod.resolve(recipe, loaded.n_layers)
    kept: dict[int, tuple] = {}

    def reducer(layer, probs, allow):
        kept[layer] = (probs[0].float().cpu(), allow[0, 0].cpu())

    _, run = engine.forward(loaded.model, torch.tensor([ids[:context]]), architecture.layers,
                            engine.Record(reducer=reducer, qkv=True), engine.Feed(last_logits_only=True))
    layers = [Context(layer, kept[layer][0], kept[layer][1], run.qkv[layer][1][0]) for layer in range(loaded.n_layers)]
    return Prefill(list(ids), context, layers)


def _continuation(loaded: LoadedModel, ids: list[int], context: int, architecture, kept=None) -> torch.Tensor:
    """Log-probabilities (n - context - 1, V) of the continuation's rows C .. n - 2, under ``kept``
    (layer -> (H_kv, C) bool) or the dense cache."""
    group = loaded.n_heads // loaded.n_kv_heads
    run = engine.make_run(loaded.model, torch.tensor([ids]), architecture.layers, engine.NOTHING)
    if kept is not None:
        run.head_masks = {layer: partial(kept_mask, keep.repeat_interleave(group, dim=0), context)
                          for layer, keep in kept.items()}
    with torch.inference_mode(), engine.active(run):
        logits = loaded.model(input_ids=torch.tensor([ids]).to(loaded.model.device), use_cache=False,
                              position_ids=run.positions.to(loaded.model.device)).logits
    return torch.log_softmax(logits[0, context:len(ids) - 1].float(), -1).cpu()


def kept_mask(kept: torch.Tensor, start: int, n_q: int, n_kv: int, device) -> torch.Tensor:
    """(H, n_q, n_kv): query rows at key positions >= ``start`` see, of the context keys (< ``start``),
    only those ``kept`` (H, start) marks for their head; every other cell is left to the layer's mask."""
    rows = torch.arange(n_kv - n_q, n_kv, device=device) >= start  # (n_q,): rows past the context
    context = torch.arange(n_kv, device=device) < start
    keep = torch.ones(kept.shape[0], n_kv, dtype=torch.bool, device=device)
    keep[:, :start] = kept.to(device)
    return ~((rows[:, None] & context[None, :])[None] & ~keep[:, None, :])


def _row(press: str, ratio: float, logprobs: torch.Tensor, dense: torch.Tensor | None, targets: torch.Tensor,
         kept: dict[int, torch.Tensor]) -> Row:
    nll = -logprobs.gather(-1, targets[:, None])[:, 0]
    kl = 0.0 if dense is None else float((dense.exp() * (dense - logprobs)).sum(-1).mean())
    key0 = float(np.mean([bool(k[h, 0]) for k in kept.values() for h in range(k.shape[0])])) if kept else 1.0
    return Row(press, float(ratio), float(nll.double().mean()), float((logprobs.argmax(-1) == targets).float().mean()),
               kl, key0, {layer: k.numpy() for layer, k in kept.items()})


def compress(loaded: LoadedModel, ids: list[int], context: int = 256, presses: list[str | Press] | None = None,
             ratios=RATIOS, recipe="fwd", on_step: Callable[[int, int], None] | None = None) -> Compression:
    """Every press (default: all six) at every ratio against the dense cache (see the module docstring)."""
    from attnviz.recipe import build

    architecture = build(loaded, recipe).only("KV-cache compression").architecture.require_causal("compress a KV cache")
    presses = [p if isinstance(p, Press) else parse(p) for p in (presses or DEFAULTS)]
    check(loaded, len(ids), context, ratios, presses)
    targets = torch.tensor(ids[context + 1:])
    pre = prefill(loaded, ids, context, architecture)
    dense_lp = _continuation(loaded, ids, context, architecture)
    dense = _row("dense", 0.0, dense_lp, None, targets, {})
    rows, total, done = [], len(presses) * len(ratios), 0
    for press in presses:
        for ratio in ratios:
            kept = {c.layer: press.keep(c, float(ratio)) for c in pre.layers}
            logprobs = dense_lp if float(ratio) == 0.0 else _continuation(loaded, ids, context, architecture, kept)
            rows.append(_row(press.spec, ratio, logprobs, dense_lp, targets, kept))
            done += 1
            if on_step:
                on_step(done, total)
    pool = max(1, -(-context // MAP_SIDE))
    maps = {c.layer: context_map(c, pool) for c in pre.layers}
    return Compression(loaded.model_id, architecture.spec, context, len(targets), dense, rows, maps, pool)


def context_map(context: Context, pool: int) -> np.ndarray:
    """(H_kv, m, m) the context's attention, mean over each KV group, max-pooled by ``pool`` (a sink
    column survives pooling)."""
    mean = context.per_kv_head(context.attention.flatten(1)).view(context.n_kv_heads, *context.attention.shape[1:])
    return torch.nn.functional.max_pool2d(mean[None], pool, ceil_mode=True)[0].numpy()


def decode_compressed(loaded: LoadedModel, ids: list[int], context: int, kept: dict[int, torch.Tensor],
                      recipe="fwd") -> torch.Tensor:
    """The continuation decoded with a really compressed ``DynamicCache`` (each KV head's kept context
    entries gathered out of the prefilled cache), all continuation tokens in one cached forward:
    log-probabilities of rows C .. n - 2, to check against the masked forward of :func:`compress`."""
    from transformers import DynamicCache

    architecture = arch_mod.resolve(recipe, loaded.n_layers).require_causal("compress a KV cache")
    cache = DynamicCache()
    positions = torch.arange(context)[None]
    engine.forward(loaded.model, torch.tensor([ids[:context]]), architecture.layers, engine.NOTHING,
                   engine.Feed(past_key_values=cache, kv_positions=positions))
    count = int(next(iter(kept.values())).sum(-1)[0])
    for layer, entry in enumerate(cache.layers):
        index = torch.stack([k.nonzero()[:, 0] for k in kept[layer]])  # (H_kv, count): kept positions, sorted
        index = index[None, :, :, None].to(entry.keys.device)
        entry.keys = entry.keys.gather(2, index.expand(-1, -1, -1, entry.keys.shape[-1]))
        entry.values = entry.values.gather(2, index.expand(-1, -1, -1, entry.values.shape[-1]))
    # masks follow positions; under a causal-compatible mask every kept context key precedes the
    # continuation, so any increasing stand-in positions for the cache entries give the same mask
    kv_positions = torch.cat([torch.arange(count), torch.arange(context, len(ids) - 1)])[None]
    output, _ = engine.forward(loaded.model, torch.tensor([ids[context:len(ids) - 1]]), architecture.layers,
                               engine.NOTHING, engine.Feed(past_key_values=cache, kv_positions=kv_positions))
    return torch.log_softmax(output.logits[0].float(), -1).cpu()
