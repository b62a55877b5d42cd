"""A sweep's results (attnviz.sweep, a DataFrame of its Parquet rows) as figures."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from attnviz.figures.style import layout

PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac"]


def _label(row) -> str:
    parts = [str(row["model"]), str(row["arch"])]
    if row.get("intervention"):
        parts.append(str(row["intervention"]))
    if str(row.get("corpus", "stdlib")) != "stdlib":
        parts.append(str(row["corpus"]))
    return " · ".join(parts)


def ok_rows(frame: pd.DataFrame, measure: str) -> pd.DataFrame:
    if frame.empty or "measure" not in frame:
        return frame
    return frame[(frame["measure"] == measure) & (frame["status"] == "ok")]


def sink_rates(frame: pd.DataFrame) -> go.Figure:
    """Sink rate per layer with its 95 % interval, one line per (model, arch, intervention, corpus)."""
    rows = ok_rows(frame, "sinks")
    fig = go.Figure()
    for i, (cell, group) in enumerate(rows.groupby("cell", sort=False)):
        group = group.sort_values("layer")
        rate = group["sink_rate"].astype(float).to_numpy()
        low, high = group["ci_low"].astype(float).to_numpy(), group["ci_high"].astype(float).to_numpy()
        colour = PALETTE[i % len(PALETTE)]
        fig.add_trace(go.Scatter(x=group["layer"], y=rate * 100, mode="lines+markers", name=_label(group.iloc[0]),
                                 line=dict(color=colour), marker=dict(size=5),
                                 error_y=dict(type="data", symmetric=False, array=(high - rate) * 100,
                                              arrayminus=(rate - low) * 100, thickness=1, width=2, color=colour),
                                 hovertemplate="layer %{x}: %{y:.1f} %<extra>%{fullData.name}</extra>"))
    fig.update_xaxes(title="layer")
    fig.update_yaxes(title="sink rate (%), 95 % interval", range=[0, 100])
    return layout(fig, "sink rate per layer (eps, T as in each cell's options)", height=460)


def compression(frame: pd.DataFrame) -> go.Figure:
    """Perplexity against the compression ratio, one line per press (and model, arch) of every cell."""
    rows = ok_rows(frame, "compress")
    fig = go.Figure()
    dense = rows[rows["press"] == "dense"] if not rows.empty else rows
    for i, ((cell, press), group) in enumerate(rows[rows["press"] != "dense"].groupby(["cell", "press"], sort=False)
                                               if not rows.empty else []):
        base = dense[dense["cell"] == cell]
        group = pd.concat([base.assign(press=press), group]).sort_values("ratio")
        fig.add_trace(go.Scatter(x=group["ratio"], y=group["perplexity"], mode="lines+markers",
                                 name=f"{press} · {_label(group.iloc[0])}", line=dict(color=PALETTE[i % len(PALETTE)])))
    fig.update_xaxes(title="compression ratio (share of the context's keys evicted)")
    fig.update_yaxes(title="perplexity of the continuation", type="log")
    return layout(fig, "KV-cache compression: perplexity against ratio", height=460)


def k_of(arch: str) -> int | None:
    found = re.search(r"\bk\s*=\s*(\d+)", arch)
    return int(found.group(1)) if found else (0 if arch.strip().lower() == "fwd" else None)


def recall_by_k(frame: pd.DataFrame) -> go.Figure:
    """Embedding recall@1 against k (read from each architecture's ``k=``; FWD is k = 0), one line per
    model and architecture template."""
    rows = ok_rows(frame, "embed").copy()
    fig = go.Figure()
    if not rows.empty:
        rows["k"] = [k_of(a) for a in rows["arch"]]
        rows["template"] = [re.sub(r"\(.*\)", "", a).strip() for a in rows["arch"]]
        rows = rows[rows["k"].notna()]
        fwd = rows[rows["template"].str.lower() == "fwd"]
        for i, ((model, template), group) in enumerate(rows[rows["template"].str.lower() != "fwd"]
                                                        .groupby(["model", "template"], sort=False)):
            group = pd.concat([fwd[fwd["model"] == model], group]).sort_values("k")
            fig.add_trace(go.Scatter(x=group["k"], y=group["recall_at_1"], mode="lines+markers",
                                     name=f"{model} · {template}", line=dict(color=PALETTE[i % len(PALETTE)])))
        if not fig.data and not fwd.empty:
            fig.add_trace(go.Scatter(x=fwd["k"], y=fwd["recall_at_1"], mode="markers", name="fwd"))
    fig.update_xaxes(title="k (converted top layers)")
    fig.update_yaxes(title="recall@1", range=[0, 1])
    return layout(fig, "embedding probe: recall@1 against k", height=420)


def summary_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per cell: its parameters, status and headline number."""
    if frame.empty:
        return frame
    head = {"sinks": "model_rate", "eval": "perplexity", "embed": "recall_at_1", "heads": "sink_heads",
            "compress": "perplexity", "emergence": "first_token"}
    out = []
    for cell, group in frame.groupby("cell", sort=False):
        first = group.iloc[0]
        column = head.get(first["measure"])
        value = group[column].astype(float).agg("sum" if first["measure"] == "heads" else "mean") \
            if column in group and first["status"] == "ok" else np.nan
        out.append({"measure": first["measure"], "model": first["model"], "arch": first["arch"],
                    "intervention": first["intervention"], "corpus": first["corpus"], "status": first["status"],
                    "value": value, "what": column, "elapsed_s": first["elapsed_s"], "error": first["error"],
                    "cell": cell})
    return pd.DataFrame(out)


def _spread(mean, low, high, whole: bool) -> str:
    if mean is None or mean != mean:
        return "never"
    form = (lambda v: f"{v:,.0f}") if whole else (lambda v: f"{v:.2f}")
    return form(mean) if low == high else f"{form(mean)} ({form(low)}–{form(high)})"


def grid_figure(table: pd.DataFrame, row: str, col: str, value: str = "sink_step") -> go.Figure:
    """The grid of trained runs (:func:`attnviz.sweep.grid.grid`) as a heatmap: ``value``'s mean per cell, its
    min–max over the cell's runs written in it (the sink step: over the runs where it formed, and in how many)."""
    from attnviz.sweep.grid import LABELS

    rows = [str(v) for v in dict.fromkeys(table[row])]
    cols = [str(v) for v in dict.fromkeys(table[col])]
    z = np.full((len(rows), len(cols)), np.nan)
    text = [["" for _ in cols] for _ in rows]
    for _, cell in table.iterrows():
        i, j = rows.index(str(cell[row])), cols.index(str(cell[col]))
        mean = cell[f"{value}_mean"]
        z[i, j] = np.nan if mean is None else float(mean)
        text[i][j] = _spread(mean, cell[f"{value}_min"], cell[f"{value}_max"], value == "sink_step")
        if value == "sink_step":
            text[i][j] += f"<br>{cell['formed']} of {cell['runs']} runs"
        else:
            text[i][j] += f"<br>{cell['runs']} runs"
    fig = go.Figure(go.Heatmap(z=z, x=cols, y=rows, text=text, texttemplate="%{text}", colorscale="Viridis",
                               colorbar={"title": value}, hovertemplate=f"{row} %{{y}} · {col} %{{x}}<br>%{{text}}"
                                                                        "<extra></extra>"))
    title = f"Trained runs: {LABELS[value]}, {row} × {col} (mean, min–max over runs)"
    layout(fig, title, height=max(320, 120 + 70 * len(rows)))
    fig.update_xaxes(type="category", title=col)
    fig.update_yaxes(type="category", autorange="reversed", title=row)
    return fig
