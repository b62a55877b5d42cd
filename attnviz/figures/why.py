"""The Why page's figures, why a sink is a sink (each function's docstring cites its definition):

- :func:`sink_shares`: a key's share of attention against its share of the output norm (Kobayashi et al. 2020);
- :func:`massive_activations` and its table :func:`top_activation_rows`: massive activations in the residual stream
  (Sun et al. 2024) beside the sink keys;
- :func:`attribution_figure`: a score's attribution by rotary pair or dimension, and by source;
- :func:`diagnosis_figure`: the sink's diagnosis, each source's key-side contribution per head;
- :func:`query_key_figure`: one head's queries and keys in one picture (AttentionViz), and
  :func:`attention_row_figure`: one query's attention row;
- :func:`causal_figure`: the causal check of one source; :func:`scan_figure`: the causal scan of every block;
- :func:`patching_figure`: activation patching's grid;
- :func:`paths_figure` and :func:`paths_bars_figure`: path patching, each single receiver and each group.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from attnviz.capture import Capture
from attnviz.figures.style import COLORSCALE, layout, token_axis
from attnviz.stats import metrics


def sink_shares(cap: Capture, key: int = 0) -> go.Figure:
    """Per layer × head, the key's share of attention (left) and of the value-weighted output (right)."""
    attention = np.stack([metrics.key_share(cap.layer_probs(l), cap.allowed[l], key) for l in cap.layers])
    output = np.stack([metrics.key_share(cap.value_weighted(l), cap.allowed[l], key) for l in cap.layers])
    heads = [f"h{h}" for h in range(cap.n_heads)]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.08,
                        subplot_titles=(f"share of attention to key {key}", f"share of the output norm from key {key}"))
    for col, values in ((1, attention), (2, output)):
        fig.add_trace(go.Heatmap(z=values, x=heads, y=cap.layers, colorscale=COLORSCALE, zmin=0, zmax=1,
                                 showscale=col == 2, colorbar=dict(title="share"), hoverongaps=False,
                                 hovertemplate="layer %{y}, %{x}<br>share %{z:.1%}<extra></extra>"), 1, col)
        fig.update_yaxes(autorange="reversed", title="layer" if col == 1 else None, row=1, col=col)
    gap = float(np.nanmean(attention) - np.nanmean(output))
    layout(fig, f"key {key} ({cap.tokens[key]!r}): much attention, little value? mean gap {gap:+.1%}",
           height=max(380, 16 * len(cap.layers) + 120))
    fig.update_annotations(font_size=13)
    return fig


def massive_activations(cap: Capture) -> go.Figure:
    """Hidden-state norm per layer boundary × token (log colour), with each layer's sink key marked.

    Sun et al. find the tokens with massive activations are the sink tokens: the markers (the key
    with the largest head-mean column mean in the layer's attention) should sit on the bright columns.
    """
    acts = cap.activations
    norms = np.log10(np.maximum(acts.norms, 1e-6))
    fig = go.Figure(go.Heatmap(z=norms, x=list(range(cap.n_tokens)), y=list(range(norms.shape[0])),
                               colorscale="Magma", colorbar=dict(title="log10 ‖h‖"),
                               customdata=acts.norms,
                               hovertemplate="after layer %{y}, token %{x}<br>‖h‖ = %{customdata:.1f}<extra></extra>"))
    layers = [l for l in cap.layers]
    sinks = [int(cap.stat(l, "column_mean").mean(0).argmax()) for l in layers]
    fig.add_trace(go.Scatter(x=sinks, y=[l + 1 for l in layers], mode="markers", name="sink key of the layer",
                             marker=dict(symbol="x-thin", size=9, line=dict(width=2, color="#1fd1ff")),
                             hovertemplate="layer %{y} attends most to key %{x}<extra></extra>"))
    top = acts.top_values[:, 0]
    layout(fig, f"massive activations: largest |h| {top.max():.0f} (median token norm "
                f"{np.median(acts.norms[-1]):.0f}) · markers: sink keys", height=480)
    fig.update_yaxes(title="layer boundary (0 = embeddings)", autorange="reversed")
    fig.update_xaxes(title="token", **token_axis(cap.tokens))
    fig.update_layout(legend=dict(orientation="h", y=1.02, yanchor="bottom", x=0))
    return fig


