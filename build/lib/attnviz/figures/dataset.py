"""Figures of sinks across a dataset: rates with 95% intervals, alpha by key, averaged maps."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from attnviz.effects.dataset import DatasetSinks, interval
from attnviz.figures.style import COLORSCALE, colour_range, layout, matrix_traces
from attnviz.stats.metrics import SINK_EPS


def rate_bars(result: DatasetSinks, key: int = 0, eps: float = SINK_EPS) -> go.Figure:
    """Sink rate per layer, mean over samples with its 95% interval as error bars."""
    per_layer = [interval(result.rates(key, eps)[:, l]) for l in range(len(result.layer_masks))]
    means = [np.nan if r["mean"] is None else r["mean"] for r in per_layer]
    upper = [0 if r["mean"] is None else r["ci95"][1] - r["mean"] for r in per_layer]
    lower = [0 if r["mean"] is None else r["mean"] - r["ci95"][0] for r in per_layer]
    fig = go.Figure(go.Bar(x=list(range(len(means))), y=means, marker_color="#1f4e9c",
                           error_y=dict(type="data", array=upper, arrayminus=lower, color="#333", thickness=1),
                           customdata=np.array(result.layer_masks, dtype=object),
                           hovertemplate="layer %{x} (%{customdata})<br>sink rate %{y:.1%}<extra></extra>"))
    overall = interval(result.model_rates(key, eps))
    summary = "undefined" if overall["mean"] is None else \
        f"{overall['mean']:.1%} [{overall['ci95'][0]:.1%}, {overall['ci95'][1]:.1%}]"
    layout(fig, f"sink rate at key {key} per layer (alpha > {eps:g}), {result.n_samples} samples · model {summary}",
           height=400)
    fig.update_xaxes(title="layer", dtick=2)
    fig.update_yaxes(title="sink rate (95% interval)", range=[0, 1.05], tickformat=".0%")
    return fig


def alpha_by_key(result: DatasetSinks) -> go.Figure:
    """alpha_k averaged over samples and heads, layer × key position: where attention parks."""
    values = result.alpha_by_key()
    fig = go.Figure(go.Heatmap(z=values, x=list(range(values.shape[1])), y=list(range(values.shape[0])),
                               colorscale=COLORSCALE, zmin=0, zmax=max(float(np.nanmax(values)), 1e-6),
                               colorbar=dict(title="mean alpha_k"), hoverongaps=False,
                               hovertemplate="layer %{y}, key %{x}<br>alpha %{z:.3f}<extra></extra>"))
    layout(fig, f"alpha by key position, averaged over {result.n_samples} samples and all heads", height=420)
    fig.update_xaxes(title="key position k")
    fig.update_yaxes(title="layer", autorange="reversed")
    return fig


def averaged_map(result: DatasetSinks, layer: int, head: int | None = None, spread: bool = False) -> go.Figure:
    """The attention map averaged over the full-length samples, or its standard deviation."""
    maps = np.sqrt(result.var_maps()[layer]) if spread else result.mean_maps()[layer]
    values = maps.mean(0) if head is None else maps[head]
    values = np.where(result.allowed[layer], values, np.nan)  # masked cells grey, as on every heatmap
    zmin, zmax = colour_range([values], False)
    traces, _ = matrix_traces(values, None, None, zmin, zmax, False,
                              colorbar_title="std over samples" if spread else "mean attention")
    fig = go.Figure(traces)
    what = "std" if spread else "mean"
    layout(fig, f"layer {layer} · {'mean over heads' if head is None else f'head {head}'} · {what} over "
                f"{result.n_full} samples of {result.max_len} tokens", height=480, masked_bg=True)
    fig.update_xaxes(title="key", constrain="domain")
    fig.update_yaxes(title="query", autorange="reversed", scaleanchor="x")
    return fig
