"""Figures of what a mask does to the model: perplexity per architecture, streaming curves,
embedding k-sweeps and the cached-generation attention view. Pure functions of results."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnviz.effects.embedding import ProbeResult
from attnviz.effects.evaluate import Evaluation
from attnviz.effects.generate import Generation
from attnviz.effects.streaming import StreamResult
from attnviz.figures.style import COLORSCALE, layout

PALETTE = ["#1f4e9c", "#e15759", "#59a14f", "#f28e2b", "#76b7b2", "#b07aa1", "#9c755f", "#bab0ac"]
EVICTED = "#f4c7c3"
#: Legend inside the plot's top-right corner: above the plot it collides with the title at paper sizes.
INSIDE_LEGEND = dict(x=0.99, xanchor="right", y=0.99, yanchor="top", bgcolor="rgba(255,255,255,0.8)")


def perplexity_bars(results: Sequence[Evaluation]) -> go.Figure:
    """Perplexity and next-token accuracy of one text under each architecture, side by side."""
    names = [r.arch for r in results]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.14)  # axis titles, no subplot titles: they
    # would collide with the figure title at the paper presets
    colours = PALETTE[: len(results)] * (1 + len(results) // len(PALETTE))
    fig.add_trace(go.Bar(x=names, y=[r.perplexity for r in results], marker_color=colours,
                         text=[f"{r.perplexity:.2f}" for r in results], textposition="outside", cliponaxis=False,
                         hovertemplate="%{x}<br>perplexity %{y:.3f}<extra></extra>", showlegend=False), 1, 1)
    fig.add_trace(go.Bar(x=names, y=[r.accuracy for r in results], marker_color=colours,
                         text=[f"{r.accuracy:.1%}" for r in results], textposition="outside", cliponaxis=False,
                         hovertemplate="%{x}<br>accuracy %{y:.2%}<extra></extra>", showlegend=False), 1, 2)
    tokens = results[0].tokens if results else 0
    layout(fig, f"perplexity and accuracy per architecture ({tokens} predicted tokens)", height=380)
    fig.update_yaxes(title="perplexity (lower is better)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title="next-token accuracy", tickformat=".0%", rangemode="tozero", row=1, col=2)
    return fig


def streaming_curves(results: Sequence[StreamResult]) -> go.Figure:
    """Running perplexity against token position, one line per cache policy (StreamingLLM Fig. 3).

    A dotted line marks where each evicting policy's cache fills: from there on the window policy
    has dropped the first tokens, and its curve breaks away while sink + window stays with dense.
    """
    fig = go.Figure()
    shown = []
    for colour, result in zip(PALETTE, results):
        curve = result.running_perplexity()
        warm = min(32, max(result.tokens // 10, 1))  # the first tokens' running mean spans decades: not in range
        shown.append(curve[warm:] if curve.size > warm else curve)
        fig.add_trace(go.Scatter(x=np.arange(1, result.tokens + 1), y=curve, mode="lines", name=result.policy,
                                 line=dict(color=colour, width=2),
                                 hovertemplate=f"{result.policy}<br>token %{{x}}<br>running ppl %{{y:.2f}}<extra></extra>"))
    for size in sorted({r.cache_size for r in results if r.cache_size}):
        fig.add_vline(x=size + 1, line=dict(color="#777", dash="dot", width=1),
                      annotation=dict(text=f"cache full ({size})", font_size=11), annotation_position="top right")
    arch = results[0].arch if results else ""
    layout(fig, f"streaming perplexity by position · {arch}", height=420)
    fig.update_xaxes(title="token position")
    if shown:
        low, high = min(float(c.min()) for c in shown), max(float(c.max()) for c in shown)
        fig.update_yaxes(range=[np.log10(low / 1.15), np.log10(high * 1.15)])
    fig.update_yaxes(title="perplexity (running mean NLL)", type="log")
    fig.update_layout(legend=INSIDE_LEGEND)
    return fig


def k_sweep(rows_by_arch: dict[str, Sequence[ProbeResult]], metric: str = "recall_at_1") -> go.Figure:
    """Probe score against k, one line per named architecture (seed 000's sweeps)."""
    label = {"recall_at_1": "recall@1", "mrr": "MRR"}[metric]
    fig = go.Figure()
    for colour, (name, rows) in zip(PALETTE, rows_by_arch.items()):
        fig.add_trace(go.Scatter(x=[r.k for r in rows], y=[getattr(r, metric) for r in rows], mode="lines+markers",
                                 name=name, line=dict(color=colour, width=2), marker=dict(size=6),
                                 hovertemplate=f"{name}<br>k = %{{x}}<br>{label} %{{y:.3f}}<extra></extra>"))
    n_docs = next(iter(rows_by_arch.values()))[0].n_docs if rows_by_arch else 0
    layout(fig, f"embedding probe: {label} against converted top layers k ({n_docs} documents)", height=420)
    fig.update_xaxes(title="k (converted top layers)")
    fig.update_yaxes(title=label, range=[0, 1.02])
    fig.update_layout(legend=INSIDE_LEGEND)
    return fig


def generation_view(gen: Generation, layer: int, head: int | None, tokens: Sequence[str],
                    steps: int | None = None) -> go.Figure:
    """Each decoding step's attention over the cache, one row per step as the text grows; positions
    that left the cache are shaded, so the sink can be seen staying or being evicted. ``steps``
    shows only the first rows (replaying the cache step by step); the axes keep their full size."""
    values, evicted = gen.attention_rows(layer, head)
    if steps is not None:
        values[steps:], evicted[steps:] = np.nan, False
    n_rows, n = values.shape
    labels = [f"{p}: {t!r}"[:24] for p, t in enumerate(tokens[:n])]
    fig = go.Figure()
    fig.add_trace(go.Heatmap(z=np.where(evicted, 1.0, np.nan), colorscale=[[0, EVICTED], [1, EVICTED]], showscale=False,
                             hoverinfo="skip", x=list(range(n)), y=list(range(n_rows))))
    fig.add_trace(go.Heatmap(z=values, colorscale=COLORSCALE, zmin=0, zmax=float(np.nanmax(values)) or 1.0,
                             x=list(range(n)), y=list(range(n_rows)), hoverongaps=False,
                             colorbar=dict(title="attention"),
                             customdata=np.array(labels, dtype=object)[None, :].repeat(n_rows, 0),
                             hovertemplate="step %{y}<br>key %{customdata}<br>p = %{z:.4f}<extra></extra>"))
    prompt = len(gen.prompt_ids)
    if prompt < n_rows:
        fig.add_hline(y=prompt - 0.5, line=dict(color="#333", dash="dash", width=1))
    head_name = "mean over heads" if head is None else f"head {head}"
    layout(fig, f"generation with the KV cache · {gen.arch} · {gen.policy} · layer {layer} · {head_name}",
           height=max(380, min(900, 8 * n_rows + 120)))
    fig.update_yaxes(title="decoding step (query position)", autorange="reversed")
    fig.update_xaxes(title="key position (shaded: evicted from the cache)")
    return fig


def linformer_map(result, head: int | None = None, tokens: Sequence[str] | None = None) -> go.Figure:
    """The n x k Linformer map of one layer: each query's weights over the k projected slots."""
    values = result.probs.mean(0) if head is None else result.probs[head]
    fig = go.Figure(go.Heatmap(z=values, colorscale=COLORSCALE, zmin=0, zmax=float(values.max()) or 1.0,
                               x=[f"slot {s}" for s in range(values.shape[1])], colorbar=dict(title="attention"),
                               hovertemplate="query %{y}, %{x}<br>p = %{z:.4f}<extra></extra>"))
    layout(fig, f"Linformer what-if · layer {result.layer} · k = {result.k} {result.projection} slots · "
                f"{'mean over heads' if head is None else f'head {head}'}", height=480)
    fig.update_yaxes(title="query", autorange="reversed")
    fig.update_xaxes(title="projected key slot")
    return fig


def linformer_errors(results) -> go.Figure:
    """Relative error of the Linformer output as k varies, against full and against masked attention."""
    ks = [r.k for r in results]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=ks, y=[r.error_full for r in results], mode="lines+markers", name="vs full softmax",
                             line=dict(color=PALETTE[0], width=2)))
    fig.add_trace(go.Scatter(x=ks, y=[r.error_masked for r in results], mode="lines+markers",
                             name="vs the layer's masked output", line=dict(color=PALETTE[1], width=2, dash="dash")))
    layer = results[0].layer if results else ""
    layout(fig, f"Linformer relative error against k · layer {layer} · {results[0].projection if results else ''}",
           height=400)
    fig.update_xaxes(title="k (projected slots)")
    fig.update_yaxes(title="‖O_lin − O‖ / ‖O‖", rangemode="tozero")
    fig.update_layout(legend=INSIDE_LEGEND)
    return fig