def top_activation_rows(cap: Capture, per_layer: int = 2) -> list[dict]:
    """The largest activations per layer boundary: value, token (position and text), dimension."""
    acts = cap.activations
    return [{"layer boundary": l, "|h|": round(float(acts.top_values[l, r]), 1), "token": int(acts.top_tokens[l, r]),
             "text": cap.tokens[int(acts.top_tokens[l, r])], "dim": int(acts.top_dims[l, r])}
            for l in range(acts.top_values.shape[0]) for r in range(min(per_layer, acts.top_values.shape[1]))]


def attribution_figure(explanation) -> go.Figure:
    """A score's attribution (docs/methods.md#score-attribution): by rotary pair, low frequencies to the
    right (pair p turns by θ_p radians per token), or by dimension where positions are learned, and by
    source on the key and the query side."""
    e = explanation
    rotary = bool(e.by_pair)
    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4], horizontal_spacing=0.1,
                        subplot_titles=("by rotary pair" if rotary else "by dimension (learned positions: no pairs)",
                                        "by source"))
    if rotary:
        fig.add_trace(go.Bar(x=list(range(len(e.by_pair))), y=e.by_pair, marker_color="#1f4e9c", name="pair",
                             customdata=np.array(e.frequencies[:len(e.by_pair)]),
                             hovertemplate="pair %{x} (θ = %{customdata:.3g} rad/token)<br>%{y:.4g}<extra></extra>"),
                      row=1, col=1)
    else:
        fig.add_trace(go.Bar(x=list(range(len(e.by_dim))), y=e.by_dim, marker_color="#1f4e9c", name="dimension",
                             hovertemplate="dimension %{x}<br>%{y:.4g}<extra></extra>"), row=1, col=1)
    names = list(dict.fromkeys(list(e.key_sources) + list(e.query_sources)))
    for side, values, colour in (("key side", e.key_sources, "#c0392b"), ("query side", e.query_sources, "#7f8c8d")):
        fig.add_trace(go.Bar(x=names, y=[values.get(n, 0.0) for n in names], name=side, marker_color=colour,
                             hovertemplate=f"{side}: %{{x}}<br>%{{y:.4g}}<extra></extra>"), row=1, col=2)
    where = f"query {e.query}" if e.query != "all" else f"all {e.queries} queries"
    without = "without rotation" if rotary else "without the position embedding"
    capped = f" (soft-capped {e.softcapped_score:.3g})" if e.softcapped_score is not None else ""
    layout(fig, f"layer {e.layer} head {e.head}, {where} → key {e.key} ({e.tokens[1]!r}): score {e.score:.3g}{capped}, "
                f"{without} {e.nope_score:.3g}", height=380)
    fig.update_xaxes(title="pair p (dimensions p, p + D/2)" if rotary else "dimension d", row=1, col=1)
    fig.update_yaxes(title="contribution to the score", row=1, col=1)
    fig.update_layout(barmode="group")
    return fig


def diagnosis_figure(diagnosis) -> go.Figure:
    """Heads × sources: each source's key-side contribution to the head's sink-key score (docs/methods.md#the-sinks-diagnosis)."""
    values = np.asarray(diagnosis.key_side, dtype=np.float64)
    limit = float(np.abs(values).max()) or 1.0
    heads = [f"h{h['head']} → {h['key']}" for h in diagnosis.heads]
    fig = go.Figure(go.Heatmap(z=values, x=diagnosis.sources, y=heads, colorscale="RdBu", zmid=0, zmin=-limit,
                               zmax=limit, colorbar=dict(title="to the score"),
                               hovertemplate="%{y}<br>%{x}: %{z:.4g}<extra></extra>"))
    name, count = diagnosis.leading()
    layout(fig, f"layer {diagnosis.layer}: where each head's sink-key score comes from (key side) · "
                f"{name} leads in {count} of {len(heads)} heads", height=max(300, 28 * len(heads) + 140))
    fig.update_xaxes(title="source", tickangle=-60)
    fig.update_yaxes(title="head → its sink key", autorange="reversed")
    return fig


