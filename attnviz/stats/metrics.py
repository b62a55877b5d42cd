"""Sink metrics of docs/methods.md#sink-metrics on one layer's probabilities ``A`` of shape (H, n, n) and its allow-set.

Pure numpy, no model: everything here is a function of captured numbers, so it can be tested on
hand-written matrices and reused by figures and the CLI.
"""

from __future__ import annotations

import string
import unicodedata
from dataclasses import dataclass
from typing import Callable

import numpy as np

from attnviz.errors import InputError

SINK_EPS = 0.3


def check_eps(eps, what: str = "eps") -> float:
    """``eps``, a sink threshold on alpha, as a float between 0 and 1; anything else (NaN, inf, a string, None, a
    bool) is refused in one line, as the command line refuses it."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise InputError(f"{what} must be a number between 0 and 1, not {eps!r}")
    if not 0 <= float(eps) <= 1:  # NaN fails both comparisons
        raise InputError(f"{what} must be between 0 and 1, got {eps}")
    return float(eps)
ALLOCATION_PARTS = ("first", "delimiter", "diagonal", "other", "discarded")


def f32(probs) -> np.ndarray:
    """``probs`` as a float32 array (the dtype every statistic here is computed in)."""
    return np.asarray(probs, dtype=np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    """The softmax over the last axis, shifted by each row's maximum (a row of -inf only gives NaN)."""
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def head_cells(allowed, head: int | None = None) -> np.ndarray:
    """The (n_q, n_kv) cells of ``head`` from a layer's allow-set: the set itself when it is one for all heads
    (n_q, n_kv); the head's own from a per-head set (H, n_q, n_kv); ``head=None``: the cells some head sees."""
    allowed = np.asarray(allowed, dtype=bool)
    if allowed.ndim == 2:
        return allowed
    return allowed.any(0) if head is None else allowed[head]


def alpha(probs, allowed) -> np.ndarray:
    """alpha_k for every key k: mean of A[i, k] over ALL queries i allowed to see k, i = k included.

    Returns (H, n). Under FWD this is Gu et al.'s ``sum_{i>=k} A[i, k] / (n - k)`` exactly (their
    ``eval_sink_open_source.py``); other masks change only the divisor. NaN where no query other
    than k itself sees k (docs/methods.md#sink-metrics): a key that only its own query sees says nothing about sinks.
    """
    probs, allowed = f32(probs), np.asarray(allowed, dtype=bool)  # allowed (n, n), or (H, n, n) per head
    counts = allowed.sum(-2)
    others = counts - np.diagonal(allowed, axis1=-2, axis2=-1)
    sums = np.einsum("hij,ij->hj" if allowed.ndim == 2 else "hij,hij->hj", probs, allowed.astype(np.float32))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(others > 0, sums / np.maximum(counts, 1), np.nan)


def sink_rate(alphas, eps: float = SINK_EPS) -> float:
    """Fraction of heads with alpha > eps, over the heads where alpha is defined; NaN if none is."""
    alphas = np.asarray(alphas, dtype=np.float64)
    defined = np.isfinite(alphas)
    return float(np.mean(alphas[defined] > eps)) if defined.any() else float("nan")


AUTO_KEY_MOST = 64  # the auto key is looked for among the first 64 keys (docs/methods.md#auto-key)