def residual_table_figure(rows: Sequence[dict]) -> go.Figure:
    """Perplexity per method: seed 003's reported numbers beside ours (same evaluation on our corpus)."""
    names = [r["method"] for r in rows]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.14)
    for col, (key, label) in enumerate((("seed ppl", "seed 003 (reported)"), ("ours ppl", "attnviz (measured)")), 1):
        values = [r[key] for r in rows]
        fig.add_trace(go.Bar(x=names, y=values, name=label, marker_color=PALETTE[col - 1],
                             text=["–" if v is None else f"{v:.2f}" for v in values], textposition="outside",
                             cliponaxis=False), 1, col)
        fig.update_yaxes(title=f"perplexity · {label}", rangemode="tozero", row=1, col=col)
    layout(fig, "residual methods after fine-tuning: perplexity, seed 003 against ours", height=400)
    fig.update_layout(showlegend=False)
    return fig


def compression_curves(result) -> go.Figure:
    """Perplexity of the continuation against the compression ratio, one line per press (docs/methods.md#kv-cache-compression),
    the dense cache as a dotted line; hover gives accuracy, KL and whether key 0 was kept."""
    fig = go.Figure()
    presses = list(dict.fromkeys(r.press for r in result.rows))
    for colour, press in zip(PALETTE, presses):
        rows = [r for r in result.rows if r.press == press]
        fig.add_trace(go.Scatter(
            x=[r.ratio for r in rows], y=[r.perplexity for r in rows], mode="lines+markers", name=press,
            line=dict(color=colour, width=2), marker=dict(size=7),
            customdata=[[r.accuracy, r.kl, r.kept_key0] for r in rows],
            hovertemplate=(f"{press}<br>ratio %{{x}}<br>perplexity %{{y:.3f}}<br>accuracy %{{customdata[0]:.1%}}"
                           "<br>KL %{customdata[1]:.4f}<br>(layer, KV head) pairs keeping key 0: "
                           "%{customdata[2]:.0%}<extra></extra>")))
    fig.add_hline(y=result.dense.perplexity, line=dict(color="#555", dash="dot", width=1),
                  annotation=dict(text=f"dense {result.dense.perplexity:.2f}", font_size=11),
                  annotation_position="bottom right")
    layout(fig, f"KV-cache compression · {result.arch} · context {result.context}, "
                f"{result.continuation} scored tokens", height=420)
    fig.update_xaxes(title="compression ratio r (share of context keys evicted)")
    fig.update_yaxes(title="perplexity of the continuation", type="log")
    fig.update_layout(legend=INSIDE_LEGEND)
    return fig


