"""The Emergence page's figures (docs/app.md#every-page, docs/lab.md): a run's table of measures over its checkpoints
(one row per step, layer and head: ``step, layer, head, loss, alpha0, sink_rate, first_token, value_drain,
residual_peak, entropy, kind, arch, hash, seed``) drawn as Guo et al. 2024 (arXiv 2410.13835) draw a sink forming:
the measures stacked on one shared, log-scaled step axis; several runs' first-token attention side by side; and
each layer's measures at one step. Pure functions of the table: no model, no Streamlit."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnviz.errors import InputError
from attnviz.figures.sinks import PART_COLOURS
from attnviz.figures.style import layout

COLUMNS = ("step", "layer", "head", "loss", "alpha0", "sink_rate", "first_token", "value_drain", "residual_peak",
           "entropy", "kind", "arch", "hash", "seed")
#: the measures the figures draw -> their axis label
LABELS = {"first_token": "attention on the first token", "alpha0": "α₀ (first key's share)",
          "sink_rate": "sink rate", "value_drain": "value drain", "residual_peak": "residual peak",
          "entropy": "attention entropy", "loss": "loss on the probe"}
SINKS = ("first_token", "alpha0")  # what the sink panel may show
PANELS = ("value_drain", "residual_peak", "loss")  # under the sink panel, in Guo et al.'s order
COLOURS = ("#1f4e9c", "#e15759", "#59a14f", "#f28e2b", "#76b7b2", "#b07aa1", "#9c755f", "#edc948", "#bab0ac",
           "#ff9da7")


def checked(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` if it has every column of the table and a row; else one line naming what is missing."""
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise InputError(f"the emergence table has no column {', '.join(missing)}")
    if frame.empty:
        raise InputError("the emergence table is empty: the run has no checkpoint measured")
    return frame


def steps(frame: pd.DataFrame) -> list[int]:
    return sorted(int(s) for s in checked(frame)["step"].unique())


def _shown(frame: pd.DataFrame, log_steps: bool) -> pd.DataFrame:
    """The rows a step axis shows: on a log axis step 0 has no place (the table keeps it; the caption says so)."""
    return frame[frame["step"] > 0] if log_steps else frame


def _mean_by(frame: pd.DataFrame, column: str, by: list[str]) -> pd.DataFrame:
    return frame.groupby(by, as_index=False)[column].mean().sort_values(by)


def run_label(frame: pd.DataFrame) -> str:
    """A run's legend entry: its kind · arch (as its table says)."""
    return f"{frame['kind'].iloc[0]} · {frame['arch'].iloc[0]}"


def curves_figure(frame: pd.DataFrame, sink: str = "first_token", per_head: bool = True, at: int | None = None,
                  log_steps: bool = True, title: str | None = None) -> go.Figure:
    """One run over its checkpoints, as Guo et al. 2024 lay a sink's emergence out: the sink (``first_token`` or
    ``alpha0``: each head, or each layer's mean over heads), the value drain, the residual peak and the loss,
    stacked on one shared step axis (log-scaled by default: the checkpoints are log-spaced early). ``at`` marks
    one step on every curve."""
    frame = checked(frame)
    if sink not in SINKS:
        raise InputError(f"the sink panel shows {' or '.join(SINKS)}, not {sink!r}")
    shown = _shown(frame, log_steps)
    names = [sink, *PANELS]
    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=True, vertical_spacing=0.04)
    layers = sorted(int(l) for l in frame["layer"].unique())
    for row, column in enumerate(names, start=1):
        if column == "loss":
            groups = [("loss", _mean_by(shown, "loss", ["step"]), PART_COLOURS["other"])]
        elif per_head and column != "residual_peak":
            parts = shown.sort_values(["layer", "head", "step"])
            groups = [(f"layer {l} head {h}", part, COLOURS[i % len(COLOURS)])
                      for i, ((l, h), part) in enumerate(parts.groupby(["layer", "head"], sort=True))]
        else:
            groups = [(f"layer {l}" + ("" if column == "residual_peak" else ", mean of heads"),
                       _mean_by(shown[shown["layer"] == l], column, ["step"]), COLOURS[i % len(COLOURS)])
                      for i, l in enumerate(layers)]
        for name, part, colour in groups:
            part = part.sort_values("step")
            fig.add_trace(go.Scatter(
                x=part["step"].tolist(), y=part[column].astype(float).tolist(), mode="lines+markers", name=name,
                legendgroup=name, showlegend=row == 1 or column in ("residual_peak", "loss"), line=dict(color=colour, width=1.6), marker=dict(size=4),
                hovertemplate=f"{name}<br>step %{{x}}<br>{LABELS[column]} %{{y:.4g}}<extra></extra>"), row=row, col=1)
            if at is not None and (part["step"] == at).any():
                value = float(part.loc[part["step"] == at, column].iloc[0])
                fig.add_trace(go.Scatter(x=[at], y=[value], mode="markers", showlegend=False, hoverinfo="skip",
                                         marker=dict(symbol="circle-open", size=11, color="black")), row=row, col=1)
        fig.update_yaxes(title_text=LABELS[column], row=row, col=1)
    fig.update_yaxes(range=[0, 1.02], row=1, col=1)
    fig.update_xaxes(type="log" if log_steps else "linear")
    fig.update_xaxes(title_text="training step" + (" (log scale; step 0 not drawn)" if log_steps else ""),
                     row=len(names), col=1)
    layout(fig, title or f"{run_label(frame)}, seed {frame['seed'].iloc[0]}: the sink forming", height=760)
    fig.update_layout(legend=dict(orientation="v", x=1.02, y=1))
    return fig


