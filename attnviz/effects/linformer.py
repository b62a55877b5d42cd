"""Linformer what-if (docs/methods.md#linformer-what-if; seed 004): project the sequence axis of K and V to k slots.

K' = E K and V' = F V with E, F in R^{k x n}; P = softmax(Q K'^T / sqrt(d)) is n x k and the output
is P V'. The projections are training-free: segment means (slot s averages positions
s*n/k .. (s+1)*n/k - 1; at k = n that is the identity) or a seeded Gaussian / sqrt(k). A projection
mixes future keys into every slot, so Linformer has no causal form: it approximates full softmax
attention, and we report its relative error against both that and the layer's real (masked) output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnviz.errors import InputError
from attnviz.stats.metrics import softmax

PROJECTIONS = ("segment", "gaussian")


def projection(n: int, k: int, method: str = "segment", seed: int = 0) -> np.ndarray:
    """(k, n) training-free projection of the sequence axis, by ``method`` (one of :data:`PROJECTIONS`)."""
    if method not in PROJECTIONS:
        raise InputError(f"unknown projection '{method}': use 'segment' or 'gaussian'")
    if not 0 < k <= n:
        raise InputError(f"k must be between 1 and n = {n}, got {k}")
    if method == "gaussian":
        return np.random.default_rng(seed).normal(size=(k, n)) / np.sqrt(k)
    edges = np.floor(np.arange(k + 1) * n / k).astype(int)
    out = np.zeros((k, n))
    for s in range(k):
        out[s, edges[s]:edges[s + 1]] = 1.0 / (edges[s + 1] - edges[s])
    return out


def check_k(k: int, n: int) -> int:
    """The what-if's own k: strictly between 0 and n (k = n would compress nothing)."""
    if not 0 < k < n:
        raise InputError(f"Linformer k must be between 1 and n - 1 = {n - 1} (n = {n} tokens), got {k}")
    return k


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, e: np.ndarray, f: np.ndarray,
           scaling: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(P, output) for (H, n, d) queries and keys/values already repeated per head: (H, n, k), (H, n, d)."""
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    probs = softmax(q @ np.swapaxes(e @ k, -1, -2) * scaling)
    return probs, probs @ (f @ v)


def exact(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray | None = None,
          scaling: float | None = None) -> np.ndarray:
    """Softmax attention output, full (``allowed`` None) or under an (n, n) allow-set.

    One head at a time: the n × n scores of all heads at once would be ~5 GB per copy at 8,192 tokens."""
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    out = np.empty(q.shape[:-1] + (v.shape[-1],), dtype=np.result_type(q, v))
    for h in range(q.shape[0]):
        scores = q[h] @ k[h].T * scaling
        if allowed is not None:
            scores = np.where(allowed, scores, -np.inf)
        out[h] = softmax(scores) @ v[h]
    return out


def relative_error(approx: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(approx - reference) / max(np.linalg.norm(reference), 1e-30))


@dataclass
class WhatIf:
    layer: int
    k: int
    projection: str  # its method, one of PROJECTIONS
    probs: np.ndarray  # (H, n, k)
    error_full: float  # against full softmax attention on the same q, k, v
    error_masked: float  # against the layer's real output under its mask


def _per_head(qkv):
    q, keys, values = qkv.q.astype(np.float64), qkv.k.astype(np.float64), qkv.v.astype(np.float64)
    group = q.shape[0] // keys.shape[0]
    return q, np.repeat(keys, group, axis=0), np.repeat(values, group, axis=0)


KS = (2, 4, 8, 16)  # the k values of `attnviz linformer` by default


def whatif(qkv, allowed: np.ndarray, k: int, method: str = "segment", seed: int = 0, layer: int = -1,
           references: tuple[np.ndarray, np.ndarray] | None = None) -> WhatIf:
    """Linformer on one captured layer's (q, k, v); ``qkv`` has q (H, n, d), k and v (H_kv, n, d).
    ``references``: the exact (full, masked) outputs, when a curve over several k computed them once."""
    q, keys, values = _per_head(qkv)
    n = q.shape[1]
    e, f = projection(n, k, method, seed), projection(n, k, method, seed + 1)
    probs, out = attend(q, keys, values, e, f, qkv.scaling)
    full, masked = references or (exact(q, keys, values, None, qkv.scaling),
                                  exact(q, keys, values, allowed, qkv.scaling))
    return WhatIf(layer, k, method, probs, relative_error(out, full), relative_error(out, masked))


def error_curve(qkv, allowed: np.ndarray, ks, method: str = "segment", seed: int = 0) -> list[WhatIf]:
    q, keys, values = _per_head(qkv)
    references = exact(q, keys, values, None, qkv.scaling), exact(q, keys, values, allowed, qkv.scaling)
    return [whatif(qkv, allowed, k, method, seed, references=references) for k in ks]


@dataclass
class Curve:
    """The what-if on one layer of a text at several k (:func:`prepare`): one :class:`WhatIf` per k."""

    model: str
    arch: str
    layer: int
    projection: str
    tokens: list[str]
    rows: list[WhatIf]

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def as_json(self) -> dict:
        """What `attnviz linformer` prints (docs/cli.md)."""
        return {"model": self.model, "arch": self.arch, "layer": self.layer, "n_tokens": self.n_tokens,
                "projection": self.projection,
                "rows": [{"k": r.k, "error_full": round(r.error_full, 6), "error_masked": round(r.error_masked, 6)}
                         for r in self.rows]}


@dataclass(frozen=True)
class PreparedWhatIf:
    """The what-if made ready (:func:`prepare`): the capture that keeps the layer's q, k and v, the checked k."""

    capture: object  # attnviz.capture.Prepared
    layer: int
    ks: tuple[int, ...]
    projection: str  # its method, one of PROJECTIONS
    seed: int

    def run(self) -> Curve:
        """Capture the layer's q, k and v (no n × n map) and measure each k against the same references."""
        cap = self.capture.run()
        rows = error_curve(cap.layer_qkv(self.layer), cap.allowed[self.layer], self.ks, self.projection, self.seed)
        return Curve(cap.meta["model"], cap.arch, self.layer, self.projection, list(cap.tokens), rows)


def prepare(loaded, text: str, recipe="fwd", layer: int | str = -1, ks=KS, method: str = "segment",
            seed: int = 0) -> PreparedWhatIf:
    """Everything the what-if on one layer of ``text`` decides before it runs, every refusal raised here: the layer
    (negative counts from the top), the capture under ``recipe`` (an architecture string or a recipe), each k checked
    against the text's tokens, the projection. ``attnviz linformer`` and the Effects page both run
    ``prepare(...).run()``."""
    from attnviz import recipe as recipe_mod
    from attnviz.capture import parse_layers
    from attnviz.capture import prepare as prepare_capture
    from attnviz.plan import Keep

    if method not in PROJECTIONS:
        raise InputError(f"unknown projection '{method}': use 'segment' or 'gaussian'")
    recipe_mod.build(loaded, recipe).softmax_only("the Linformer what-if")
    layers = parse_layers(str(layer), loaded.n_layers)
    if len(layers) != 1:
        raise InputError(f"the Linformer what-if reads one layer, got '{layer}'")
    captured = prepare_capture(loaded, text, recipe, Keep(layers=layers, qkv=True, statistics=True))
    checked = tuple(check_k(int(k), captured.n_tokens) for k in ks)
    if not checked:
        raise InputError("give at least one k")
    return PreparedWhatIf(captured, layers[0], checked, method, seed)
