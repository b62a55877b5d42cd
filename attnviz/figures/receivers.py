"""The figure of path patching's head receivers (:mod:`attnviz.effects.receivers`): which heads of a layer read a
write."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnviz.figures.style import layout


def heads_figure(found) -> go.Figure:
    """One panel per sender with head receivers; in it, a row per kind and head (``keys h0``, ...) and a column per
    layer: the fall of the sink's attention over the layers the cut can move (from the head's layer up) when the
    sender's write is removed from that head's slice alone (1: gone, 0: unchanged, below 0: the sink grows; blank:
    not measured). Receivers that join heads with + are left to the JSON."""
    n = len(found.before.attention)
    senders = [s for s in found.senders if found.heads(s)] or ["(no head receiver)"]
    fig = make_subplots(rows=len(senders), cols=1, shared_xaxes=True, vertical_spacing=0.08 if len(senders) > 1 else 0,
                        subplot_titles=[f"{s} removed from one head" for s in senders])
    for i, sender in enumerate(senders, 1):
        cells = {}
        for receiver in (found.heads(sender) if sender in found.senders else []):
            if "+" in receiver:
                continue
            kind, layer, head = receiver.split(".")
            cells[f"{kind} {head}", int(layer)] = found.reached(sender, receiver)
        rows = sorted({r for r, _ in cells}, key=lambda r: (r.split()[0], int(r.split()[1][1:])))
        z = np.full((len(rows), n), np.nan)
        for (row, layer), fall in cells.items():
            z[rows.index(row), layer] = fall
        fig.add_trace(go.Heatmap(z=z, x=[str(l) for l in range(n)], y=rows, colorscale="RdBu_r", zmin=-1, zmax=1,
                                 zmid=0, hoverongaps=False, showscale=i == 1,
                                 colorbar=dict(title="sink's fall", orientation="h", x=0.5, xanchor="center", y=-0.12,
                                               yanchor="top", len=0.6, thickness=12),
                                 hovertemplate=f"{sender} removed from layer %{{x}}'s %{{y}}: the sink falls by "
                                               "%{z:.1%} in the layers it can move<extra></extra>"),
                      row=i, col=1)
        fig.update_yaxes(autorange="reversed", row=i, col=1)
    layout(fig, "path patching: which heads read each write", height=max(170, 22 * max(len(rows), 4)) * len(senders)
           + 170)
    fig.update_xaxes(title="receiver's layer", type="category", row=len(senders), col=1)
    return fig
