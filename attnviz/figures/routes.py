"""Contribution graphs (docs/methods.md#routes): tokens across, layers up, edge width the contribution; the sink key's
attention edges in their own colour; several recipes side by side on one scale. Pure functions of
:class:`attnviz.flow.Graph`."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnviz.figures.style import layout, token_text

MAX_EDGES = 600  # edges drawn per graph (the heaviest): the browser draws a graph of 256 tokens within a second
COLOURS = {"attn": "#1f77b4", "sink": "#d62728", "mlp": "#2ca02c", "residual": "#b0b0b0"}
NAMES = {"attn": "attention", "sink": "attention from the sink key", "mlp": "MLP", "residual": "residual"}
WIDTHS = (0.1, 0.2, 0.35, 0.6, 1.01)  # weight buckets: one trace each (Plotly draws one width per trace)
#: The token axis: at most MAX_LABELS labels across the figure (shared by its panels), each at most LABEL_CHARS
#: long, slanted at TICK_ANGLE in TICK_FONT px: side by side at 45° a label takes TICK_FONT / sin 45° ≈ 16 px of
#: width, and 24 of them fit a 700 px figure (Streamlit's narrowest column) with room to spare; BOTTOM px below the
#: plot hold the labels, the axis title and the legend.
MAX_LABELS, LABEL_CHARS, TICK_ANGLE, TICK_FONT, BOTTOM = 24, 10, -45, 11, 140


def token_ticks(tokens: list[str], panels: int = 1) -> tuple[list[int], list[str], int]:
    """(positions, labels, stride) of a panel's token axis: at most ``MAX_LABELS`` over the figure's width, shared by
    its ``panels``, every ``stride``-th token; a label is the token (its position first when not every token is
    labelled), whitespace as escapes, cut to ``LABEL_CHARS``. A node's hover names its token either way."""
    room = max(4, MAX_LABELS // panels)
    stride = -(-len(tokens) // room)
    ticks = list(range(0, len(tokens), stride))
    labels = [token_text(tokens[t]) if stride == 1 else f"{t} {token_text(tokens[t])}" for t in ticks]
    return ticks, [s if len(s) <= LABEL_CHARS else s[:LABEL_CHARS - 1] + "…" for s in labels], stride


def level(layer: int, point: str) -> int:
    """The y of a node: 0 the first layer's input, 2l+1 after layer l's attention, 2l+2 after its MLP."""
    return 0 if layer < 0 else 2 * layer + (1 if point == "attn" else 2)


def drawn(graph, max_edges: int = MAX_EDGES) -> list:
    """The edges a figure draws: the heaviest ``max_edges``."""
    edges = sorted(graph.edges, key=lambda e: -e.weight)
    return edges[:max_edges]


def _category(graph, edge) -> str:
    if edge.via == "attn":
        return "sink" if edge.source == graph.flow.sink_keys[edge.layer] else "attn"
    return edge.via


def routes_figure(graphs: list, titles: list[str], max_edges: int = MAX_EDGES) -> go.Figure:
    """One panel per graph, side by side, on one width scale (a contribution of 1 is the widest line).

    Clickable points: each edge's midpoint (customdata ``[layer, head or -1, via, from, to, weight, panel]``) and each
    node (customdata ``[layer, point, token, panel]``)."""
    fig = make_subplots(rows=1, cols=len(graphs), shared_yaxes=True, subplot_titles=titles,
                        horizontal_spacing=0.04)
    shown: set = set()
    for col, graph in enumerate(graphs, start=1):
        edges = drawn(graph, max_edges)
        mids = {"x": [], "y": [], "data": [], "text": []}
        for category in ("residual", "mlp", "attn", "sink"):
            for lo, hi in zip((0.0,) + WIDTHS[:-1], WIDTHS):
                xs, ys = [], []
                for e in edges:
                    if _category(graph, e) != category or not lo <= e.weight < hi:
                        continue
                    (la, pa), (lb, pb) = e.levels
                    ya, yb = level(la, pa), level(lb, pb)
                    xs += [e.source, e.target, None]
                    ys += [ya, yb, None]
                    mids["x"].append((e.source + e.target) / 2)
                    mids["y"].append((ya + yb) / 2)
                    mids["data"].append([e.layer, -1 if e.head is None else e.head, e.via, e.source, e.target,
                                         round(e.weight, 4), col - 1])
                    head = "" if e.head is None else f" head {e.head}"
                    mids["text"].append(f"layer {e.layer} {NAMES[category]}{head}: {e.source} → {e.target}, "
                                        f"{e.weight:.3f}")
                if xs:
                    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", hoverinfo="skip", name=NAMES[category],
                                             legendgroup=category, showlegend=category not in shown,
                                             line=dict(color=COLOURS[category], width=1 + 9 * (lo + hi) / 2)),
                                  row=1, col=col)
                    shown.add(category)
        fig.add_trace(go.Scatter(x=mids["x"], y=mids["y"], mode="markers", customdata=mids["data"],
                                 text=mids["text"], hovertemplate="%{text}<extra></extra>", showlegend=False,
                                 marker=dict(size=7, color="rgba(0,0,0,0.05)")), row=1, col=col)
        nodes = sorted(graph.nodes())
        tokens = graph.flow.tokens
        fig.add_trace(go.Scatter(
            x=[t for _, _, t in nodes], y=[level(l, p) for l, p, _ in nodes], mode="markers", showlegend=False,
            customdata=[[l, p, t, col - 1] for l, p, t in nodes],
            text=[f"token {t} {tokens[t]!r} after {'the input' if l < 0 else f'layer {l} {p}'}" for l, p, t in nodes],
            hovertemplate="%{text}<extra></extra>", marker=dict(size=6, color="#333333")), row=1, col=col)
        ticks, labels, stride = token_ticks(tokens, len(graphs))
        fig.update_xaxes(tickvals=ticks, ticktext=labels, tickangle=TICK_ANGLE, tickfont=dict(size=TICK_FONT),
                         range=[-1, len(tokens)], title="token" if stride == 1 else f"token (every {stride})",
                         row=1, col=col)
    n_layers = graphs[0].flow.n_layers
    step = max(1, n_layers // 10)
    fig.update_yaxes(tickvals=[0] + [level(l, "mlp") for l in range(0, n_layers, step)],
                     ticktext=["input"] + [f"layer {l}" for l in range(0, n_layers, step)], range=[-1, 2 * n_layers + 1],
                     row=1, col=1)
    chosen = graphs[0]
    layout(fig, f"routes of token {chosen.token} {chosen.flow.tokens[chosen.token]!r} (τ = {chosen.threshold})",
           height=640)
    # the legend at the foot of the figure, below the slanted token labels (not over them)
    return fig.update_layout(legend=dict(orientation="h", yref="container", y=0, yanchor="bottom"),
                             margin=dict(b=BOTTOM))


def sink_share_figure(graphs: list, titles: list[str], shares_all: list[list]) -> go.Figure:
    """Per layer, the share of the kept attention flow that comes from the sink key: the chosen token's graph (solid)
    and every query of the text (dotted), one colour per recipe."""
    fig = go.Figure()
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    for i, (graph, title, every) in enumerate(zip(graphs, titles, shares_all)):
        layers = list(range(graph.flow.n_layers))
        chosen = [np.nan if s is None else s for s in graph.sink_share()]
        everyone = [np.nan if s is None else s for s in every]
        colour = palette[i % len(palette)]
        fig.add_trace(go.Scatter(x=layers, y=chosen, mode="lines+markers", name=f"{title}: token {graph.token}",
                                 line=dict(color=colour)))
        fig.add_trace(go.Scatter(x=layers, y=everyone, mode="lines", name=f"{title}: every query",
                                 line=dict(color=colour, dash="dot")))
    layout(fig, "share of the kept attention flow from the sink key", height=340)
    fig.update_yaxes(range=[0, 1.02], tickformat=".0%", title="from the sink key")
    return fig.update_xaxes(title="layer")