WEBGL_ABOVE = 2000  # points: above this the query-key view draws with WebGL (scattergl)


def query_key_figure(view) -> go.Figure:
    """AttentionViz's joint picture of one head's queries (circles) and keys (squares), coloured by
    position in their text, each text's sink key ringed; WebGL above ``WEBGL_ABOVE`` points. Trace 0 holds
    the queries and trace 1 the keys, point i of each being token i of ``view.tokens``."""
    n = view.n
    xy = np.asarray(view.points, dtype=np.float64)
    trace = go.Scattergl if 2 * n > WEBGL_ABOVE else go.Scatter
    texts = max(view.samples) + 1
    fig = go.Figure()
    where = np.array([[p, t, s] for p, t, s in zip(view.positions, view.tokens, view.samples)], dtype=object)
    for side, rows, symbol, name in (("query", slice(0, n), "circle", "queries"),
                                     ("key", slice(n, 2 * n), "square", "keys")):
        fig.add_trace(trace(x=xy[rows, 0], y=xy[rows, 1], mode="markers", name=name,
                            marker=dict(symbol=symbol, color=view.positions, colorscale="Viridis", size=7,
                                        showscale=side == "query", colorbar=dict(title="position"),
                                        line=dict(width=0.5, color="#333")),
                            customdata=where,
                            hovertemplate=f"{side} %{{customdata[0]}} %{{customdata[1]}}"
                                          + (" (text %{customdata[2]})" if texts > 1 else "") + "<extra></extra>"))
    sinks = list(view.sink_keys)
    fig.add_trace(go.Scatter(x=xy[[n + j for j in sinks], 0], y=xy[[n + j for j in sinks], 1], mode="markers",
                             name="sink key" + ("s" if len(sinks) > 1 else f" {view.positions[sinks[0]]}"),
                             marker=dict(symbol="square-open", size=16, color="#c0392b", line=dict(width=2)),
                             customdata=where[sinks],
                             hovertemplate="sink key %{customdata[0]} %{customdata[1]}"
                                           + (" (text %{customdata[2]})" if texts > 1 else "") + "<extra></extra>"))
    # the legend below the plot, apart from the position colour bar and its title on the right
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.14, xanchor="left", x=0))
    drawn = "WebGL" if trace is go.Scattergl else "SVG"
    pooled = f", {texts} texts pooled" if texts > 1 else ""
    layout(fig, f"layer {view.layer} head {view.head}: queries and keys after AttentionViz's translation and "
                f"scaling (c = {view.scale:.3g}), {view.method.upper()}, {2 * n} points{pooled} ({drawn})", height=520)
    fig.update_layout(margin=dict(b=110))  # room for the legend below the axis title
    fig.update_xaxes(title="component 1", zeroline=False)
    fig.update_yaxes(title="component 2", zeroline=False, scaleanchor="x" if view.method == "pca" else None)
    return fig


def attention_row_figure(row, tokens: list[str], query: int, key: int | None = None, title: str = "") -> go.Figure:
    """One query's attention row (the probabilities over the keys it may see), the explained key marked."""
    row = np.asarray(row, dtype=np.float64)
    seen = np.arange(len(row))
    colours = ["#c0392b" if j == key else "#1f4e9c" for j in seen]
    fig = go.Figure(go.Bar(x=seen, y=row, marker_color=colours,
                           customdata=np.array(tokens[:len(row)], dtype=object),
                           hovertemplate="key %{x} %{customdata}<br>p = %{y:.4f}<extra></extra>"))
    layout(fig, title or f"the attention row of query {query} ({tokens[query]!r})", height=300)
    fig.update_xaxes(**token_axis(tokens[:len(row)]))
    fig.update_xaxes(title="key")
    fig.update_yaxes(title="probability", rangemode="tozero")
    return fig


