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
from attnviz.figures.heatmaps import heatmap
from attnviz.figures.routes import TICK_ANGLE, TICK_FONT, token_ticks
from attnviz.figures.sinks import PART_COLOURS
from attnviz.figures.style import layout, log_ticks

COLUMNS = ("step", "layer", "head", "loss", "alpha0", "sink_rate", "first_token", "value_drain", "residual_peak",
           "entropy", "kind", "arch", "hash", "seed")
#: the measures the figures draw -> their axis label
LABELS = {"first_token": "attention on the first token", "alpha0": "α₀ (first key's share)",
          "sink_rate": "sink rate", "value_drain": "value drain", "residual_peak": "residual peak",
          "entropy": "attention entropy", "loss": "loss on the probe"}
#: the stacked panels' axis titles: short, two lines at most, so that four panels' titles fit a paper column's height
SHORT = {"first_token": "first<br>token", "alpha0": "α₀", "value_drain": "value<br>drain",
         "residual_peak": "residual<br>peak", "loss": "loss"}
SINKS = ("first_token", "alpha0")  # what the sink panel may show
PANELS = ("value_drain", "residual_peak", "loss")  # under the sink panel, in Guo et al.'s order
COLOURS = ("#1f4e9c", "#e15759", "#59a14f", "#f28e2b", "#76b7b2", "#b07aa1", "#9c755f", "#edc948", "#bab0ac",
           "#ff9da7")
#: one figure, two encodings: a head is a colour (COLOURS), a layer a line style and marker (DASHES, SYMBOLS); a
#: layer's own line (the residual peak, a layer's mean over heads) is drawn in LAYER_COLOUR, which no head has
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "star", "cross", "triangle-down")
LAYER_COLOUR, LOSS_COLOUR = "#333333", "#7f7f7f"
#: the settings of a run that tell runs apart in a legend (Setup's fields, docs/lab.md), as the legend writes them
SETTINGS = {"seed": "seed", "weight_decay": "wd", "lr": "lr", "optimizer": "", "momentum": "momentum",
            "steps": "steps", "layers": "layers", "width": "width", "heads": "heads", "mlp": "mlp", "batch": "batch",
            "warmup": "warm-up", "every": "every"}


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


def _step_axis(fig: go.Figure, shown: pd.DataFrame, log_steps: bool) -> None:
    """The step axis: log-scaled with its ticks written out whole (100, 200, 500, 1000), or linear."""
    if log_steps and not shown.empty:
        fig.update_xaxes(type="log", **log_ticks(float(shown["step"].min()), float(shown["step"].max())))
    else:
        fig.update_xaxes(type="log" if log_steps else "linear")


def _style(layer: int | None, head: int | None) -> tuple[str, str, str]:
    """(colour, dash, marker) of a line: a head's colour (a layer's own line in LAYER_COLOUR), its layer's dash and
    marker (no layer: solid circles)."""
    colour = LAYER_COLOUR if head is None else COLOURS[head % len(COLOURS)]
    if layer is None:
        return colour, "solid", "circle"
    return colour, DASHES[layer % len(DASHES)], SYMBOLS[layer % len(SYMBOLS)]


