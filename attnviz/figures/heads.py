"""The head taxonomy as a layer × head grid (docs/methods.md#head-classes): one colour per class, every score on hover;
and the scores on repeated random tokens as a grid lettered with the induction, previous-token, duplicate and dormant
classes (docs/methods.md#induction-previous-token-and-duplicate-heads)."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from attnviz.effects.heads import PRECEDENCE, Taxonomy
from attnviz.effects.induction import SCORES, HeadScores
from attnviz.errors import InputError
from attnviz.figures.style import layout

CLASSES = {"retrieval": "#d9d9d9", "sink": "#1f4e9c", "streaming": "#59a14f", "inactive": "#e15759"}


def class_counts(tax: Taxonomy) -> dict[str, tuple[int, int]]:
    """Class -> (heads that hold it, heads whose tile is drawn in it): a head that holds several classes is drawn in
    the first of :data:`PRECEDENCE`; retrieval is a head that holds none."""
    classes = tax.classes()
    held = {"retrieval": classes == "retrieval", "sink": tax.sink, "streaming": tax.streaming,
            "inactive": tax.inactive}
    return {name: (int(held[name].sum()), int((classes == name).sum())) for name in CLASSES}


def held_classes(tax: Taxonomy) -> np.ndarray:
    """(L, H) every class a head holds, joined with " + " in the order of :data:`PRECEDENCE` ("retrieval" for none)."""
    held = [(name, getattr(tax, name)) for name in PRECEDENCE]
    return np.array([[" + ".join(n for n, mask in held if mask[l, h]) or "retrieval" for h in range(tax.sink.shape[1])]
                     for l in range(tax.sink.shape[0])], dtype=object)


def head_classes(tax: Taxonomy) -> go.Figure:
    """Layer (rows, bottom layer on top) × head grid coloured by class; a head that holds several is drawn in the first
    of inactive > streaming > sink (the legend says so, and counts each class's heads as the page's numbers do: every
    head that holds it, and how many are drawn in it). Hover gives every class the head holds, alpha_0, the streaming
    score and the output-norm score; one invisible marker per tile carries clicks (Streamlit ignores selections on
    heatmap cells)."""
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
    held = held_classes(tax)
    text = np.where(held == classes, held, held + " (drawn as " + classes + ")")
    fig.add_trace(go.Scatter(x=head_idx.ravel(), y=layer_idx.ravel(), mode="markers", showlegend=False,
                             text=text.ravel(), customdata=custom.reshape(-1, 3), hovertemplate=hover,
                             marker=dict(size=14, opacity=0), selected=dict(marker=dict(opacity=0)),
                             unselected=dict(marker=dict(opacity=0))))
    total = n_layers * n_heads
    for name, (holds, drawn) in class_counts(tax).items():  # a legend of the classes, counted as the page counts
        shown = f"{name}: {holds} ({holds / total:.0%})" + ("" if drawn == holds else f", {drawn} drawn")
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=shown,
                                 marker=dict(color=CLASSES[name], size=10, symbol="square")))
    layout(fig, f"head taxonomy · {tax.arch} · {tax.samples} sample(s) · eps {tax.eps:g}, streaming ≥ "
                f"{tax.tau_stream:g} (s={tax.s}, w={tax.w}), inactive < {tax.tau_inactive:g}",
           height=max(360, 18 * n_layers + 120))
    fig.update_layout(legend=dict(title_text="heads of " + str(total) + "; a head in several<br>classes is drawn "
                                             "in the first of<br>" + " > ".join(PRECEDENCE)))
    fig.update_xaxes(title="head", range=[-0.5, n_heads - 0.5], dtick=1)
    fig.update_yaxes(title="layer", range=[n_layers - 0.5, -0.5], dtick=max(1, n_layers // 10))
    return fig


LETTERS = {"induction": "I", "prev_token": "P", "duplicate": "D", "dormant": "z"}


def repeated_scores(scores: HeadScores, score: str = "induction") -> go.Figure:
    """Layer (rows, bottom layer on top) × head grid of one score on repeated random tokens
    (docs/methods.md#induction-previous-token-and-duplicate-heads), 0 to 1; each tile lettered with the classes its
    head holds (I induction, P previous-token, D duplicate, z dormant); hover gives every score with its baseline."""
    if score not in SCORES:
        raise InputError(f"unknown score {score!r}: expected one of {', '.join(SCORES)}")
    values = scores[score]
    n_layers, n_heads = values.shape
    held = {name: scores.holds(name) for name in LETTERS}
    letters = np.array([["".join(c for name, c in LETTERS.items() if held[name][l, h]) for h in range(n_heads)]
                        for l in range(n_layers)], dtype=object)
    names = [*SCORES, "quiet_key0", "dormant_ratio"]
    custom = np.stack([np.nan_to_num(scores[n], nan=-1) for n in names]
                      + [np.nan_to_num(scores[f"{s}_baseline"], nan=-1) for s in SCORES], axis=-1)
    hover = ("layer %{y}, head %{x} %{text}<br>induction %{customdata[0]:.3f} (baseline %{customdata[5]:.3f})"
             "<br>previous-token %{customdata[1]:.3f} (baseline %{customdata[6]:.3f})<br>duplicate "
             "%{customdata[2]:.3f} (baseline %{customdata[7]:.3f})<br>quiet queries on key 0 %{customdata[3]:.3f}, "
             "quiet/active output %{customdata[4]:.3f}<extra></extra>")
    fig = go.Figure(go.Heatmap(z=values, zmin=0.0, zmax=1.0, colorscale="Viridis", text=letters,
                               texttemplate="%{text}", customdata=custom, hovertemplate=hover, xgap=1, ygap=1,
                               colorbar=dict(title=score)))
    counts = ", ".join(f"{name} {int(held[name].sum())}" for name in LETTERS)
    layout(fig, f"{score} score on repeated random tokens · L={scores.length}, {scores.samples} sequence(s) · "
                f"tau {scores.tau:g}, dormant: key 0 > {scores.eps:g}, output < {scores.share:g} · {counts}",
           height=max(360, 18 * n_layers + 120))
    fig.update_xaxes(title="head", range=[-0.5, n_heads - 0.5], dtick=1)
    fig.update_yaxes(title="layer", range=[n_layers - 0.5, -0.5], dtick=max(1, n_layers // 10))
    return fig
