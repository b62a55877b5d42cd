"""Sinks across a dataset, not one text: Gu et al.'s protocol (ICLR 2025; docs/methods.md#sink-metrics).

Each sample is the first ``max_len`` tokens (default 64) of a document (``doc``) or of a non-empty
line (``line``) of the corpus, the first ``samples`` of them in corpus order (reproducible; no
random draw). alpha_k per sample, layer and head; the sink rate of a layer in a sample is the share
of its heads with alpha > eps (over heads where alpha is defined); rates are then averaged over
samples, with a 95% interval from the normal approximation (mean ± 1.96 · sd / √S).

A sample shorter than ``max_len`` is used as it is and counted in ``short_samples`` (the JSON and
the page say so); one of fewer than 2 tokens has no alpha and is skipped. Samples run in batches
of equal length, so no padding enters any map. Full maps are never kept per sample: a reducer
keeps alpha and, over the full-length samples, the running sum and sum of squares of every map,
for the averaged maps and their variance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from attnviz.core.spec import arch as arch_mod
from attnviz.core import engine
from attnviz.core.loading.models import LoadedModel
from attnviz.core.record import recorders
from attnviz.corpus import head_ids
from attnviz.errors import InputError
from attnviz.stats import metrics
from attnviz.stats.metrics import SINK_EPS

UNITS = ("doc", "line")
BATCH = 16
GU_PRESET = {"max_len": 64, "eps": 0.3}


def samples(loaded: LoadedModel, documents: Sequence[str], unit: str = "doc", max_len: int = 64,
            n_samples: int | None = None) -> tuple[list[list[int]], int]:
    """(token ids of each sample, number skipped for having fewer than 2 tokens)."""
    if unit not in UNITS:
        raise InputError(f"unknown sample unit '{unit}': use 'doc' or 'line'")
    if max_len < 2:
        raise InputError(f"max-len must be at least 2 tokens, got {max_len}")
    if n_samples is not None and n_samples <= 0:
        raise InputError(f"the number of samples must be positive, got {n_samples}")
    texts = documents if unit == "doc" else [line.strip() for d in documents for line in d.splitlines() if line.strip()]
    out, skipped = [], 0
    for text in texts:
        ids = head_ids(loaded.tokenizer, text, max_len)
        if len(ids) < 2:
            skipped += 1
            continue
        out.append(ids)
        if n_samples and len(out) >= n_samples:
            break
    if not out:
        raise InputError("the corpus gave no sample of at least 2 tokens: it is empty or too short")
    return out, skipped


@dataclass
class DatasetSinks:
    model: str
    arch: str
    layer_masks: list[str]
    unit: str
    max_len: int
    lengths: np.ndarray  # (S,) tokens per sample
    alpha: np.ndarray = field(repr=False)  # (S, L, H, max_len), NaN where undefined or past the sample
    map_sum: np.ndarray = field(repr=False)  # (L, H, T, T) over the full-length samples
    map_sq: np.ndarray = field(repr=False)
    allowed: np.ndarray = field(repr=False)  # (L, T, T) allow-set of a full-length sample
    skipped: int = 0
    # (S, L, H) the learned sink's alpha (its share of each row, the mean over the rows) where the model gives its
    # heads a learned sink logit (docs/methods.md#the-learned-sink-as-a-key); NaN in the layers without one
    learned: np.ndarray | None = field(default=None, repr=False)

    def learned_rates(self, eps: float = SINK_EPS) -> np.ndarray | None:
        """(S, L) the share of heads whose learned sink takes alpha > eps, per sample and layer (NaN where the layer
        has none); None for a model without a learned sink."""
        if self.learned is None:
            return None
        defined = np.isfinite(self.learned)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(defined.any(-1), (np.nan_to_num(self.learned, nan=-np.inf) > eps).sum(-1)
                            / defined.sum(-1), np.nan)

    @property
    def n_samples(self) -> int:
        return len(self.lengths)

    @property
    def n_full(self) -> int:
        return int((self.lengths == self.max_len).sum())

    @property
    def short_samples(self) -> int:
        return self.n_samples - self.n_full

    def mean_maps(self) -> np.ndarray:
        """(L, H, T, T) attention averaged over the full-length samples."""
        return self.map_sum / max(self.n_full, 1)

    def var_maps(self) -> np.ndarray:
        mean = self.mean_maps()
        return np.clip(self.map_sq / max(self.n_full, 1) - mean**2, 0, None)

    def keys(self, key: int | str = "auto") -> np.ndarray:
        """(L,) the key each layer's rate is read at: ``key`` itself, or with ``"auto"`` the first key
        each layer's mask leaves open to its queries (:func:`metrics.auto_key`: m under NoSink-m)."""
        if key == "auto":
            return np.array([metrics.auto_key(a) for a in self.allowed], dtype=np.int64)
        try:
            position = int(key)
        except (TypeError, ValueError):
            raise InputError(f"the key must be a token position or 'auto', got {key!r}") from None
        if not 0 <= position < self.max_len:
            raise InputError(f"key {position} is outside the samples' {self.max_len} tokens")
        return np.full(self.alpha.shape[1], position, dtype=np.int64)

    def _alpha_at(self, key) -> np.ndarray:
        """(S, L, H) alpha at each layer's key."""
        keys = self.keys(key)
        return np.take_along_axis(self.alpha, keys[None, :, None, None], axis=-1)[..., 0]

    def rates(self, key: int | str = 0, eps: float = SINK_EPS) -> np.ndarray:
        """(S, L) sink rate per sample and layer; NaN where alpha_key is defined for no head."""
        a = self._alpha_at(key)
        defined = np.isfinite(a)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(defined.any(-1), (np.nan_to_num(a, nan=-np.inf) > eps).sum(-1) / defined.sum(-1), np.nan)

    def model_rates(self, key: int | str = 0, eps: float = SINK_EPS) -> np.ndarray:
        """(S,) share of all (layer, head) pairs with alpha > eps, per sample."""
        a = self._alpha_at(key).reshape(self.n_samples, -1)
        defined = np.isfinite(a)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(defined.any(-1), (np.nan_to_num(a, nan=-np.inf) > eps).sum(-1) / defined.sum(-1), np.nan)

    def alpha_by_key(self) -> np.ndarray:
        """(L, T) alpha_k averaged over samples and heads, by key position."""
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanmean(self.alpha, axis=(0, 2))

    def as_json(self, key: int | str = "auto", eps: float = SINK_EPS) -> dict:
        """``key``: a token position, or ``"auto"`` (each layer's :meth:`keys`); each layer says its key."""
        per_layer, learned = self.rates(key, eps), self.learned_rates(eps)
        keys = self.keys(key)
        doc = {"model": self.model, "arch": self.arch, "unit": self.unit, "max_len": self.max_len, "eps": eps,
               "key": key if key == "auto" else int(key), "samples": self.n_samples,
               "short_samples": self.short_samples, "skipped": self.skipped,
               "layers": [{"layer": l, "mask": self.layer_masks[l], "key": int(keys[l]),
                           "sink_rate": interval(per_layer[:, l]),
                           **({} if learned is None or not np.isfinite(learned[:, l]).any()
                              else {"learned_sink_rate": interval(learned[:, l])})}
                          for l in range(per_layer.shape[1])],
               "model_rate": interval(self.model_rates(key, eps))}
        if self.short_samples:
            doc["note"] = (f"{self.short_samples} of {self.n_samples} samples are shorter than {self.max_len} tokens "
                           "and were used as they are")
        return doc