def curves_figure(frame: pd.DataFrame, sink: str = "first_token", per_head: bool = True, at: int | None = None,
                  log_steps: bool = True, title: str | None = None) -> go.Figure:
    """One run over its checkpoints, as Guo et al. 2024 lay a sink's emergence out: the sink (``first_token`` or
    ``alpha0``: each head, or each layer's mean over heads), the value drain, the residual peak and the loss,
    stacked on one shared step axis (log-scaled by default: the checkpoints are log-spaced early, and the ticks are
    whole numbers). ``at`` marks one step on every curve. A head is a colour and a layer a line style and marker, in
    every panel, and the legend shows each once under a title that says so (a head's entry shows or hides that head
    in every layer): the residual peak, a layer's own, is its layer's style in ``LAYER_COLOUR``, which no head has. The panels' axis titles are short (:data:`SHORT`); the hover names the
    measure in full."""
    frame = checked(frame)
    if sink not in SINKS:
        raise InputError(f"the sink panel shows {' or '.join(SINKS)}, not {sink!r}")
    shown = _shown(frame, log_steps)
    names = [sink, *PANELS]
    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=True, vertical_spacing=0.04)
    layers = sorted(int(l) for l in frame["layer"].unique())
    heads = sorted(int(h) for h in frame["head"].unique())
    for row, column in enumerate(names, start=1):
        if column == "loss":
            groups = [("loss", "loss", _mean_by(shown, "loss", ["step"]), (LOSS_COLOUR, "solid", "circle"))]
        elif per_head and column != "residual_peak":
            parts = shown.sort_values(["layer", "head", "step"])
            groups = [(f"layer {l} head {h}", f"head {h}", part, _style(int(l), int(h)))
                      for (l, h), part in parts.groupby(["layer", "head"], sort=True)]
        else:
            groups = [(f"layer {l}" + ("" if column == "residual_peak" else ", mean of heads"), f"layer {l}",
                       _mean_by(shown[shown["layer"] == l], column, ["step"]), _style(l, None)) for l in layers]
        for name, group, part, (colour, dash, symbol) in groups:
            part = part.sort_values("step")
            fig.add_trace(go.Scatter(
                x=part["step"].tolist(), y=part[column].astype(float).tolist(), mode="lines+markers", name=name,
                legendgroup=group, showlegend=name == "loss", legendrank=2000 if name == "loss" else 1000,
                line=dict(color=colour, width=1.6, dash=dash),
                marker=dict(size=5, symbol=symbol, color=colour),
                hovertemplate=f"{name}<br>step %{{x}}<br>{LABELS[column]} %{{y:.4g}}<extra></extra>"), row=row, col=1)
            if at is not None and (part["step"] == at).any():
                value = float(part.loc[part["step"] == at, column].iloc[0])
                fig.add_trace(go.Scatter(x=[at], y=[value], mode="markers", showlegend=False, hoverinfo="skip",
                                         marker=dict(symbol="circle-open", size=11, color="black")), row=row, col=1)
        fig.update_yaxes(title_text=SHORT[column], row=row, col=1)
    keys = [(f"head {h}", "lines", (COLOURS[h % len(COLOURS)], "solid", "circle")) for h in heads if per_head]
    for name, mode, (colour, dash, symbol) in keys + [(f"layer {l}", "lines+markers", _style(l, None))
                                                      for l in layers]:  # the legend: each encoding once
        fig.add_trace(go.Scatter(x=[None], y=[None], mode=mode, name=name, legendgroup=name, hoverinfo="skip",
                                 line=dict(color=colour, width=1.6, dash=dash),
                                 marker=dict(size=6, symbol=symbol, color=colour)), row=1, col=1)
    fig.update_yaxes(range=[0, 1.02], row=1, col=1)
    _step_axis(fig, shown, log_steps)
    fig.update_xaxes(title_text="training step" + (" (log scale; step 0 not drawn)" if log_steps else ""),
                     row=len(names), col=1)
    layout(fig, title or f"{run_label(frame)}, seed {frame['seed'].iloc[0]}: the sink forming", height=760)
    fig.update_layout(legend=dict(orientation="v", x=1.02, y=1, title_text=(
        "colour: head,<br>line and marker: layer" if per_head else "line and marker: layer")))
    return fig


def _setting(setup: dict, key: str):
    return setup.get(key) if not key.startswith("task.") else (setup.get("task") or {}).get(key[5:])


def _word(key: str, value) -> str:
    """A setting as a legend writes it: ``wd 0.1``, ``seed 0``, ``sgd``, ``vocab 16``."""
    shown = f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
    return f"{SETTINGS.get(key, key[5:])} {shown}".strip()


