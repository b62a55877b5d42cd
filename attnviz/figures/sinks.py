"""Attention-sink figures: attention to a key by query position, alpha and sink-rate grids, allocation."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.colors import sample_colorscale

from attnviz.capture import Capture
from attnviz.figures.style import layout, token_text
from attnviz.stats import metrics

PART_COLOURS = {"first": "#1f4e9c", "delimiter": "#f28e2b", "diagonal": "#59a14f", "other": "#bab0ac",
                "discarded": "#e15759"}


LEGEND_MAX = 6  # more curves than this get a colour bar for the layer: a 30-entry legend does not fit a paper figure


def key_profile(cap: Capture, key: int = 0, layers: list[int] | None = None) -> go.Figure:
    """Mean over heads of A[i, key] against query position i: one curve per layer, coloured by layer."""
    layers = layers if layers is not None else cap.layers
    colours = sample_colorscale("Viridis", list(np.linspace(0, 1, max(len(layers), 2))))
    fig = go.Figure()
    bar = len(layers) > LEGEND_MAX
    for colour, layer in zip(colours, layers):
        if key == 0:
            profile = cap.stat(layer, "key0")
        elif cap.probs:
            profile = metrics.key_profile(cap.layer_probs(layer), cap.allowed[layer], key)
        else:
            continue
        seen = np.isfinite(profile).sum(0)  # queries the mask hides from the key stay gaps, not zeros
        y = np.where(seen > 0, np.nansum(profile, 0) / np.maximum(seen, 1), np.nan)
        fig.add_trace(go.Scatter(x=np.arange(len(y)), y=y, mode="lines", name=f"L{layer}", showlegend=not bar,
                                 line=dict(color=colour, width=1.5),
                                 hovertemplate=f"layer {layer}<br>query %{{x}}<br>p = %{{y:.3f}}<extra></extra>"))
    if not fig.data:  # a long capture keeps key 0's profile only
        fig.add_annotation(text="Only key 0's profile is kept for a long text (statistics, not full maps)",
                           showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    elif bar:  # the colour bar: an invisible point carries it
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", showlegend=False, hoverinfo="skip",
                                 marker=dict(colorscale="Viridis", cmin=min(layers), cmax=max(layers),
                                             color=[min(layers)], showscale=True,
                                             colorbar=dict(title="layer", len=0.8))))
    layout(fig, f"attention to key {key} ({cap.tokens[key]!r}) by query position", height=420)
    fig.update_xaxes(title="query position")
    fig.update_yaxes(title=f"A[i, {key}] (mean over heads)", range=[0, 1])
    return fig


def alpha_matrix(cap: Capture, key: int = 0) -> np.ndarray:
    return np.stack([cap.stat(layer, "alpha")[:, key] for layer in cap.layers])


def layer_head_grid(values: np.ndarray, cap: Capture, title: str, colorbar: str, zmax: float = 1.0,
                    text_fmt: str = ".2f") -> go.Figure:
    fig = go.Figure(go.Heatmap(z=values, x=[f"h{h}·g{g}" for h, g in enumerate(cap.kv_groups)],
                               y=[str(l) for l in cap.layers], colorscale="Blues", zmin=0, zmax=zmax,
                               colorbar=dict(title=colorbar), hoverongaps=False,
                               hovertemplate="layer %{y}, %{x}<br>%{z:" + text_fmt + "}<extra></extra>"))
    layout(fig, title, height=max(360, 18 * len(cap.layers)))
    fig.update_yaxes(autorange="reversed", title="layer", type="category")
    fig.update_xaxes(title="head · KV group")
    return fig


def alpha_grid(cap: Capture, key: int = 0) -> go.Figure:
    return layer_head_grid(alpha_matrix(cap, key), cap, f"alpha_{key} per layer and head (grey: undefined)",
                           f"alpha_{key}")


def sink_grid(cap: Capture, key: int = 0, eps: float = metrics.SINK_EPS) -> go.Figure:
    """Which heads are sinks (alpha > eps), with the per-layer sink rate in the row labels."""
    alphas = alpha_matrix(cap, key)
    is_sink = np.where(np.isnan(alphas), np.nan, alphas > eps)  # undefined alpha stays a gap
    fig = layer_head_grid(is_sink, cap, f"sink heads at key {key} (alpha > {eps:g}); rate = share per layer",
                          "sink", text_fmt=".0f")
    rates = [metrics.sink_rate(row, eps) for row in alphas]
    fig.update_yaxes(tickmode="array", tickvals=[str(l) for l in cap.layers],
                     ticktext=[f"{l} ({'–' if np.isnan(r) else f'{r:.0%}'})" for l, r in zip(cap.layers, rates)])
    fig.data[0].update(showscale=False)
    return fig


def allocation_shares(cap: Capture) -> np.ndarray:
    """(layers, 5) mean share of each allocation part, over heads and queries."""
    return np.stack([cap.stat(l, "allocation").mean((0, 1)) for l in cap.layers])


def allocation_bars(cap: Capture) -> go.Figure:
    """Stacked bars per layer: first token / delimiters / diagonal / other / discarded (StableMask Fig. 1b)."""
    shares = allocation_shares(cap)
    fig = go.Figure()
    for k, part in enumerate(metrics.ALLOCATION_PARTS):
        if part == "discarded" and shares[:, k].max() < 1e-3:
            continue
        fig.add_trace(go.Bar(x=[str(l) for l in cap.layers], y=shares[:, k], name=part,
                             marker_color=PART_COLOURS[part],
                             hovertemplate=f"layer %{{x}}<br>{part}: %{{y:.1%}}<extra></extra>"))
    layout(fig, "where each layer's attention goes", height=400)
    fig.update_layout(barmode="stack", legend=dict(orientation="h", y=1.08))
    fig.update_yaxes(title="share of attention", range=[0, 1], tickformat=".0%")
    fig.update_xaxes(title="layer", type="category")
    return fig


def discarded_figure(cap: Capture) -> go.Figure:
    """Mean discarded mass per layer and head (StableMask pseudo-slots, learned sinks)."""
    values = np.stack([cap.stat(l, "discarded").mean(-1) for l in cap.layers])
    return layer_head_grid(values, cap, "discarded mass (1 - row sum), mean over queries", "discarded",
                           zmax=max(float(values.max()), 1e-3))


def learned_matrix(cap: Capture) -> np.ndarray | None:
    """(layers, heads) alpha of the model's learned sink (docs/methods.md#the-learned-sink-as-a-key), NaN in a layer
    without one; None where the model has none."""
    if not cap.learned_sink:
        return None
    return np.stack([np.full(cap.n_heads, np.nan) if (a := cap.learned_alpha(l)) is None else a for l in cap.layers])


def learned_grid(cap: Capture, eps: float = metrics.SINK_EPS) -> go.Figure | None:
    """Alpha of the model's learned sink per layer and head (gpt-oss), on alpha's scale (0 to 1) as key 0's grid, the
    per-layer sink rate of the learned sink in the row labels; None where the model has none."""
    values = learned_matrix(cap)
    if values is None:
        return None
    fig = layer_head_grid(values, cap, f"alpha of the learned sink per layer and head; rate: alpha > {eps:g}",
                          "alpha_sink")
    rates = [metrics.sink_rate(row, eps) for row in values]
    fig.update_yaxes(tickmode="array", tickvals=[str(l) for l in cap.layers],
                     ticktext=[f"{l} ({'–' if np.isnan(r) else f'{r:.0%}'})" for l, r in zip(cap.layers, rates)])
    return fig


SECONDARY = "#e15759"  # a sink that is not the first token
FIRST = "#1f1f1f"
LEARNED = "#59a14f"  # the model's learned sink


def sink_map(cap: Capture, eps: float = metrics.SINK_EPS) -> go.Figure:
    """Where the sinks are: each key's attention share (alpha averaged over heads) by layer, over the keys that may be
    sinks (:func:`attnviz.stats.metrics.sink_candidates`), every sink key (docs/methods.md#sinks-at-any-key) marked
    with its token: the first token in black, a secondary sink (any other key) in red. A model's learned sink
    (docs/methods.md#the-learned-sink-as-a-key) is a column of its own, "sink", left of key 0, ringed in green where
    it is one."""
    n = metrics.sink_candidates(cap.n_tokens)
    share = np.full((len(cap.layers), n), np.nan)
    for row, layer in enumerate(cap.layers):
        alphas = cap.stat(layer, "alpha")[:, :n]
        defined = np.isfinite(alphas)
        counts = defined.sum(0)
        share[row] = np.where(counts > 0, np.where(defined, alphas, 0).sum(0) / np.maximum(counts, 1), np.nan)
    labels = [f"{k} {cap.tokens[k]!r}" for k in range(n)]  # the key axis: each label sent once, not once a cell
    ticks = [token_text(t) for t in cap.tokens[:n]]
    learned = learned_matrix(cap)
    if learned is not None:  # the learned sink's column, left of key 0: its alpha averaged over heads
        column = [float(np.nanmean(row)) if np.isfinite(row).any() else np.nan for row in learned]
        share = np.concatenate([np.asarray(column)[:, None], share], axis=1)
        labels, ticks = ["sink"] + labels, ["sink"] + ticks
    fig = go.Figure(go.Heatmap(z=share.astype(np.float32), x=labels, y=list(cap.layers), colorscale="Blues", zmin=0,
                               zmax=max(float(np.nanmax(share)) if np.isfinite(share).any() else 1.0, eps),
                               colorbar=dict(title="share"), hoverongaps=False,
                               hovertemplate="layer %{y}, key %{x}<br>share %{z:.3f}<extra></extra>"))
    rings = (("first", FIRST, "first-token sink"), ("secondary", SECONDARY, "secondary sink"))
    for drawn, colour, name in rings + ((("learned", LEARNED, "learned sink"),) if learned is not None else ()):
        xs, ys, text = [], [], []
        for layer in cap.layers:
            for sink in cap.sinks(layer, eps):
                ring = sink["category"] if sink["category"] in ("first", "learned") else "secondary"
                if ring != drawn:
                    continue
                xs.append("sink" if drawn == "learned" else labels[sink["key"] + (learned is not None)]), ys.append(layer)
                text.append(f"{sink['token']!r}: {len(sink['heads'])} head(s), share {sink['share']:.2f}")
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name=name, text=text,
                                 marker=dict(symbol="circle-open", size=11, color=colour, line=dict(width=2)),
                                 hovertemplate="layer %{y}, key %{x}: %{text}<extra>" + name + "</extra>"))
    shown = "every key" if n == cap.n_tokens else f"{'key 0' if n == 1 else f'keys 0–{n - 1}'} of {cap.n_tokens}"
    half = "" if n == cap.n_tokens else ", the first half: a later key is seen by too few queries to be a sink"
    layout(fig, f"where the sinks are: each key's attention share per layer (rings: alpha > {eps:g} in some head)"
                f"<br><sup>{shown}{half}</sup>", height=max(380, 16 * len(cap.layers)))
    # the title's two lines, then the legend just above the plot: below it, it would cover the key axis's tokens
    fig.update_layout(margin=dict(t=110), legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1))
    fig.update_yaxes(autorange="reversed", title="layer")
    fig.update_xaxes(title=f"key ({shown})", type="category", categoryorder="array", categoryarray=labels,
                     **(dict(tickmode="array", tickvals=labels, ticktext=ticks) if n <= 48 else {}))
    return fig
