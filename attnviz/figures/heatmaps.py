"""Attention heatmaps: one head or the head mean, side-by-side panels, and the layer × head overview."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnviz.capture import Capture
from attnviz.figures.style import (
    COLORSCALE,
    HOVER_MAX,
    MAX_PX,
    colour_range,
    layout,
    matrix_traces,
    max_pool,
    scaled,
    token_axis,
)
from attnviz.stats import metrics


def head_label(cap: Capture, head: int | None) -> str:
    if head is None:
        return "mean over heads"
    group = cap.kv_groups[head]
    return f"head {head} (KV group {group})" if cap.n_heads != len(set(cap.kv_groups)) else f"head {head}"


#: What a heatmap can show (the page's "Show" selector): name -> colour-bar label.
MODES = {"weight": "attention", "value": "||A·f(v)||", "logits": "QKᵀ/√d", "rollout": "rollout"}
HOVER = {"weight": "p", "value": "norm", "logits": "score", "rollout": "r"}


def mode_values(cap: Capture, layer: int, mode: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """((H, n, n) or (1, n, n) values, (n, n) cells to show) of a heatmap mode.

    weight: post-softmax A; value: ||A[i, j] W_O v_j|| (Kobayashi et al.); logits: pre-softmax
    scores (masked cells apart); rollout: attention rollout of layers 0..layer (head means, with
    the residual identity), all cells shown since it composes layers whose masks differ.
    """
    if mode == "weight":
        return cap.layer_view(layer)  # a long capture's pooled maps where it kept no full ones
    if mode == "value":
        return cap.value_view(layer)  # pooled for a long capture, like the weights
    if mode == "logits":
        return cap.scores_view(layer)
    if mode == "rollout":
        maps = [cap.layer_probs(l).mean(0) for l in range(layer + 1)]
        return metrics.rollout(maps)[None], np.ones((cap.n_tokens, cap.n_tokens), dtype=bool)
    raise ValueError(f"unknown heatmap mode {mode!r}; expected one of {', '.join(MODES)}")


def layer_matrix(cap: Capture, layer: int, head: int | None = None, row_normalise: bool = False,
                 mode: str = "weight") -> np.ndarray:
    """(n, n) values of one head (or the head mean) with NaN where the mask forbids the cell."""
    probs, allowed = mode_values(cap, layer, mode)
    one = head is None or len(probs) == 1
    values = probs.mean(0) if one else probs[head]
    values = np.where(metrics.head_cells(allowed, None if one else head), values, np.nan)
    if row_normalise:
        with np.errstate(invalid="ignore", divide="ignore"):
            values = values / np.nanmax(values, axis=1, keepdims=True)
    return values


def learned_column(cap: Capture, layer: int, head: int | None = None) -> np.ndarray | None:
    """(m,) the share of each row the model's learned sink takes (docs/methods.md#the-learned-sink-as-a-key), of one
    head or the head mean, max-pooled over the rows as the layer's map is (a long capture's pooled maps); None where
    the model has no learned sink."""
    share = cap.learned_sink.get(layer)
    if share is None:
        return None
    column = share.mean(0) if head is None else share[head]
    return max_pool(column.astype(np.float32)[:, None], 1, cap.pool_factor(layer))[:, 0]


def _sink_trace(column: np.ndarray, zmin: float, zmax: float, log: bool, scale: int) -> go.Heatmap:
    """The learned sink as a column of its own left of key 0 (x = −``scale``), on the map's colour scale; pooled
    further, as the map's image is, where it has more rows than the map's hover shows."""
    factor = int(np.ceil(len(column) / MAX_PX)) if len(column) > HOVER_MAX else 1
    column = max_pool(column[:, None], 1, factor)[:, 0] if factor > 1 else column
    return go.Heatmap(z=scaled(column, log)[:, None], customdata=column[:, None], x0=-scale, dx=scale, y0=0,
                      dy=scale * factor, colorscale=COLORSCALE, zmin=zmin, zmax=zmax, showscale=False,
                      hoverongaps=False, name="learned sink", xgap=0, ygap=0,
                      hovertemplate="query %{y}<br>learned sink<br>p = %{customdata:.4f}<extra></extra>")


def heatmap(cap: Capture, layer: int, head: int | None = None, log: bool = False, row_normalise: bool = False,
            zrange: tuple[float, float] | None = None, title: str | None = None, mode: str = "weight") -> go.Figure:
    """One attention map, queries down, keys across; grey cells are masked, white ones got ~0. A model's learned
    sink (gpt-oss) is a column of its own, "sink", left of key 0, on the same colour scale (attention weights only).

    Logits can be negative: they get their own range and a linear scale (no log, no row norm).
    """
    normalise = row_normalise and mode != "logits"
    sink = learned_column(cap, layer, head) if mode == "weight" else None
    values = layer_matrix(cap, layer, head, normalise and sink is None, mode)
    if sink is not None and normalise:  # the learned sink is part of each row: normalised with its keys
        with np.errstate(invalid="ignore", divide="ignore"):
            top = np.fmax(np.nanmax(np.where(np.isnan(values), -np.inf, values), axis=1), sink)
            values, sink = values / top[:, None], sink / top
    if mode == "logits":
        log, finite = False, values[np.isfinite(values)]
        zrange = zrange or ((float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0))
    zmin, zmax = zrange or colour_range([values] + ([] if sink is None else [sink]), log)
    label = "row-normalised" if normalise else MODES[mode]
    traces, _ = matrix_traces(values, None, None, zmin, zmax, log, colorbar_title=label,
                              hover_name=HOVER[mode], scale=cap.pool_factor(layer))
    fig = go.Figure(traces + ([] if sink is None else [_sink_trace(sink, zmin, zmax, log, cap.pool_factor(layer))]))
    shown = "rollout of layers 0–" + str(layer) if mode == "rollout" else head_label(cap, head)
    suffix = {"weight": "", "value": " · value-weighted", "logits": " · pre-softmax", "rollout": ""}[mode]
    title = title or f"layer {layer} · {cap.layer_masks[layer]} · {shown}{suffix}"
    layout(fig, title, height=560, masked_bg=True)
    cross = cap.query_tokens is not None  # cross-attention: target tokens down, source tokens across
    keys = token_axis(cap.tokens)
    if sink is not None and "tickvals" in keys:  # the learned sink's column has a label of its own
        keys.update(tickvals=[-1] + keys["tickvals"], ticktext=["sink"] + keys["ticktext"])
    elif sink is not None:
        fig.add_annotation(x=-cap.pool_factor(layer), y=1, xref="x", yref="paper", text="sink", showarrow=False,
                           yanchor="bottom", font=dict(size=10))
    fig.update_xaxes(title_text="source (key)" if cross else "key", side="bottom", **keys, constrain="domain")
    fig.update_yaxes(title_text="target (query)" if cross else "query", autorange="reversed", scaleanchor="x",
                     constrain="domain",
                     **token_axis(cap.row_tokens))
    rows = cap.row_tokens
    if max(len(rows), cap.n_tokens) <= 96:
        cols = cap.tokens
        fig.data[0].update(
            text=[[f"{rows[i]!r} → {cols[j]!r}" for j in range(len(cols))] for i in range(len(rows))],
            hovertemplate="%{text}<br>query %{y}, key %{x}<br>"
                          + HOVER[mode] + " = %{customdata:.4f}<extra></extra>")
    return fig


def region_heatmap(region, head: int | None = None, log: bool = False, title: str | None = None) -> go.Figure:
    """A zoomed region (:func:`attnviz.regions.region`) at full resolution: token labels, hover values,
    axes in the text's token positions."""
    values = region.values.mean(0) if head is None else region.values[head]
    values = np.where(region.allowed, values, np.nan)
    zmin, zmax = colour_range([values], log)
    (q0, q1), (k0, k1) = region.queries, region.keys
    traces, _ = matrix_traces(values, None, None, zmin, zmax, log, origin=(q0, k0))
    fig = go.Figure(traces)
    shown = "mean over heads" if head is None else f"head {head}"
    layout(fig, title or f"layer {region.layer} · {region.mask} · {shown} · queries {q0}–{q1 - 1} × keys {k0}–{k1 - 1}",
           height=560, masked_bg=True)
    fig.update_xaxes(title_text="key", side="bottom", constrain="domain", **token_axis(region.col_tokens, start=k0))
    fig.update_yaxes(title_text="query", autorange="reversed", scaleanchor="x", constrain="domain",
                     **token_axis(region.row_tokens, start=q0))
    rows, cols = region.row_tokens, region.col_tokens
    fig.data[0].update(text=[[f"{rows[i]!r} → {cols[j]!r}" for j in range(len(cols))] for i in range(len(rows))],
                       hovertemplate="%{text}<br>query %{y}, key %{x}<br>p = %{customdata:.4g}<extra></extra>")
    return fig