def kept_keys(result, ratio: float, layer: int, kv_head: int) -> go.Figure:
    """For one ratio, layer and KV head, the context's attention map once per press with the keys that
    press evicts shaded: whether each keeps the sink (key 0) shows at a glance."""
    rows = [r for r in result.rows if r.ratio == ratio]
    values = result.maps[layer][kv_head]
    m = values.shape[-1]
    f = result.pool
    cols = min(3, len(rows)) or 1
    n_rows = -(-len(rows) // cols)
    titles = []
    for r in rows:
        keep = r.kept[layer][kv_head]
        titles.append(f"{r.press} · key 0 {'kept' if keep[0] else 'evicted'}")
    fig = make_subplots(rows=n_rows, cols=cols, subplot_titles=titles, horizontal_spacing=0.04, vertical_spacing=0.12)
    top = float(np.nanmax(values)) or 1.0
    for i, r in enumerate(rows):
        row, col = i // cols + 1, i % cols + 1
        keep = r.kept[layer][kv_head]
        padded = np.pad(keep.astype(float), (0, m * f - keep.size), constant_values=1.0)
        evicted = 1.0 - padded.reshape(m, f).mean(1)  # share of each pooled column evicted
        shade = np.where(np.broadcast_to(evicted > 0.5, values.shape), 1.0, np.nan)
        fig.add_trace(go.Heatmap(z=values, colorscale=COLORSCALE, zmin=0, zmax=top, showscale=False,
                                 hovertemplate="query %{y}<br>key %{x}<br>p = %{z:.4f}<extra></extra>",
                                 x=f * np.arange(m), y=f * np.arange(m)), row, col)
        fig.add_trace(go.Heatmap(z=shade, colorscale=[[0, EVICTED], [1, EVICTED]], showscale=False, opacity=0.75,
                                 hoverinfo="skip", x=f * np.arange(m), y=f * np.arange(m)), row, col)
        fig.update_yaxes(autorange="reversed", row=row, col=col, showticklabels=col == 1)
    layout(fig, f"kept context keys at r = {ratio:g} · layer {layer} · KV head {kv_head} (shaded: evicted)",
           height=300 * n_rows + 80)
    return fig