def runs_figure(frames: list[pd.DataFrame], sink: str = "first_token", layer: int | None = None,
                log_steps: bool = True, title: str | None = None) -> go.Figure:
    """Several runs (kinds, masks, seeds) side by side: each run's ``sink`` (mean over heads, and over layers unless
    ``layer``) over its steps, one line a run, named by its kind · arch (its seed added where two share them)."""
    if not frames:
        raise InputError("no run to draw")
    if sink not in SINKS:
        raise InputError(f"the sink panel shows {' or '.join(SINKS)}, not {sink!r}")
    frames = [checked(f) for f in frames]
    labels = [run_label(f) for f in frames]
    labels = [f"{lab} · seed {f['seed'].iloc[0]}" if labels.count(lab) > 1 else lab for lab, f in zip(labels, frames)]
    labels = [f"{lab} ({i + 1})" if labels.count(lab) > 1 else lab for i, lab in enumerate(labels)]
    fig = go.Figure()
    for i, (frame, label) in enumerate(zip(frames, labels)):
        part = _shown(frame, log_steps)
        if layer is not None:
            part = part[part["layer"] == layer]
            if part.empty:
                raise InputError(f"run {label} has no layer {layer}")
        mean = _mean_by(part, sink, ["step"])
        fig.add_trace(go.Scatter(x=mean["step"].tolist(), y=mean[sink].astype(float).tolist(), mode="lines+markers",
                                 name=label, line=dict(color=COLOURS[i % len(COLOURS)], width=1.8),
                                 marker=dict(size=4),
                                 hovertemplate=f"{label}<br>step %{{x}}<br>{LABELS[sink]} %{{y:.3f}}<extra></extra>"))
    where = "mean over heads" + (f", layer {layer}" if layer is not None else " and layers")
    layout(fig, title or f"{LABELS[sink]} over training, {where}", height=420)
    fig.update_xaxes(type="log" if log_steps else "linear",
                     title_text="training step" + (" (log scale)" if log_steps else ""))
    fig.update_yaxes(title_text=LABELS[sink], range=[0, 1.02])
    return fig


def layers_figure(frame: pd.DataFrame, step: int, columns: tuple[str, ...] = ("first_token", "value_drain",
                                                                             "residual_peak")) -> go.Figure:
    """Each layer's measures at one ``step``, one panel a measure: a bar for the mean over heads, a dot per head."""
    frame = checked(frame)
    at = frame[frame["step"] == step]
    if at.empty:
        raise InputError(f"the table has no step {step} (its steps: {', '.join(map(str, steps(frame)))})")
    unknown = [c for c in columns if c not in LABELS or c == "loss"]
    if unknown:
        raise InputError(f"no per-layer measure {', '.join(unknown)}")
    fig = make_subplots(rows=1, cols=len(columns), subplot_titles=[LABELS[c] for c in columns],
                        horizontal_spacing=0.08)
    for col, column in enumerate(columns, start=1):
        mean = _mean_by(at, column, ["layer"])
        fig.add_trace(go.Bar(x=mean["layer"].tolist(), y=mean[column].astype(float).tolist(), name="mean of heads",
                             marker_color=PART_COLOURS["first"], opacity=0.75, showlegend=col == 1,
                             hovertemplate=f"layer %{{x}}<br>{LABELS[column]} %{{y:.4g}}<extra></extra>"),
                      row=1, col=col)
        fig.add_trace(go.Scatter(x=at["layer"].tolist(), y=at[column].astype(float).tolist(), mode="markers",
                                 name="one head", marker=dict(color="black", size=6), showlegend=col == 1,
                                 customdata=np.asarray(at["head"]), hovertemplate=(
                                     f"layer %{{x}}, head %{{customdata}}<br>{LABELS[column]} %{{y:.4g}}"
                                     "<extra></extra>")), row=1, col=col)
        fig.update_xaxes(title_text="layer", dtick=1, row=1, col=col)
    layout(fig, f"{run_label(frame)}: each layer at step {step}", height=360)
    return fig