def interval(values: np.ndarray) -> dict:
    """Mean and 95% interval (normal approximation) over samples, NaN samples left out; None if none."""
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    if not values.size:
        return {"mean": None, "ci95": None, "n": 0}
    mean = float(values.mean())
    half = 1.96 * float(values.std(ddof=1)) / math.sqrt(values.size) if values.size > 1 else 0.0
    return {"mean": round(mean, 6), "ci95": [round(mean - half, 6), round(mean + half, 6)], "n": int(values.size)}


def _alpha(probs: torch.Tensor, allow: torch.Tensor) -> torch.Tensor:
    """docs/methods.md#sink-metrics alpha for a batch: (B, H, n), as :func:`metrics.alpha` (i = k included)."""
    allow = allow.float()  # (B, 1, n, n)
    counts = allow.sum(-2)
    others = counts - torch.diagonal(allow, dim1=-2, dim2=-1)
    sums = (probs * allow).sum(-2)
    return torch.where(others > 0, sums / counts.clamp(min=1), torch.full_like(sums, float("nan")))


def _matrix(mask, n: int) -> np.ndarray:
    try:
        return mask.matrix(n)
    except Exception:  # a custom matrix written for fewer tokens: the samples' own allow-sets decide
        return np.ones((n, n), dtype=bool)


