"""The picture of an architecture: every layer's boolean mask, and StableMask's pseudo-attention."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnviz.core.spec.arch import Architecture
from attnviz.figures.style import layout


ALLOWED, HIDDEN = "#1f4e9c", "#f0f0f0"  # may attend, masked


def architecture_masks(arch: Architecture, n: int = 12, cols: int = 6) -> go.Figure:
    """Small multiples, one per layer, queries down and keys across, each tile numbered by its query and key
    positions; the legend keys the colours: dark = may attend, light = masked."""
    count = arch.n_layers
    rows = int(np.ceil(count / cols))
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[f"L{i}: {m.name}" for i, m in enumerate(arch.layers)],
                        horizontal_spacing=0.03, vertical_spacing=0.35 / max(rows, 1))
    for i, mask in enumerate(arch.layers):
        fig.add_trace(go.Heatmap(z=mask.matrix(n).astype(int), colorscale=[[0, HIDDEN], [1, ALLOWED]],
                                 zmin=0, zmax=1, showscale=False, xgap=1, ygap=1,
                                 hovertemplate=f"layer {i}<br>query %{{y}}, key %{{x}}<br>allowed %{{z}}<extra></extra>"),
                      row=i // cols + 1, col=i % cols + 1)
    for i in range(count):  # each tile square
        fig.update_yaxes(scaleanchor=f"x{i + 1 if i else ''}", constrain="domain", row=i // cols + 1, col=i % cols + 1)
        fig.update_xaxes(constrain="domain", row=i // cols + 1, col=i % cols + 1)
    for name, colour in (("may attend", ALLOWED), ("masked", HIDDEN)):  # the colour key: a square marker each
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name, showlegend=True, hoverinfo="skip",
                                 marker=dict(color=colour, size=12, symbol="square", line=dict(color="#888", width=1))))
    step = max(1, int(np.ceil(n / 6)))  # about six numbers a side: a tile is a sixth of the page wide
    ticks = dict(tickmode="linear", tick0=0, dtick=step, tickfont=dict(size=8), ticks="", showticklabels=True)
    fig.update_yaxes(autorange="reversed", **ticks)
    fig.update_xaxes(**ticks)
    for col in range(1, min(cols, count) + 1):  # the axes named once: keys under the bottom row, queries left
        fig.update_xaxes(title_text="key", title_font_size=9, title_standoff=2, automargin=True,
                         row=(count - col) // cols + 1, col=col)
    for row in range(1, rows + 1):
        fig.update_yaxes(title_text="query", title_font_size=9, title_standoff=8, automargin=True, row=row, col=1)
    fig.update_annotations(font_size=9)
    layout(fig, f"{arch.spec}: mask of every layer (rows = queries)", height=170 * rows + 90)
    # the colour key on the title's line, at the top right: above the plot it would cover the top row's tile titles
    return fig.update_layout(showlegend=True, margin=dict(t=70, l=72),
                             legend=dict(orientation="h", yref="container", y=1, yanchor="top", xanchor="right", x=1,
                                         font=dict(size=11)))


#: The StableMask colour bar's title: what its cells hold, a logit added before the softmax (docs/methods.md#stablemask).
PSEUDO_TITLE = "pseudo-score<br>−γ·j (logit)"


def stablemask_pseudo(n: int = 12, gamma: float | str = 0.5, head: int = 0, n_heads: int = 8) -> go.Figure:
    """The pseudo-attention scores P[i, j] = -gamma * j above the diagonal (docs/methods.md#stablemask): logits the
    softmax adds to the future slots, not probabilities, so the colour bar names them by their formula; the causal
    part shows the scores A."""
    from attnviz.core.spec.masks import stable_gammas

    g = float(stable_gammas(gamma, n_heads)[head])
    i, j = np.indices((n, n))
    pseudo = np.where(j > i, -g * j, np.nan)
    fig = go.Figure(go.Heatmap(z=pseudo, colorscale="Reds_r", colorbar=dict(title=PSEUDO_TITLE), hoverongaps=False,
                               text=np.where(j > i, np.round(pseudo, 2).astype(str), "A"), texttemplate="%{text}",
                               textfont=dict(size=8),
                               hovertemplate="query %{y}, key %{x}<br>pseudo-score −γ·j = %{z:.3f}<extra></extra>"))
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