def panels(caps: list[Capture], titles: list[str], layer: int, head: int | None = None, log: bool = False,
           row_normalise: bool = False, title: str | None = None) -> go.Figure:
    """Several maps side by side with one shared colour scale, keys across and queries down; ``title`` defaults to
    the layer and the head shown."""
    values = [layer_matrix(c, layer, head, row_normalise) for c in caps]
    zmin, zmax = colour_range(values, log)
    fig = make_subplots(rows=1, cols=len(caps), subplot_titles=titles, horizontal_spacing=0.04)
    for col, (v, cap) in enumerate(zip(values, caps), start=1):
        traces, _ = matrix_traces(v, None, None, zmin, zmax, log, show_scale=col == len(caps),
                                  scale=cap.pool_factor(layer))
        for t in traces:
            fig.add_trace(t, row=1, col=col)
        fig.update_yaxes(autorange="reversed", scaleanchor=f"x{col if col > 1 else ''}", constrain="domain",
                         row=1, col=col)
        fig.update_xaxes(title_text="key", constrain="domain", row=1, col=col)
    fig.update_yaxes(title_text="query", row=1, col=1)
    title = title or f"layer {layer} · {head_label(caps[0], head)}" + (" · row-normalised" if row_normalise else "")
    return layout(fig, title, height=400, masked_bg=True)