def sinks(loaded: LoadedModel, documents: Sequence[str], recipe: "str | arch_mod.Architecture | Recipe" = "fwd",
          unit: str = "doc", max_len: int = 64, n_samples: int | None = 100,
          on_progress: Callable[[int, int], None] | None = None) -> DatasetSinks:
    """Run every sample under ``recipe`` (an architecture string, or a recipe with its interventions,
    docs/methods.md#interventions) in equal-length batches and keep alpha and map moments."""
    from attnviz.recipe import build

    built = build(loaded, recipe).only("a dataset's sink statistics", "intervene", "kind")  # a string or a Recipe
    architecture, acts = built.architecture, built.interventions
    ids, skipped = samples(loaded, documents, unit, max_len, n_samples)
    L, H = loaded.n_layers, loaded.n_heads
    alpha = np.full((len(ids), L, H, max_len), np.nan, dtype=np.float32)
    map_sum = np.zeros((L, H, max_len, max_len), dtype=np.float64)
    map_sq = np.zeros_like(map_sum)
    # each layer's allow-set at the full length (the auto key reads it even when every sample is shorter);
    # a full-length sample's own allow-set replaces it below
    allowed = np.stack([_matrix(mask, max_len) for mask in architecture.layers])
    learned = None
    order = sorted(range(len(ids)), key=lambda i: (-len(ids[i]), i))
    batches = []
    for i in order:
        if batches and len(batches[-1]) < BATCH and len(ids[batches[-1][0]]) == len(ids[i]):
            batches[-1].append(i)
        else:
            batches.append([i])
    done = 0
    for batch in batches:
        n = len(ids[batch[0]])
        full = n == max_len

        def reducer(layer, probs, allow, full=full):
            if full:
                allowed[layer] = allow[0, 0].cpu().numpy()
                p = probs.double()
                map_sum[layer] += p.sum(0).cpu().numpy()
                map_sq[layer] += (p * p).sum(0).cpu().numpy()
            return _alpha(probs, allow).cpu().numpy()

        sink = recorders.LearnedSink()
        _, run = engine.forward(loaded.model, torch.tensor([ids[i] for i in batch]),
                                engine.Computes(tuple(architecture.layers), acts, built.kind),
                                engine.Record(recorders=(recorders.Whole(reducer), sink)))
        for layer, values in run.reduced.items():
            alpha[batch, layer, :, :n] = values
        for layer, share in sink.result().items():  # (B, H, n) each row's share, from the model's own logits
            if learned is None:
                learned = np.full((len(ids), L, H), np.nan, dtype=np.float32)
            learned[batch, layer] = share.mean(-1)
        done += len(batch)
        if on_progress:
            on_progress(done, len(ids))
    return DatasetSinks(loaded.model_id, architecture.spec, architecture.layer_names, unit, max_len,
                        np.array([len(x) for x in ids]), alpha, map_sum.astype(np.float32),
                        map_sq.astype(np.float32), allowed, skipped, learned)