def causal_figure(check) -> go.Figure:
    """The causal check of one source (docs/methods.md#the-causal-check): the attention on each layer's sink key
    before and after its write at the sink token is removed, the layers it leads shaded."""
    before, after = check.before.attention, check.after.attention
    layers = list(range(len(before)))
    fig = go.Figure()
    for start, stop in _runs(check.leads):
        fig.add_vrect(x0=start - 0.5, x1=stop + 0.5, fillcolor="#f6c89f", opacity=0.35, line_width=0, layer="below")
    fig.add_trace(go.Scatter(x=layers, y=before, mode="lines+markers", name="as the model runs",
                             line=dict(color="#555555"), hovertemplate="layer %{x}: %{y:.3f}<extra>before</extra>"))
    fig.add_trace(go.Scatter(x=layers, y=after, mode="lines+markers", name=f"{check.source} removed at the sink token",
                             line=dict(color="#c0392b"), hovertemplate="layer %{x}: %{y:.3f}<extra>after</extra>"))
    fig.add_vline(x=check.layer, line_dash="dot", line_color="#888888")
    led = f" · shaded: the layers it leads ({', '.join(f'{a}–{b}' if a != b else str(a) for a, b in _runs(check.leads))})" \
        if check.leads else ""
    layout(fig, f"Attention on the sink key, per layer, with {check.source}'s write at the sink token removed · "
                f"perplexity {check.before.perplexity:.3f} → {check.after.perplexity:.3f}{led}", height=420)
    fig.update_xaxes(title="layer", dtick=max(1, len(layers) // 15))
    fig.update_yaxes(title="attention on the sink key (mean over heads)", rangemode="tozero")
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.18, xanchor="left", x=0), margin=dict(b=110))
    return fig


def _runs(layers) -> list[tuple[int, int]]:
    """[3, 4, 5, 9] → [(3, 5), (9, 9)]."""
    out: list[tuple[int, int]] = []
    for layer in sorted(layers):
        if out and layer == out[-1][1] + 1:
            out[-1] = (out[-1][0], layer)
        else:
            out.append((layer, layer))
    return out


def patching_figure(result) -> go.Figure:
    """Activation patching's grid (:class:`attnviz.effects.patching.Patching`): the effect of patching each layer's
    site at each position (or head) from the clean run into the corrupted one, (patched − corrupted) / (clean −
    corrupted) of the metric: 1 restores the clean run (red), 0 changes nothing, below 0 moves away (blue)."""
    effect = np.asarray(result.effect, dtype=float)
    heads = result.site == "heads"
    clean, corrupted = result.tokens
    if heads:
        x = [f"h{h}" for h in result.heads]
        hover = [[f"layer {l}, head {h}" for h in result.heads] for l in result.layers]
    else:
        x = [f"{p} {clean[p]!r}" + ("" if clean[p] == corrupted[p] else f"/{corrupted[p]!r}") for p in result.positions]
        hover = [[f"layer {l}, position {p}: {clean[p]!r} → {corrupted[p]!r}" for p in result.positions]
                 for l in result.layers]
    bound = max(1.0, float(np.nanmax(np.abs(effect))) if np.isfinite(effect).any() else 1.0)
    fig = go.Figure(go.Heatmap(z=effect, x=list(range(len(x))), y=result.layers, colorscale="RdBu_r", zmid=0,
                               zmin=-bound, zmax=bound, colorbar=dict(title="effect"), customdata=hover,
                               hovertemplate="%{customdata}<br>effect %{z:.3f}<extra></extra>"))
    metric = {"logit_diff": f"logit({result.answer!r}) − logit({result.wrong!r})", "kl": "KL from the clean run",
              "sink": "attention on the sink key"}[result.metric]
    layout(fig, f"activation patching of {result.site}: {metric} at the last position "
                f"(clean {result.clean:.3g}, corrupted {result.corrupted:.3g})", height=max(380, 16 * len(result.layers)))
    fig.update_yaxes(autorange="reversed", title="layer")
    fig.update_xaxes(title="head" if heads else "position (clean/corrupted token where they differ)",
                     tickmode="array", tickvals=list(range(len(x))), ticktext=x if len(x) <= 64 else None)
    return fig