def auto_key_limit(n: int) -> int:
    """How many of a text's first keys the auto key is looked for among: the first :data:`AUTO_KEY_MOST`, and the
    first half of the text (a key near the end is seen by every later query only because few queries follow it,
    as under a sliding window shorter than the text: no sink)."""
    return max(1, min(AUTO_KEY_MOST, (n + 1) // 2))


def auto_key(allowed) -> int:
    """The sink key a mask leaves open (docs/methods.md#auto-key): the first key position j, among the first
    :func:`auto_key_limit` keys, that every later query may see (allowed[i, j] for all i > j); 0 where no key
    is (BACK, sliding windows shorter than the text). 0 under FWD and BIDIR, m under NoSink-FWD(m) and
    NoSink-BIDIR(m). ``allowed`` is (n, n) or its first columns (n, m): the engine's patch asks with a layer's
    first columns only (:func:`attnviz.core.engine.auto_key`), so both read one definition. A per-head allow-set
    (H, n, n) is read where every head leaves the key open."""
    allowed = np.asarray(allowed, dtype=bool)
    if allowed.ndim == 3:
        allowed = allowed.all(0)
    n_q = allowed.shape[0]
    columns = min(allowed.shape[1], auto_key_limit(n_q))
    allowed = allowed[:, :columns]
    later = np.tri(n_q, columns, -1, dtype=bool)  # (i, j) with i > j
    open_to_later = (allowed | ~later).all(0) & later.any(0)
    hits = np.flatnonzero(open_to_later)
    return int(hits[0]) if hits.size else 0


def key_profile(probs, allowed, key: int = 0) -> np.ndarray:
    """A[i, key] as a function of query position i, per head; NaN where the mask forbids it. (H, n)."""
    probs = f32(probs)
    seen = np.asarray(allowed, dtype=bool)[..., :, key]  # (n,), or (H, n) where each head has its own mask
    return np.where(seen if seen.ndim == 2 else seen[None, :], probs[:, :, key], np.nan)


def column_mean(probs) -> np.ndarray:
    """(1/n) sum_i A[i, j], masked entries counting as 0. (H, n)."""
    return f32(probs).mean(1)


def sink_key(probs) -> np.ndarray:
    """The key with the largest column mean, per head: where each head parks its attention. (H,)."""
    return column_mean(probs).argmax(-1)


def shift_rate(sink_keys_before, sink_keys_after, m: int = 1) -> float:
    """Fraction of heads whose sink key is 0 under one architecture and m under the other."""
    before, after = np.asarray(sink_keys_before), np.asarray(sink_keys_after)
    return float(np.mean((before == 0) & (after == m))) if before.size else float("nan")


def entropy(probs, allowed, normalised: bool = False) -> np.ndarray:
    """Row entropy H_i = -sum_j A log A, optionally divided by log(#allowed keys). (H, n).

    A row with a single allowed key has normalised entropy 0 by convention.
    """
    probs = f32(probs)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(probs > 0, probs * np.log(probs), 0.0).sum(-1)
    if not normalised:
        return h
    n_allowed = np.asarray(allowed, dtype=bool).sum(-1)
    norm = np.log(np.maximum(n_allowed, 1))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(norm > 0, h / np.where(norm > 0, norm, 1), 0.0)


def discarded_mass(probs) -> np.ndarray:
    """1 - row sum: the mass StableMask's pseudo-slots or a learned sink took. (H, n)."""
    return np.clip(1.0 - f32(probs).sum(-1), 0.0, None)


def learned_sink(share) -> np.ndarray:
    """Alpha of a model's learned sink per head (docs/methods.md#the-learned-sink-as-a-key): the mean over the
    queries of the share it takes of each row, exp(s_h) / (exp(s_h) + Σ_k exp(z_qk)), as the capture keeps it
    from the logits (``share`` (H, n_q)). Every query sees it, so it is the alpha of a key every query sees. (H,).

    Not one of :data:`STATISTICS`: those are defined on the probabilities, and the learned sink's column is
    dropped before them (1 − the row sum would also count StableMask's slots and ``sinklogit``)."""
    return f32(share).mean(-1)


def is_delimiter(token: str) -> bool:
    """A token made only of punctuation and white space (newlines included)."""
    return bool(token) and all(
        ch.isspace() or ch in string.punctuation or unicodedata.category(ch).startswith("P") for ch in token
    )


def delimiter_flags(tokens: list[str]) -> np.ndarray:
    """(n,) float32: 1 for delimiter tokens (:func:`is_delimiter`), 0 for the first token and the rest.

    Once per text, and each distinct token string is checked once (a text repeats its tokens), not
    once per token and layer."""
    lookup = {t: is_delimiter(t) for t in set(tokens)}
    flags = np.fromiter((lookup[t] for t in tokens), dtype=np.float32, count=len(tokens))
    if len(flags):
        flags[0] = 0.0  # the first token counts as first
    return flags


def allocation(probs, tokens: list[str]) -> np.ndarray:
    """Per head and query, the shares of ``ALLOCATION_PARTS`` (StableMask Fig. 1b). (H, n, 5).

    Each key is counted once, in this order of precedence: the first token, then the query's own
    key (diagonal), then delimiters, then the rest; with the discarded mass the five sum to 1.
    Computed with one matrix-vector product per head instead of n x n masks (pages call it on
    every layer at N = 1024).
    """
    probs = f32(probs)
    n = probs.shape[-1]
    delim = delimiter_flags(tokens)
    rowsum = probs.sum(-1)
    first = probs[..., 0]
    diagonal = np.diagonal(probs, axis1=-2, axis2=-1).copy()
    diagonal[..., 0] = 0.0  # query 0's own key is the first token
    delimiter = probs @ delim - diagonal * delim[None, :n]
    other = rowsum - first - diagonal - delimiter
    return np.stack([first, delimiter, diagonal, other, np.clip(1.0 - rowsum, 0.0, None)], axis=-1)


def value_weighted(probs, norms) -> np.ndarray:
    """||A[i, j] f(v_j)|| = A[i, j] * ||W_O^h v_j^h||: (H, n, n) from probabilities and (H, n) value norms."""
    return f32(probs) * np.asarray(norms, dtype=np.float32)[:, None, :]


def key_share(matrix, allowed, key: int = 0) -> np.ndarray:
    """Per head, key's share of each row (row-normalised), averaged over the queries that may see it.

    On attention this is the key's share of attention; on :func:`value_weighted` maps, its share
    of the output norm: a sink takes much of the first and little of the second. (H,), NaN where no
    query sees the key.
    """
    matrix = f32(matrix)
    seen = np.asarray(allowed, dtype=bool)[:, key]
    if not seen.any():
        return np.full(matrix.shape[0], np.nan)
    rows = matrix[:, seen]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.nanmean(rows[:, :, key] / rows.sum(-1), axis=1)


def rollout(maps) -> np.ndarray:
    """Attention rollout (Abnar & Zuidema 2020) over layers, bottom first: each (n, n) head-mean map
    gets the residual identity, 0.5 A + 0.5 I, rows renormalised (rows of StableMask or learned-sink
    maps sum below 1), and the layers are multiplied: R = Ã_L ... Ã_1. R[i, j] is how much of
    position i's top representation traces back to input token j, under the assumption that
    attention and the residual mix linearly; under a non-causal mask, R mixes in later tokens too.
    """
    result = None
    for a in maps:
        a = f32(a)
        mixed = 0.5 * a + 0.5 * np.eye(a.shape[0], dtype=np.float32)
        mixed /= mixed.sum(-1, keepdims=True)
        result = mixed if result is None else mixed @ result
    return result


#: What a statistic is finished from (:class:`Statistic`): sums over one layer's probabilities A (float32, on
#: the layer's device), accumulated block by block by the block engine (attnviz.core.record.reduce) or in one pass
#: by the fused kernel (attnviz.core.kernel.kernels.SUMS says which it provides), and facts of the layer's mask.
SUMS = {
    "rowsum": "Σ_j A[i, j], per head and query",
    "plogp": "Σ_j A[i, j] log A[i, j], per head and query",
    "diag": "A[i, i], per head and query",
    "key0": "A[i, 0], per head and query (0 where the mask forbids it)",
    "delim": "Σ_j A[i, j] · delimiter_j, per head and query",
    "colsum": "Σ_i A[i, j], per head and key",
    "colsum_allowed": "Σ_i allowed[i, j] · A[i, j], per head and key",
}
MASK_FACTS = {
    "col_counts": "how many queries may see key j",
    "row_counts": "how many keys query i may see",
    "self_seen": "1 where query j may see key j, per key",
    "key0_allowed": "whether query i may see key 0",
    "delim_q": "the delimiter flag of query i's own key",
    "query_index": "i, per query",
    "n_q": "the number of queries",
}


@dataclass(frozen=True)
class RowSum:
    """A per-query sum a statistic needs that is not in :data:`SUMS`: ``of(probs, allow)`` reduces a block of
    probabilities (H, b, w) with its allow-set (b, w) over its keys to (H, b). Every row's keys fall in one
    block, so the block engine computes it; the fused kernel does not, so a capture that keeps such a
    statistic takes the block engine (and its plan says so)."""

    name: str
    of: Callable


@dataclass(frozen=True)
class Statistic:
    """One per-layer statistic a capture keeps (docs/methods.md#sink-metrics), declared once, here:

    - ``reference(probs, allowed, tokens)`` is its numpy definition (tests and ``attnviz doctor`` compare
      every route to it);
    - ``sums`` are what it is finished from: names of :data:`SUMS` and :data:`MASK_FACTS`, or a
      :class:`RowSum` of its own;
    - ``finish(sums, xp)`` makes it from those (``xp`` is torch on the layer's device);
    - ``floats`` per head and token is what :func:`attnviz.capture.estimate_bytes` counts.

    Adding a statistic is one declaration here and its test: the block engine accumulates whatever sums it
    names; the fused route runs only when its kernel provides them all (``attnviz.core.kernel.kernels.SUMS``), else the
    layer takes the block engine: never a statistic left at zero.
    """

    name: str
    floats: int
    reference: Callable
    sums: tuple = ()
    finish: Callable = None


def _allocation(s, xp):
    diagonal = xp.where(s["query_index"] > 0, s["diag"], 0.0)  # query 0's own key is the first token: "first"
    delimiter = s["delim"] - diagonal * s["delim_q"]
    other = s["rowsum"] - s["key0"] - diagonal - delimiter
    return xp.stack([s["key0"], delimiter, diagonal, other, xp.clip(1.0 - s["rowsum"], 0.0, None)], axis=-1)


def _entropy(s, xp):
    norm = xp.log(xp.clip(s["row_counts"], 1, None))
    return xp.where(norm > 0, -s["plogp"] / xp.where(norm > 0, norm, 1.0), 0.0)


#: Every statistic of a reduced capture.
STATISTICS = (
    Statistic("allocation", len(ALLOCATION_PARTS), lambda p, a, t: allocation(p, t),
              ("rowsum", "key0", "diag", "delim", "delim_q", "query_index"), _allocation),
    Statistic("alpha", 1, lambda p, a, t: alpha(p, a), ("colsum_allowed", "col_counts", "self_seen"),
              lambda s, xp: xp.where(s["col_counts"] - s["self_seen"] > 0,
                                     s["colsum_allowed"] / xp.clip(s["col_counts"], 1, None), float("nan"))),
    Statistic("column_mean", 1, lambda p, a, t: column_mean(p), ("colsum", "n_q"), lambda s, xp: s["colsum"] / s["n_q"]),
    Statistic("key0", 1, lambda p, a, t: key_profile(p, a, 0), ("key0", "key0_allowed"),
              lambda s, xp: xp.where(s["key0_allowed"], s["key0"], float("nan"))),
    Statistic("discarded", 1, lambda p, a, t: discarded_mass(p), ("rowsum",),
              lambda s, xp: xp.clip(1.0 - s["rowsum"], 0.0, None)),
    Statistic("entropy", 1, lambda p, a, t: entropy(p, a, normalised=True), ("plogp", "row_counts"), _entropy),
)


def needed_sums(statistics) -> set:
    """The sums (names of :data:`SUMS`, and every :class:`RowSum`) that ``statistics`` are finished from."""
    return {x for s in statistics for x in s.sums if isinstance(x, RowSum) or x in SUMS}


CHOSEN = {"entropy", "allocation"}  # statistics that cost a pass over every block: kept only when named


def unknown_statistics(names) -> list[str]:
    """The names in ``names`` that are no statistic of :data:`STATISTICS`, in their order."""
    known = {s.name for s in STATISTICS}
    return [name for name in names if name not in known]


def kept_statistics(names=None) -> tuple[Statistic, ...]:
    """What a capture that names ``names`` keeps (None: every statistic): those, and the cheap ones always (they come
    from sums the engine makes anyway); entropy and allocation only when named."""
    wanted = {s.name for s in STATISTICS} if names is None else set(names)
    return tuple(s for s in STATISTICS if s.name in wanted or s.name not in CHOSEN)


def statistic_floats(names=None) -> int:
    """Floats per head and token that a layer's kept statistics take (the memory estimate's share)."""
    return sum(s.floats for s in kept_statistics(names))


# --- sinks at any key (docs/methods.md#sinks-at-any-key) -----------------------------------------------------

def sink_candidates(n: int) -> int:
    """How many of a text's first keys may be sinks: the first half of the text, the auto key's rule without its cap
    of :data:`AUTO_KEY_MOST` (a key near the end is seen by few queries, so its alpha says little)."""
    return max(1, (n + 1) // 2)


LEARNED_KEY = -1  # the key of a model's learned sink in a layer's sinks: a slot of its own, before key 0
LEARNED_TOKEN = "<learned sink>"  # ... and its token: it is no token of the text


def key_category(position: int, token: str) -> str:
    """What a sink key is: "first" (the first token), "delimiter" (:func:`is_delimiter`) or "other"; a model's learned
    sink (:data:`LEARNED_KEY`) is "learned"."""
    if position == LEARNED_KEY:
        return "learned"
    return "first" if position == 0 else "delimiter" if is_delimiter(token) else "other"


def sinks(alphas, tokens: list[str], eps: float = SINK_EPS, residual_norms=None, value_norms=None,
          learned=None) -> list[dict]:
    """Every key of one layer that acts as a sink: key k is a sink of head h when alpha_k (the attention on k averaged
    over every query that may see it, :func:`alpha`) is above ``eps``, among the first :func:`sink_candidates` keys.

    ``alphas`` (H, n); ``residual_norms`` (n,) the residual stream's norm entering the layer (massive activations),
    ``value_norms`` (H, n) ||W_O^h v_j^h||, each optional. Each sink: its position, token, category, the heads it is a
    sink of, its share (the mean alpha over those heads), the residual norm at it and its value norm (the mean over
    those heads); strongest first (the largest alpha summed over its heads). ``learned`` (H,): alpha of the model's
    learned sink (:func:`learned_sink`), a sink of the heads where it is above ``eps`` too, listed as key
    :data:`LEARNED_KEY` of category "learned", token :data:`LEARNED_TOKEN`, no residual norm (it is no token) and value
    norm 0 where value norms are given (it has no value: what it takes is dropped)."""
    alphas = np.asarray(alphas, dtype=np.float64)
    n = alphas.shape[-1]
    found = []
    with np.errstate(invalid="ignore"):
        above = np.nan_to_num(alphas[:, :sink_candidates(n)], nan=-1.0) > eps  # (H, candidates)
    for key in np.flatnonzero(above.any(0)):
        heads = np.flatnonzero(above[:, key])
        found.append({"key": int(key), "token": tokens[key], "category": key_category(int(key), tokens[key]),
                      "heads": heads.tolist(), "share": round(float(alphas[heads, key].mean()), 6),
                      "residual_norm": None if residual_norms is None else round(float(residual_norms[key]), 4),
                      "value_norm": None if value_norms is None else round(float(np.mean(value_norms[heads, key])), 6),
                      "_weight": float(alphas[heads, key].sum())})
    if learned is not None:
        learned = np.asarray(learned, dtype=np.float64)
        heads = np.flatnonzero(np.nan_to_num(learned, nan=-1.0) > eps)
        if heads.size:
            found.append({"key": LEARNED_KEY, "token": LEARNED_TOKEN, "category": "learned", "heads": heads.tolist(),
                          "share": round(float(learned[heads].mean()), 6), "residual_norm": None,
                          "value_norm": None if value_norms is None else 0.0, "_weight": float(learned[heads].sum())})
    found.sort(key=lambda s: -s.pop("_weight"))  # strongest first: the most attention over its heads together
    return found
