"""The attention computation of seeds 001 and 004, step by step, on a small editable example."""

from __future__ import annotations

import numpy as np

from attnviz.core.spec import masks as M
from attnviz.errors import InputError
from attnviz.stats.metrics import softmax

#: The lecture's practice matrices (seed 004).
Q = [[1, 2], [3, 4], [5, 6]]
K = [[6, 5], [4, 3], [2, 1]]
V = [[2, 4], [6, 8], [10, 12]]

MASKS = {
    "FWD": lambda: M.fwd(), "BACK": lambda: M.back(), "BIDIR": lambda: M.bidir(),
    "NoSink-FWD": lambda: M.nosink(M.fwd()), "StableMask (gamma=0.5)": lambda: M.stablemask(0.5),
}


def parse_matrix(text: str, name: str) -> np.ndarray:
    """Rows separated by newlines or ';', numbers by commas or spaces."""
    rows = [r for r in text.replace(";", "\n").splitlines() if r.strip()]
    try:
        values = [[float(x) for x in r.replace(",", " ").split()] for r in rows]
    except ValueError:
        raise InputError(f"{name}: every entry must be a number") from None
    if not values or len({len(r) for r in values}) != 1 or not values[0]:
        raise InputError(f"{name}: every row must have the same number of entries")
    matrix = np.array(values, dtype=float)
    if not np.isfinite(matrix).all():
        raise InputError(f"{name}: every entry must be a finite number (no nan or inf)")
    return matrix


def steps(q, k, v, mask_name: str = "FWD") -> dict[str, np.ndarray]:
    """Every intermediate matrix: scores, masked scores, weights, output (and StableMask's discarded mass)."""
    q, k, v = (np.asarray(x, dtype=float) for x in (q, k, v))
    if q.shape[1] != k.shape[1]:
        raise InputError(f"Q has {q.shape[1]} columns but K has {k.shape[1]}: they must match (d_k)")
    if k.shape[0] != v.shape[0]:
        raise InputError(f"K has {k.shape[0]} rows but V has {v.shape[0]}: one value per key")
    if q.shape[0] != k.shape[0] and mask_name != "BIDIR":
        raise InputError("with a mask, Q and K need the same number of rows (one token each)")
    mask = MASKS[mask_name]()
    n = k.shape[0]
    scores = q @ k.T / np.sqrt(k.shape[1])
    allowed = mask.matrix(n)[: q.shape[0]] if q.shape[0] == n else np.ones((q.shape[0], n), bool)
    if mask.stable is not None:
        pseudo = -float(mask.stable) * np.arange(n)[None, :]
        logits = np.where(allowed, scores, pseudo)
        weights = softmax(logits) * allowed
        masked = np.where(allowed, scores, pseudo)
    else:
        masked = np.where(allowed, scores, -np.inf)
        weights = softmax(masked)
    return {"scores": scores, "masked": masked, "allowed": allowed, "weights": weights, "output": weights @ v,
            "discarded": 1 - weights.sum(-1)}


def linformer_steps(q, k, v, slots: int, method: str = "segment", seed: int = 0) -> dict[str, np.ndarray]:
    """Linformer on the small example (docs/methods.md#linformer-what-if): E, F, K' = E K, V' = F V, P = softmax(Q K'ᵀ/√d), P V',
    and the relative error against full softmax attention (its mask-free reference)."""
    from attnviz.effects import linformer

    q, k, v = (np.asarray(x, dtype=float) for x in (q, k, v))
    n = k.shape[0]
    if not 0 < slots <= n:
        raise InputError(f"k must be between 1 and the number of keys ({n}), got {slots}")
    e, f = linformer.projection(n, slots, method, seed), linformer.projection(n, slots, method, seed + 1)
    probs, out = linformer.attend(q[None], k[None], v[None], e, f)
    full = linformer.exact(q[None], k[None], v[None])
    return {"E": e, "F": f, "K'": e @ k, "V'": f @ v, "weights": probs[0], "output": out[0],
            "error": linformer.relative_error(out, full)}
