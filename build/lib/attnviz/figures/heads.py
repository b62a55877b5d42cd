"""The head taxonomy as a layer × head grid (docs/methods.md#head-classes): one colour per class, every score on hover."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from attnviz.effects.heads import Taxonomy
from attnviz.figures.style import layout

CLASSES = {"retrieval": "#d9d9d9", "sink": "#1f4e9c", "streaming": "#59a14f", "inactive": "#e15759"}


def head_classes(tax: Taxonomy) -> go.Figure:
    """Layer (rows, bottom layer on top) × head grid coloured by class: inactive > streaming > sink >
    retrieval. Hover gives alpha_0, the streaming score and the output-norm score; one invisible
    marker per tile carries clicks (Streamlit ignores selections on heatmap cells)."""
    classes = tax.classes()
    names = list(CLASSES)
    code = np.vectorize(names.index)(classes).astype(float)
    n_layers, n_heads = code.shape
    k = len(names)
    scale = [[i / k + e, colour] for i, colour in enumerate(CLASSES.values()) for e in (0.0, 1.0 / k)]
    scale[-1][0] = 1.0
    custom = np.stack([tax.alpha0, np.nan_to_num(tax.streaming_score, nan=-1), tax.ahon], axis=-1)
    hover = ("layer %{y}, head %{x}<br>%{text}<br>alpha_0 %{customdata[0]:.3f}<br>streaming score "
             "%{customdata[1]:.3f}<br>output norm (AHON) %{customdata[2]:.3f}<extra></extra>")
    fig = go.Figure(go.Heatmap(z=code, zmin=-0.5, zmax=k - 0.5, colorscale=scale, text=classes, hoverinfo="skip",
                               xgap=1, ygap=1, showscale=False))
    layer_idx, head_idx = np.indices(code.shape)  # the markers carry hover and clicks (a skipped hover would not click)
    fig.add_trace(go.Scatter(x=head_idx.ravel(), y=layer_idx.ravel(), mode="markers", showlegend=False,
                             text=classes.ravel(), customdata=custom.reshape(-1, 3), hovertemplate=hover,
                             marker=dict(size=14, opacity=0), selected=dict(marker=dict(opacity=0)),
                             unselected=dict(marker=dict(opacity=0))))
    for name, colour in CLASSES.items():  # a legend of the classes, with their counts
        count = int((classes == name).sum())
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=f"{name} ({count})",
                                 marker=dict(color=colour, size=10, symbol="square")))
    layout(fig, f"head taxonomy · {tax.arch} · {tax.samples} sample(s) · eps {tax.eps:g}, streaming ≥ "
                f"{tax.tau_stream:g} (s={tax.s}, w={tax.w}), inactive < {tax.tau_inactive:g}",
           height=max(360, 18 * n_layers + 120))
    fig.update_xaxes(title="head", range=[-0.5, n_heads - 0.5], dtick=1)
    fig.update_yaxes(title="layer", range=[n_layers - 0.5, -0.5], dtick=max(1, n_layers // 10))
    return fig