def run_labels(setups: list[dict], names: list[str]) -> list[str]:
    """Each run's legend entry: its kind · mask, then each setting in which it differs from a run of the same kind
    and mask (``softmax · fwd · wd 0.1 · seed 0``; the task's own settings too), and where two runs still read the
    same (their setups are equal), their folder names ``names``."""
    base = [f"{s.get('kind', '?')} · {s.get('arch', '?')}" for s in setups]
    keys = [*SETTINGS, *sorted({f"task.{k}" for s in setups for k in (s.get("task") or {})})]
    labels = []
    for i, setup in enumerate(setups):
        twins = [s for j, s in enumerate(setups) if base[j] == base[i]]
        differ = [k for k in keys if len({repr(_setting(s, k)) for s in twins}) > 1]
        words = [_word(k, _setting(setup, k)) for k in differ]
        labels.append(" · ".join([base[i], *words]))
    return [f"{lab} · {name}" if labels.count(lab) > 1 else lab for lab, name in zip(labels, names)]


def runs_figure(frames: list[pd.DataFrame], sink: str = "first_token", layer: int | None = None,
                log_steps: bool = True, title: str | None = None, setups: list[dict] | None = None,
                names: list[str] | None = None) -> go.Figure:
    """Several runs (kinds, masks, seeds, settings) side by side: each run's ``sink`` (mean over heads, and over
    layers unless ``layer``) over its steps, one line a run, named by :func:`run_labels` from the runs' ``setups``
    (``attnviz_run.json``'s) and folder ``names``; without them, from the tables' kind, arch and seed."""
    if not frames:
        raise InputError("no run to draw")
    if sink not in SINKS:
        raise InputError(f"the sink panel shows {' or '.join(SINKS)}, not {sink!r}")
    frames = [checked(f) for f in frames]
    if setups is None:
        setups = [{"kind": f["kind"].iloc[0], "arch": f["arch"].iloc[0], "seed": int(f["seed"].iloc[0])}
                  for f in frames]
    labels = run_labels(setups, names or [f"run {i + 1}" for i in range(len(frames))])
    fig = go.Figure()
    shown_all = []
    for i, (frame, label) in enumerate(zip(frames, labels)):
        part = _shown(frame, log_steps)
        if layer is not None:
            part = part[part["layer"] == layer]
            if part.empty:
                raise InputError(f"run {label} has no layer {layer}")
        shown_all.append(part)
        mean = _mean_by(part, sink, ["step"])
        fig.add_trace(go.Scatter(x=mean["step"].tolist(), y=mean[sink].astype(float).tolist(), mode="lines+markers",
                                 name=label, line=dict(color=COLOURS[i % len(COLOURS)], width=1.8),
                                 marker=dict(size=4),
                                 hovertemplate=f"{label}<br>step %{{x}}<br>{LABELS[sink]} %{{y:.3f}}<extra></extra>"))
    where = "mean over heads" + (f", layer {layer}" if layer is not None else " and layers")
    layout(fig, title or f"{LABELS[sink]} over training, {where}", height=420)
    _step_axis(fig, pd.concat(shown_all), log_steps)
    fig.update_xaxes(title_text="training step" + (" (log scale)" if log_steps else ""))
    fig.update_yaxes(title_text=LABELS[sink], range=[0, 1.02])
    return fig


def checkpoint_map(cap, layer: int, head: int | None = None, title: str | None = None) -> go.Figure:
    """A checkpoint's attention map on its probe (:func:`attnviz.figures.heatmaps.heatmap`), its token axes labelled
    as the Routes page labels its own (:func:`attnviz.figures.routes.token_ticks`): at most 24 labels a side, every
    k-th token with its position first, keys slanted, so that a 64-token probe's labels read; a learned sink's
    column keeps its label."""
    fig = heatmap(cap, layer, head, title=title)
    keys, key_labels, stride = token_ticks(cap.tokens)
    rows, row_labels, row_stride = token_ticks(cap.row_tokens)
    if (fig.layout.xaxis.ticktext or ("",))[0] == "sink":  # a learned sink's column keeps its label (gpt-oss)
        keys, key_labels = [-1, *keys], ["sink", *key_labels]
    fig.update_xaxes(tickmode="array", tickvals=keys, ticktext=key_labels, tickangle=TICK_ANGLE,
                     tickfont=dict(size=TICK_FONT), title_text="key" + ("" if stride == 1 else f" (every {stride})"))
    return fig.update_yaxes(tickmode="array", tickvals=rows, ticktext=row_labels, tickfont=dict(size=TICK_FONT),
                            title_text="query" + ("" if row_stride == 1 else f" (every {row_stride})"))


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