def scan_figure(scan) -> go.Figure:
    """The causal scan (:class:`attnviz.effects.causal.Scan`) as one picture: each removed block (rows, in forward
    order) × layer, the sink's attention after the removal relative to before (1: unchanged, 0: gone; blank below the
    block, where nothing changes), beside the perplexity's change per block; necessary writers' names in red."""
    names, ratio = scan.matrix()
    change = [c.after.perplexity / c.before.perplexity - 1 for c in scan.checks]
    labels = [f"<b style='color:#c0392b'>{n}</b>" if n in scan.necessary else n for n in names]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.78, 0.22], shared_yaxes=True, horizontal_spacing=0.02,
                        subplot_titles=("the sink's attention after / before", "perplexity change"))
    fig.add_trace(go.Heatmap(z=np.clip(ratio, 0, 2), y=list(range(len(names))), x=list(range(ratio.shape[1])),
                             colorscale="RdBu", zmin=0, zmax=2, zmid=1, hoverongaps=False, customdata=np.array(
                                 [[n] * ratio.shape[1] for n in names]),
                             colorbar=dict(title="after / before", orientation="h", x=0.39, xanchor="center",
                                           y=-0.08, yanchor="top", len=0.6, thickness=12),
                             hovertemplate="%{customdata} removed<br>layer %{x}: %{z:.2f} of before<extra></extra>"),
                  row=1, col=1)
    fig.add_trace(go.Bar(x=change, y=list(range(len(names))), orientation="h", showlegend=False,
                         marker_color=["#c0392b" if n in scan.necessary else "#7f7f7f" for n in names],
                         customdata=names, hovertemplate="%{customdata}: perplexity %{x:+.1%}<extra></extra>"),
                  row=1, col=2)
    necessary = ", ".join(scan.necessary) or "none"
    layout(fig, f"causal scan of every block: necessary writers (the sink falls by ≥ half): {necessary}",
           height=max(460, 13 * len(names) + 120))
    fig.update_yaxes(autorange="reversed", tickmode="array", tickvals=list(range(len(names))), ticktext=labels,
                     title="removed at the sink token", row=1, col=1)
    fig.update_xaxes(title="layer", row=1, col=1)
    fig.update_xaxes(tickformat="+.0%", row=1, col=2)
    return fig


#: the rows of paths_figure: what reads a write at a layer (a path's single receivers), with its label
PATH_READERS = (("attn", "attention input"), ("keys", "keys"), ("queries", "queries"), ("mlp", "MLP input"))


