"""The picture of an architecture: every layer's boolean mask, and StableMask's pseudo-attention."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnviz.core.spec.arch import Architecture
from attnviz.figures.style import layout


def architecture_masks(arch: Architecture, n: int = 12, cols: int = 6) -> go.Figure:
    """Small multiples, one per layer: dark = may attend, light = masked."""
    count = arch.n_layers
    rows = int(np.ceil(count / cols))
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[f"L{i}: {m.name}" for i, m in enumerate(arch.layers)],
                        horizontal_spacing=0.02, vertical_spacing=0.25 / max(rows, 1))
    for i, mask in enumerate(arch.layers):
        fig.add_trace(go.Heatmap(z=mask.matrix(n).astype(int), colorscale=[[0, "#f0f0f0"], [1, "#1f4e9c"]],
                                 zmin=0, zmax=1, showscale=False, xgap=1, ygap=1,
                                 hovertemplate=f"layer {i}<br>query %{{y}}, key %{{x}}<br>allowed %{{z}}<extra></extra>"),
                      row=i // cols + 1, col=i % cols + 1)
    fig.update_yaxes(autorange="reversed", showticklabels=False)
    fig.update_xaxes(showticklabels=False)
    fig.update_annotations(font_size=9)
    return layout(fig, f"{arch.spec}: mask of every layer (rows = queries)", height=150 * rows + 80)


def stablemask_pseudo(n: int = 12, gamma: float | str = 0.5, head: int = 0, n_heads: int = 8) -> go.Figure:
    """P[i, j] = -gamma * j above the diagonal (docs/methods.md#stablemask); the causal part shows the scores A."""
    from attnviz.core.spec.masks import stable_gammas

    g = float(stable_gammas(gamma, n_heads)[head])
    i, j = np.indices((n, n))
    pseudo = np.where(j > i, -g * j, np.nan)
    fig = go.Figure(go.Heatmap(z=pseudo, colorscale="Reds_r", colorbar=dict(title="P[i, j]"), hoverongaps=False,
                               text=np.where(j > i, np.round(pseudo, 2).astype(str), "A"), texttemplate="%{text}",
                               textfont=dict(size=8)))
    layout(fig, f"StableMask pseudo-attention, gamma = {g:.4g} (lower triangle: real scores A)", height=420)
    fig.update_yaxes(autorange="reversed", title="query i")
    return fig.update_xaxes(title="key j")


def labelled_matrix(values, title: str, row_labels=None, col_labels=None, masked=None, fmt: str = ".2f",
                    colorscale: str = "Blues") -> go.Figure:
    """A small matrix with its numbers written in the cells (walkthrough steps)."""
    values = np.asarray(values, dtype=float)
    shown = np.where(np.isinf(values), np.nan, values)
    text = [[("-inf" if np.isneginf(v) else format(v, fmt)) for v in row] for row in values]
    fig = go.Figure(go.Heatmap(z=shown, text=text, texttemplate="%{text}", colorscale=colorscale, showscale=False,
                               x=col_labels, y=row_labels, hoverongaps=False, xgap=2, ygap=2))
    layout(fig, title, height=90 + 46 * values.shape[0])
    fig.update_layout(plot_bgcolor="#c9c9c9", margin=dict(l=70, r=10, t=40, b=40))
    fig.update_yaxes(autorange="reversed", type="category")
    return fig.update_xaxes(type="category", side="bottom")