def overview_tiles(cap: Capture, tile: int = 12) -> np.ndarray:
    """Mosaic of every recorded (layer, head) map max-pooled to ``tile`` a side: (L*tile, H*tile), in p."""
    rows = []
    for layer in cap.layers:
        probs, allowed = cap.layer_view(layer)
        row = []
        for head in range(cap.n_heads):
            pooled = max_pool(np.where(metrics.head_cells(allowed, head), probs[head], np.nan), tile)
            full = np.full((tile, tile), np.nan)
            full[: pooled.shape[0], : pooled.shape[1]] = pooled
            row.append(full)
        rows.append(np.concatenate(row, axis=1))
    return np.concatenate(rows, axis=0).astype(np.float32)  # half the bytes the browser parses


def overview(cap: Capture, tile: int = 12, log: bool = False) -> go.Figure:
    """Small multiples: one tile per layer (rows) and head (columns). Click a tile to open it.

    Kept whole with the capture (a slider move redraws it unchanged); the tile borders are one
    list of shapes, since ``add_vline`` costs ~30 ms a line."""
    return cap.memo(("overview_figure", tile, log), lambda: _overview(cap, tile, log))


def _overview(cap: Capture, tile: int, log: bool) -> go.Figure:
    # pooled once per capture, scaled per figure: max-pooling commutes with the (increasing) log scale
    mosaic = cap.memo(("overview_mosaic", tile), lambda: overview_tiles(cap, tile))
    zmin, zmax = colour_range([mosaic], log)
    mosaic = scaled(mosaic, log)
    # Clicks go to one invisible marker per tile: Streamlit's selections ignore heatmap cells (streamlit#8760)
    layer_idx, head_idx = np.meshgrid(np.arange(len(cap.layers)), np.arange(cap.n_heads), indexing="ij")
    centre = tile / 2 - 0.5
    fig = go.Figure([go.Heatmap(z=mosaic, colorscale="Blues", zmin=zmin, zmax=zmax, hoverinfo="skip",
                                colorbar=dict(title="log10 p" if log else "p", len=0.6), hoverongaps=False),
                     go.Scatter(x=(head_idx * tile + centre).ravel(), y=(layer_idx * tile + centre).ravel(),
                                mode="markers", showlegend=False,
                                customdata=np.stack([np.asarray(cap.layers)[layer_idx.ravel()], head_idx.ravel()], -1),
                                marker=dict(size=max(6, tile), opacity=0), selected=dict(marker=dict(opacity=0)),
                                unselected=dict(marker=dict(opacity=0)),
                                hovertemplate="layer %{customdata[0]}, head %{customdata[1]}<extra></extra>")])
    rows, cols = len(cap.layers) * tile, cap.n_heads * tile
    borders = [dict(type="line", x0=k * tile - 0.5, x1=k * tile - 0.5, y0=-0.5, y1=rows - 0.5,
                    line=dict(color="white", width=2)) for k in range(1, cap.n_heads)]
    borders += [dict(type="line", y0=k * tile - 0.5, y1=k * tile - 0.5, x0=-0.5, x1=cols - 0.5,
                     line=dict(color="white", width=1)) for k in range(1, len(cap.layers))]
    side = tile_px(cap.n_heads)  # each map square: the figure's size from its rows and columns
    layout(fig, "every layer × head (click a tile)", masked_bg=True)
    fig.update_layout(shapes=list(fig.layout.shapes) + borders, margin=OVERVIEW_MARGIN,
                      width=max(OVERVIEW_MIN_WIDTH, OVERVIEW_MARGIN["l"] + OVERVIEW_MARGIN["r"] + cap.n_heads * side),
                      height=OVERVIEW_MARGIN["t"] + OVERVIEW_MARGIN["b"] + len(cap.layers) * side)
    # fixed ranges: autorange would pad for the markers and show grey outside the mosaic
    fig.update_xaxes(tickmode="array", tickvals=[h * tile + centre for h in range(cap.n_heads)], range=[-0.5, cols - 0.5],
                     ticktext=[f"h{h}·g{cap.kv_groups[h]}" for h in range(cap.n_heads)], title="head · KV group")
    fig.update_yaxes(tickmode="array", tickvals=[i * tile + centre for i in range(len(cap.layers))],
                     ticktext=[str(l) for l in cap.layers], range=[rows - 0.5, -0.5], title="layer",
                     scaleanchor="x", scaleratio=1, constrain="domain")  # square where the page is narrower too
    fig.update_xaxes(constrain="domain")
    return fig


OVERVIEW_MARGIN = {"l": 70, "r": 110, "t": 50, "b": 64}  # r: the colour bar; l, b: the ticks and titles, unpushed
OVERVIEW_MIN_WIDTH = 420  # the title's width: a model of few heads gets a narrower plot, its tiles still square


def tile_px(n_heads: int, page: int = 960, largest: int = 24, smallest: int = 8) -> int:
    """The side in pixels of one map of the overview: as many heads as fit ``page`` pixels, no larger than
    ``largest`` (a model of few heads would get tiles a page tall) and no smaller than ``smallest``."""
    return max(smallest, min(largest, page // max(n_heads, 1)))


def tile_at(cap: Capture, x: float, y: float, tile: int = 12) -> tuple[int, int]:
    """The (layer, head) under a click on :func:`overview`."""
    return cap.layers[min(int(y) // tile, len(cap.layers) - 1)], min(int(x) // tile, cap.n_heads - 1)
