"""Sink shifting (seed 000): how the sink moves when the first keys are hidden, and A vs B comparisons."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnviz.capture import Capture
from attnviz.effects import compare
from attnviz.figures.heatmaps import layer_matrix
from attnviz.figures.style import colour_range, grey_under, layout, matrix_traces
from attnviz.stats import metrics


def shift_panels(caps: list[Capture], titles: list[str], layer: int, log: bool = False,
                 max_keys: int = 16) -> go.Figure:
    """Per architecture: the head-mean map (shared scale; queries down, keys across, each axis titled) above the
    attention mass per key."""
    values = [layer_matrix(c, layer) for c in caps]
    zmin, zmax = colour_range(values, log)
    fig = make_subplots(rows=2, cols=len(caps), subplot_titles=titles, row_heights=[0.68, 0.32],
                        vertical_spacing=0.13, horizontal_spacing=0.05)
    top = 0.0
    for col, (cap, v) in enumerate(zip(caps, values), start=1):
        traces, _ = matrix_traces(v, None, None, zmin, zmax, log, show_scale=col == len(caps),
                                  scale=cap.pool_factor(layer))
        for t in traces:
            fig.add_trace(t, row=1, col=col)
        grey_under(fig, 1, col)
        fig.update_yaxes(autorange="reversed", constrain="domain", row=1, col=col)
        fig.update_xaxes(title_text="key", title_standoff=4, row=1, col=col)
        mass = cap.stat(layer, "column_mean").mean(0)[:max_keys]
        top = max(top, float(mass.max()))
        sink = int(np.argmax(mass))
        colours = ["#e15759" if k == sink else "#4e79a7" for k in range(len(mass))]
        fig.add_trace(go.Bar(x=list(range(len(mass))), y=mass, marker_color=colours, showlegend=False,
                             customdata=[cap.tokens[k] for k in range(len(mass))],
                             hovertemplate="key %{x} (%{customdata})<br>mass %{y:.3f}<extra></extra>"),
                      row=2, col=col)
        fig.update_xaxes(title_text="key", row=2, col=col)
    fig.update_yaxes(range=[0, max(top * 1.1, 1e-3)], row=2)
    fig.update_yaxes(title_text="query", row=1, col=1)
    fig.update_yaxes(title_text="attention mass", row=2, col=1)
    return layout(fig, f"layer {layer}: attention (top) and mass per key (bottom; red = sink key)", height=660)


def sink_key_grids(caps: list[Capture], titles: list[str], max_key: int = 4) -> go.Figure:
    """Per architecture, the sink key of every head by layer (keys above ``max_key`` share one colour)."""
    fig = make_subplots(rows=1, cols=len(caps), subplot_titles=titles, shared_yaxes=True, horizontal_spacing=0.03)
    for col, cap in enumerate(caps, start=1):
        keys = compare.sink_keys(cap)
        fig.add_trace(go.Heatmap(z=np.minimum(keys, max_key + 1), customdata=keys, zmin=0, zmax=max_key + 1,
                                 colorscale="Turbo", showscale=col == len(caps),
                                 x=[f"h{h}" for h in range(cap.n_heads)], y=[str(l) for l in cap.layers],
                                 colorbar=dict(title="sink key", tickvals=list(range(max_key + 2)),
                                               ticktext=[str(k) for k in range(max_key + 1)] + [f">{max_key}"]),
                                 hovertemplate="layer %{y}, %{x}<br>sink key %{customdata}<extra></extra>"),
                      row=1, col=col)
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_yaxes(title_text="layer", col=1)
    return layout(fig, "sink key of every head", height=max(380, 16 * len(caps[0].layers)))


def shift_rate_figure(before: Capture, others: list[Capture], titles: list[str], ms: list[int]) -> go.Figure:
    fig = go.Figure()
    for cap, title, m in zip(others, titles, ms):
        fig.add_trace(go.Scatter(x=before.layers, y=compare.shift_rates(before, cap, m), mode="lines+markers",
                                 name=f"{title}: 0 → {m}"))
    layout(fig, "shift rate per layer (heads whose sink moves from key 0 to key m)", height=360)
    fig.update_yaxes(range=[0, 1.02], tickformat=".0%", title="shift rate")
    fig.update_xaxes(title="layer")
    return fig


def difference(a: Capture, b: Capture, layer: int, head: int | None = None) -> go.Figure:
    """B − A; red: B attends more, blue: less. A cell one side masks holds 0 on that side (a forbidden key gets no
    attention), so B's attention where only A masks shows, and A's where only B masks; grey only where both mask."""
    va, vb = layer_matrix(a, layer, head), layer_matrix(b, layer, head)
    diff = np.where(np.isnan(va) & np.isnan(vb), np.nan, np.nan_to_num(vb) - np.nan_to_num(va))
    bound = float(np.nanmax(np.abs(diff))) if np.isfinite(diff).any() else 1.0
    fig = go.Figure(go.Heatmap(z=diff, colorscale="RdBu_r", zmid=0, zmin=-bound, zmax=bound, hoverongaps=False,
                               colorbar=dict(title="B − A")))
    layout(fig, f"difference B − A at layer {layer}", height=460, masked_bg=True)
    fig.update_yaxes(autorange="reversed", title="query")
    fig.update_xaxes(title="key")
    if diff.shape[0] > 96:  # keep the payload small: send a pooled image instead
        from attnviz.figures.style import max_pool

        pooled = max_pool(np.abs(diff), 512) * np.sign(max_pool(diff, 512))
        fig.data[0].update(z=pooled)
    return fig


def sink_mass_change(a: Capture, b: Capture, layer: int, keys: int = 1) -> go.Figure:
    ma, mb = compare.sink_mass(a, layer, keys), compare.sink_mass(b, layer, keys)
    heads = [f"h{h}" for h in range(a.n_heads)]
    fig = go.Figure([go.Bar(x=heads, y=ma, name="A"), go.Bar(x=heads, y=mb, name="B")])
    layout(fig, f"attention mass on the first {keys} key(s), layer {layer}", height=340)
    return fig.update_layout(barmode="group")


def cosine_figure(a: Capture, b: Capture) -> go.Figure:
    cos = compare.hidden_cosine(a, b)
    fig = go.Figure(go.Scatter(x=list(range(len(cos))), y=cos, mode="lines+markers"))
    layout(fig, "cosine similarity of hidden states (A vs B), mean over tokens", height=340)
    fig.update_xaxes(title="layer output (0 = embeddings)")
    return fig.update_yaxes(title="cosine", range=[min(0.0, float(cos.min())), 1.02])


def where_sinks_went(caps: list[Capture], titles: list[str], eps: float = metrics.SINK_EPS) -> go.Figure:
    """Per architecture (one panel each, one layer axis), where each layer's strongest sink is
    (:func:`attnviz.effects.compare.where_sinks_are`): its key by layer, the marker's size its share, the token on
    hover; a layer with no sink has no marker. A sink that moved to a delimiter shows away from key 0 or m, not as a
    sink that vanished."""
    fig = make_subplots(rows=len(caps), cols=1, shared_xaxes=True, vertical_spacing=0.1, subplot_titles=titles)
    top = 1
    for row, (cap, title) in enumerate(zip(caps, titles), start=1):
        found = compare.where_sinks_are(cap, eps)
        layers = [l for l, s in zip(cap.layers, found) if s is not None]
        sinks = [s for s in found if s is not None]
        top = max([top, *(s["key"] for s in sinks)])
        fig.add_trace(go.Scatter(
            x=layers, y=[s["key"] for s in sinks], mode="markers", name=title, showlegend=False,
            marker=dict(size=[6 + 14 * s["share"] for s in sinks], color=["#1f1f1f" if s["key"] == 0 else "#e15759"
                                                                           for s in sinks]),
            text=[s["token"].strip() or repr(s["token"]) for s in sinks],
            customdata=[[s["token"], s["share"], len(s["heads"])] for s in sinks],
            hovertemplate=(f"{title}<br>layer %{{x}}: key %{{y}} (%{{customdata[0]}})<br>share %{{customdata[1]:.2f}} "
                           "over %{customdata[2]} head(s)<extra></extra>")), row=row, col=1)
        fig.update_yaxes(title_text="key", row=row, col=1)
    fig.update_yaxes(range=[-0.5, top + 0.5])
    fig.update_xaxes(title_text="layer", row=len(caps), col=1)
    return layout(fig, f"where the sink went: each layer's strongest sink key (alpha > {eps:g}; size: its share; "
                       "red: not the first token)", height=150 + 150 * len(caps))
