"""The compression valley's figure (docs/methods.md#the-compression-valley): the first token's norm, the sink rate and
the matrix-based entropy of each layer's input, over depth; shown on the Attention sinks page."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnviz.effects.valley import Valley
from attnviz.figures.sinks import PART_COLOURS
from attnviz.figures.style import layout
from attnviz.stats import metrics


def valley_figure(valley: Valley, eps: float = metrics.SINK_EPS) -> go.Figure:
    """The compression valley (docs/methods.md#the-compression-valley), three panels over depth stacked as in
    Queipo-de-Llano et al.'s Fig. 1: the first token's residual norm entering each layer (log scale), the sink rate
    at each layer's sink key (at key 0 too, dashed, where the two differ), and the matrix-based entropy H of the
    layer's input, its lowest layer marked. ``valley``: an :class:`attnviz.effects.valley.Valley`."""
    x = list(valley.layers)
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06)
    fig.add_trace(go.Scatter(x=x, y=valley.first_norm, mode="lines+markers", name="‖first token‖",
                             line=dict(color=PART_COLOURS["first"]),
                             hovertemplate="layer %{x}<br>‖z₀‖ = %{y:.4g}<extra></extra>"), row=1, col=1)
    rate = valley.sink_rate(eps)
    keys = sorted(set(valley.keys))
    named = f"key {keys[0]}" if len(keys) == 1 else "each layer's sink key"
    fig.add_trace(go.Scatter(x=x, y=rate, mode="lines+markers", name=f"sink rate at {named}",
                             line=dict(color=PART_COLOURS["discarded"]), customdata=valley.keys,
                             hovertemplate="layer %{x}, key %{customdata}<br>sink rate %{y:.0%}<extra></extra>"),
                  row=2, col=1)
    rate0 = valley.sink_rate(eps, key0=True)
    if keys != [0] and np.isfinite(rate0).any():
        fig.add_trace(go.Scatter(x=x, y=rate0, mode="lines", name="sink rate at key 0",
                                 line=dict(color=PART_COLOURS["discarded"], dash="dash"),
                                 hovertemplate="layer %{x}, key 0<br>sink rate %{y:.0%}<extra></extra>"), row=2, col=1)
    fig.add_trace(go.Scatter(x=x, y=valley.entropy, mode="lines+markers", name="entropy H",
                             line=dict(color=PART_COLOURS["diagonal"]),
                             hovertemplate="layer %{x}<br>H = %{y:.4f}<extra></extra>"), row=3, col=1)
    low = valley.valley()
    if low is not None:
        fig.add_trace(go.Scatter(x=[low], y=[valley.entropy[x.index(low)]], mode="markers", showlegend=False,
                                 marker=dict(symbol="circle-open", size=14, color="black"), hoverinfo="skip"),
                      row=3, col=1)
    layout(fig, f"the compression valley: {valley.arch}, {valley.n_tokens} tokens", height=640)
    fig.update_yaxes(title="‖first token‖", type="log", row=1, col=1)
    fig.update_yaxes(title=f"sink rate (α > {eps:g})", range=[0, 1.02], row=2, col=1)
    fig.update_yaxes(title="entropy H", row=3, col=1)
    fig.update_xaxes(title="layer (its input)", row=3, col=1)
    fig.update_layout(legend=dict(orientation="h", y=-0.12))
    return fig