def paths_figure(found) -> go.Figure:
    """Path patching (:class:`attnviz.effects.paths.Paths`): one panel per sender; in it, each single receiver's layer
    (columns) and reader (rows: a block's input, the layer's keys, its queries, the MLP's input), the fall of the sink's
    attention over the layers that cut can move (from the receiver's layer up, from the next one for an MLP) when the
    sender's write is removed from that receiver's input alone, in % as the bars (100 %: gone, 0 %: unchanged, below
    0: the sink grows; blank: not above the sender, or not a receiver of this family). The hover adds the scan's
    scale (over every layer above the sender) and the perplexity."""
    n = len(found.before.attention)
    senders = found.senders or ["(no sender)"]
    columns = [str(l) for l in range(n)]
    fig = make_subplots(rows=len(senders), cols=1, shared_xaxes=True, vertical_spacing=0.08 if len(senders) > 1 else 0,
                        subplot_titles=[f"{s} removed from one receiver" for s in senders])
    readers = [r for r, _ in PATH_READERS]
    for i, sender in enumerate(senders, 1):
        z = np.full((len(PATH_READERS), n), np.nan)
        text = np.full(z.shape, "", dtype=object)
        for receiver in found.receivers(sender, single=True):
            if not found.reaches(sender, receiver):  # the head, the top MLP: the perplexity only (in the JSON)
                continue
            row, col = readers.index(receiver.split(".")[0]), int(receiver.split(".")[1])
            z[row, col] = found.reached(sender, receiver)
            text[row, col] = (f"{found.drop(sender, receiver):+.1%} over every layer above {sender}; perplexity "
                              f"{found.before.perplexity:.2f} → {found.after[sender, receiver].perplexity:.2f}")
        fig.add_trace(go.Heatmap(z=z, x=columns, y=[label for _, label in PATH_READERS], customdata=text,
                                 colorscale="RdBu_r", zmin=-1, zmax=1, zmid=0, hoverongaps=False, showscale=i == 1,
                                 colorbar=dict(title="sink's fall", orientation="h", x=0.5, xanchor="center", y=-0.12,
                                               yanchor="top", len=0.6, thickness=12, tickformat=".0%"),
                                 hovertemplate=f"{sender} removed from layer %{{x}}'s %{{y}}: the sink falls by "
                                               "%{z:.0%} in the layers it can move<br>%{customdata}<extra></extra>"),
                      row=i, col=1)
        fig.update_yaxes(autorange="reversed", row=i, col=1)
    layout(fig, "path patching: through which receiver each write makes the sink", height=170 * len(senders) + 170)
    fig.update_xaxes(title="receiver's layer", type="category", row=len(senders), col=1)
    return fig


def paths_bars_figure(found, single: bool | None = False) -> go.Figure:
    """Path patching's groups (:class:`attnviz.effects.paths.Paths`; ``single``: which receivers, as
    :meth:`~attnviz.effects.paths.Paths.receivers`): one panel per sender, a bar per receiver, the fall of the sink's
    attention over every layer above the sender (the causal scan's scale) when the sender's write is removed from
    those receivers' inputs at once; the bar of ``all`` (the scan's removal) in red, a thin line at 0.5 (the scan's
    "necessary")."""
    senders = found.senders or ["(no sender)"]
    fig = make_subplots(rows=1, cols=len(senders), shared_yaxes=False, horizontal_spacing=0.12,
                        subplot_titles=[f"{s} removed from" for s in senders])
    for i, sender in enumerate(senders, 1):
        names = found.receivers(sender, single) if sender in found.senders else []
        drops = [found.drop(sender, r) for r in names]
        fig.add_trace(go.Bar(x=drops, y=names, orientation="h", showlegend=False,
                             marker_color=["#c0392b" if r == "all" else "#4c72b0" for r in names],
                             customdata=[f"{found.after[sender, r].perplexity:.1f}" for r in names],
                             hovertemplate=f"{sender} removed from %{{y}}: the sink falls by %{{x:.0%}}; perplexity "
                                           f"{found.before.perplexity:.1f} → %{{customdata}}<extra></extra>"),
                      row=1, col=i)
        fig.add_vline(x=0.5, line_width=1, line_dash="dot", line_color="#7f7f7f", row=1, col=i)
        fig.update_yaxes(autorange="reversed", row=1, col=i)
        fig.update_xaxes(range=[min(-0.1, min(drops, default=0) - 0.05), 1.05], tickformat=".0%", row=1, col=i)
    layout(fig, "path patching: the sink's fall when a write is removed from these receivers alone",
           height=max(300, 26 * max(len(found.receivers(s, single)) for s in found.senders or [""]) + 160)
           if found.senders else 300)
    fig.update_xaxes(title="the sink's fall (every layer above the sender)", row=1, col=(len(senders) + 1) // 2)
    return fig
