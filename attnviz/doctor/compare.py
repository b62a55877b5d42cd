"""What every check compares with and how: the limits (:func:`tolerance`, docs/methods.md#devices), the short text of
the model's own tokenizer, and the differences between two sets of maps, statistics or hidden states."""

from __future__ import annotations

import numpy as np
import torch

from attnviz.core.model import precision
from attnviz.core.loading.models import LoadedModel

FP32_TOLERANCE = precision.FP32_TOLERANCE  # docs/methods.md#devices
FP16_STEP = 2.0 ** -10  # one float16 step, relative: what a pooled map (kept in float16) may differ by
EQUIVALENCE_TOKENS = 48


def tolerance(dtype: torch.dtype) -> tuple[float, str]:
    """The limit for one layer's numbers computed in ``dtype`` by two routes fed the same layer input, and why
    (:func:`attnviz.core.model.precision.tolerance`)."""
    return precision.tolerance(dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def text_of(loaded: LoadedModel, n: int) -> str:
    """``n`` tokens of Python's reference docs in the model's own tokenizer: the text every check reads."""
    from attnviz import corpus

    return corpus.text_of(loaded.tokenizer, corpus.head_ids(loaded.tokenizer, corpus.stdlib().text, n))


def max_diff(a: np.ndarray, b: np.ndarray, allowed: np.ndarray | None = None) -> float:
    """The largest absolute difference (cells outside ``allowed`` count as 0 on both sides); NaN on both sides
    agrees, NaN on one side only is an infinite difference."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if allowed is not None:
        a, b = np.where(allowed, a, 0.0), np.where(allowed, b, 0.0)
    if a.shape != b.shape:
        return float("inf")
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if (nan_a != nan_b).any():
        return float("inf")
    both = ~nan_a
    return float(np.max(np.abs(a - b)[both])) if both.any() else 0.0


def relative(ours: dict[int, torch.Tensor], reference: dict[int, torch.Tensor], layers) -> float:
    """The largest ‖ours − reference‖ / ‖reference‖ over ``layers`` (hidden states, in float32)."""
    worst = 0.0
    for layer in layers:
        a, b = ours[layer].float().cpu(), reference[layer].float().cpu()
        worst = max(worst, float((a - b).norm() / b.norm().clamp(min=1e-30)))
    return worst


def statistics_error(reduced, full, layers) -> tuple[float, str]:
    """The largest difference between a statistics capture and every statistic's numpy definition
    (docs/methods.md#sink-metrics) on the full maps, and which statistic and layer it is in."""
    from attnviz.stats import metrics

    worst, where = 0.0, ""
    for layer in layers:
        probs, allowed = full.layer_probs(layer), full.allowed[layer]
        for statistic in metrics.STATISTICS:
            if statistic.name not in reduced.stats[layer]:
                return float("inf"), f"{statistic.name} missing in layer {layer}"
            diff = max_diff(reduced.stats[layer][statistic.name], statistic.reference(probs, allowed, full.tokens))
            if diff > worst or not where:
                worst, where = max(worst, diff), f"largest: {statistic.name}, layer {layer}"
    return worst, where


def pooled_error(reduced, full, pool: int, floor: float | None = None,
                 relative: bool = False) -> tuple[float, str]:
    """The largest difference between a statistics capture's pooled maps (``pool`` cells a side) and the maximum of
    each cell's full-map cells, over the cells above ``floor`` (None: every seen cell), relative to the cell where
    asked; inf where the two differ in shape or in which cells are seen. With the layer it is in."""
    from attnviz.figures.style import max_pool

    worst, where = 0.0, ""
    for layer in full.layers:
        pooled, _ = reduced.layer_view(layer)
        factor = reduced.pool_factor(layer)
        expected = np.stack([max_pool(np.where(full.allowed[layer], m, np.nan), pool, factor)
                             for m in full.layer_probs(layer)])
        if pooled.shape != expected.shape or (np.isnan(pooled) != np.isnan(expected)).any():
            return float("inf"), f"layer {layer}: cells differ in shape or in which are empty"
        cells = ~np.isnan(expected) if floor is None else np.nan_to_num(expected) > floor
        if cells.any():
            error = np.abs(pooled[cells] - expected[cells])
            error = float(np.max(error / expected[cells] if relative else error))
            if error > worst or not where:
                worst, where = max(worst, error), f"largest: layer {layer} (pooling factor {factor})"
    return worst, where
