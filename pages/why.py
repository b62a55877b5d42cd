"""Why: what makes a head attend where it does: one score by rotary pair and by source, its position-free
counterfactual, the layer's sink diagnosis and the head's query-key view (docs/methods.md#score-attribution)."""

import pandas as pd
import streamlit as st

from attnviz import defaults
from attnviz.effects import causal
from attnviz.effects.explain import PROJECTIONS, corpus_samples, diagnose, query_key_view
from attnviz.errors import AttnvizError
from attnviz.figures.why import (attention_row_figure, attribution_figure, causal_figure, diagnosis_figure,
                                 paths_bars_figure, paths_figure, query_key_figure, scan_figure)
from ui import cache, jobs
from ui.cache import get_residual
from ui.docs import definitions
from ui.export import figure_downloads
from ui.sidebar import page_context

settings, loaded = page_context()
st.title("Why: what makes a head attend there")
definitions("score-attribution", "the-sinks-diagnosis", "query-key-view")


def _param(name: str, default):
    """A cell opened from the Heatmaps page arrives as ?layer=..&head=..&query=..&key=.."""
    value = st.query_params.get(name)
    if value is None:
        return default
    return value if value == "all" else int(value) if value.lstrip("-").isdigit() else default


if loaded is None:
    st.warning("Load a model in the sidebar.")
    st.stop()
recipe = settings.recipe(loaded)
run = None if recipe is None else get_residual(loaded, settings.text, recipe)
if run is None:
    st.stop()
n = run.n_tokens
asked = tuple(st.query_params.get(k) for k in ("layer", "head", "query", "key"))
if "why_layer" not in st.session_state or (any(asked) and asked != st.session_state.get("why_asked")):
    # a first visit, or a new cell from the Heatmaps page's link: that cell, else the top layer's sink
    st.session_state["why_asked"] = asked
    st.session_state["why_layer"] = min(max(_param("layer", loaded.n_layers - 1), 0), loaded.n_layers - 1)
    st.session_state["why_head"] = min(max(_param("head", 0), 0), loaded.n_heads - 1)
    query = _param("query", "all")
    st.session_state["why_query"] = query if query == "all" or 0 <= query < n else "all"
    key = _param("key", None)
    if key is not None and 0 <= key < n:
        st.session_state["why_key"] = key
    else:
        st.session_state.pop("why_key", None)
c1, c2, c3, c4 = st.columns([3, 1, 1, 1])
layer = c1.slider("Layer", 0, loaded.n_layers - 1, key="why_layer")
head = c2.selectbox("Head", list(range(loaded.n_heads)), key="why_head")
part = run.head(layer, head)  # the head's weights, norm and q, k: every number below reads them
sink = run.sink_key(layer, head, part)
if st.session_state.get("why_key", 0) >= n:
    st.session_state["why_key"] = sink
key = int(c3.number_input("Key", 0, n - 1, sink, key="why_key", help=f"this head's sink key is {sink}"))
choices = ["all"] + list(range(n))
if "why_query_clicked" in st.session_state:  # a click in the query-key view, applied before the widget is drawn
    st.session_state["why_query"] = st.session_state.pop("why_query_clicked")
if st.session_state.get("why_query") not in choices:
    st.session_state["why_query"] = "all"
query = c4.selectbox("Query", choices, key="why_query", help="all: the mean over every query that may see the key")
try:
    e = run.explain(layer, head, query, key, part)
except AttnvizError as err:
    st.error(str(err))
    st.stop()
meta = {"tool": "attnviz", **e.recipe, "text": settings.text, "layer": layer, "head": head, "query": query, "key": key}
m1, m2, m3, m4 = st.columns(4)
m1.metric("Score s_ij", f"{e.score:.4g}", help="q_i · k_j · scaling, before any mask or intervention")
rotary = e.position == "rotary"
m2.metric("Without rotation" if rotary else "Without the position embedding", f"{e.nope_score:.4g}",
          f"{e.nope_score - e.score:+.3g}", delta_color="off",
          help=("the same product with no rotary rotation" if rotary else
                "the same product with the learned position embedding taken out of the sources")
          + ": how much of the score position makes")
m3.metric("Top 4 rotary pairs", f"{e.top_pairs_share(4):.0%}" if rotary else "none (learned positions)",
          help="their share of Σ_p |c_p|")
split = e.key_split
m4.metric("Key side from MLPs", f"{split['mlp']:.3g}",
          help="the key side's sources summed by kind; all three are in the caption below the chart")
fig = attribution_figure(e)
st.plotly_chart(fig, width="stretch", key="why_attribution")
figure_downloads(fig, {**meta, "figure": "attribution"}, key="why_attribution_x")
st.caption(f"Key {key} is {e.tokens[1]!r}; averaged over {e.queries} quer{'y' if e.queries == 1 else 'ies'}. Each "
           "bar chart sums to the score: the pairs exactly, each side's sources with the layer's norm scale frozen. "
           f"Key side by kind: MLP {split['mlp']:.3g} · attention {split['attn']:.3g} · embedding {split['embed']:.3g}.")
with st.expander("Numbers (CSV)"):
    rows = pd.DataFrame([{"part": f"pair {p}", "frequency": e.frequencies[p], "contribution": c}
                         for p, c in enumerate(e.by_pair)]
                        + [{"part": f"dim {d}", "contribution": c} for d, c in enumerate(e.by_dim)]
                        + [{"part": f"key side {s}", "contribution": v} for s, v in e.key_sources.items()]
                        + [{"part": f"query side {s}", "contribution": v} for s, v in e.query_sources.items()])
    st.dataframe(rows, hide_index=True, height=240)
    st.download_button("Attribution (.csv)", rows.to_csv(index=False).encode(), key="why_csv", mime="text/csv",
                       file_name=f"attnviz_why_L{layer}_h{head}_q{query}_k{key}.csv")

st.subheader("Test it: remove a source at the sink token")
definitions("the-causal-check", "patch")
blocks_first = [s for s, _ in sorted(e.key_sources.items(), key=lambda kv: -abs(kv[1])) if causal.patchable(s)]
if not blocks_first:
    st.caption("No block writes into this key's score here (the embeddings do): nothing to patch.")
else:
    t1, t2, t3 = st.columns([2, 2, 1])
    source = t1.selectbox("Source", blocks_first, key="why_test_source",
                          help="default: the block that adds most to this head's score on the key side")
    value = t2.radio("Its output at the sink token becomes", ["zero", "mean"],
                     ["zero", "mean"].index(defaults.one(causal.check, "value")), horizontal=True, key="why_test_value",
                     help="mean: the block's mean output over the text's other positions")
    test_key = ("causal", recipe.key, settings.text, source, value)
    if t3.button("Test it", key="why_test", type="primary") or jobs.cached(test_key):
        try:
            checks = jobs.run(test_key, f"Patching {source} at the sink token", lambda progress: causal.check(
                loaded, settings.text, recipe, [source], value, on_step=progress))
        except AttnvizError as err:
            st.error(str(err))
            checks = None
        if checks:
            check = checks[0]
            r1, r2 = st.columns(2)
            above = list(range(check.layer + 1, loaded.n_layers))
            r1.metric(f"Sink attention, layers {above[0]}–{above[-1]}" if above else "Sink attention",
                      f"{sum(check.after.attention[l] for l in above) / max(len(above), 1):.3f}",
                      f"{-check.drop(above):+.0%} of {sum(check.before.attention[l] for l in above) / max(len(above), 1):.3f}"
                      if above else None, delta_color="off")
            r2.metric("Perplexity of this text", f"{check.after.perplexity:.3f}",
                      f"{check.after.perplexity - check.before.perplexity:+.3f} vs {check.before.perplexity:.3f}",
                      delta_color="inverse")
            fig_c = causal_figure(check)
            st.plotly_chart(fig_c, width="stretch", key="why_causal")
            figure_downloads(fig_c, {**meta, "figure": "causal", "patch": check.patch}, key="why_causal_x")
    else:
        st.caption(f"One click runs the text twice more (with and without {source}'s write at each layer's sink key, "
                   "`patch(block=..., tokens=sink)`): the attention on the sink key per layer, and the perplexity.")

with st.container(border=True):
    st.markdown("**Scan every block**: each layer's attention and MLP write, and the embedding, removed at the sink "
                "token one at a time; attribution's leaders are marked, the necessary writers named "
                "([definition](definitions#the-causal-scan)).")
    scan_key = ("scan", recipe.key, settings.text)
    if st.button("Scan every block", key="why_scan") or jobs.cached(scan_key):
        from attnviz.effects.causal import scan as scan_blocks

        try:
            found = jobs.run(scan_key, "Removing every block's write at the sink token", lambda progress: scan_blocks(
                loaded, settings.text, recipe, on_step=progress, budget=cache.analysis_budget(),
                on_plan=cache.room_for))
        except AttnvizError as err:
            st.error(str(err))
            found = None
        if found is not None:
            fig_s = scan_figure(found)
            st.plotly_chart(fig_s, width="stretch", key="why_scan_fig")
            figure_downloads(fig_s, {**meta, "figure": "scan"}, key="why_scan_x")
            leaders = [c.source for c in found.checks if c.leads]
            lines = [f"- **{source}** is necessary: removing it changes "
                     + (", ".join(f"{w['block']} ({w['change']:+.0%})" for w in found.chains[source][:6]) or
                        "no later write's size at the sink token by half or more")
                     + ("…" if len(found.chains[source]) > 6 else "") for source in found.necessary]
            st.markdown("\n".join(lines) or "No single write is necessary: removing any one leaves over half the "
                        "sink's attention.")
            st.caption(f"Attribution's leaders: {', '.join(leaders) or 'none'}. Not scanned: {found.not_scanned}.")

with st.container(border=True):
    st.markdown("**Trace the paths**: each sender's write (by default the scan's necessary writers) removed at the sink "
                "token from one receiver's input alone (a later block, a layer's keys or queries, or the head), every "
                "other block reading the stream as it was: through which block the write makes the sink "
                "([definition](definitions#path-patching)).")
    given = st.text_input("Senders", "", key="why_senders", placeholder="the scan's necessary writers, or e.g. mlp.0")
    paths_key = ("paths", recipe.key, settings.text, given.strip())
    if st.button("Trace the paths", key="why_paths") or jobs.cached(paths_key):
        from attnviz.effects.paths import paths as trace_paths

        scanned = jobs.cached(("scan", recipe.key, settings.text))  # the scan already run: its writers, not again
        senders = given.strip() or (scanned.necessary if scanned is not None else None)
        traced = None
        try:
            if senders != []:  # [] : the scan already said no single write is necessary (said below)
                traced = jobs.run(paths_key, "Removing each sender from one receiver at a time", lambda progress: (
                    trace_paths(loaded, settings.text, recipe, senders, on_step=progress,
                                budget=cache.analysis_budget(), on_plan=cache.room_for)))
        except AttnvizError as err:
            st.error(str(err))
        if senders == [] or (traced is not None and not traced.senders):
            st.info("No single write is necessary here (the scan names none), so there is no sender to trace: name "
                    "one above.")
        elif traced is not None:
            fig_p = paths_figure(traced)
            st.plotly_chart(fig_p, width="stretch", key="why_paths_fig")
            figure_downloads(fig_p, {**meta, "figure": "paths"}, key="why_paths_x")
            if any(traced.receivers(s, single=False) for s in traced.senders):
                fig_g = paths_bars_figure(traced)
                st.plotly_chart(fig_g, width="stretch", key="why_paths_groups")
                figure_downloads(fig_g, {**meta, "figure": "paths_groups"}, key="why_paths_groups_x")
            st.markdown("\n".join(f"- **{s}** makes the sink most through " + ", ".join(
                f"{r} ({d:.0%})" for r, d in traced.strongest(s)) + "; cut from every receiver of a kind at once: " +
                ", ".join(f"{r} {traced.drop(s, r):.0%}" for r in traced.receivers(s, single=False))
                for s in traced.senders))
            st.caption("A single receiver's fall is the sink's mean attention lost in the layers it can move (from its "
                       "own layer up, from the next for an MLP) when that one receiver reads the stream without the "
                       "write; a group's is on the scan's scale (every layer above the sender; `all` is the scan's "
                       "removal). Under a causal mask a query at the sink token sees that key alone (with no learned "
                       "sink), so its path changes nothing there." +
                       (f" Not receivers here: {traced.skipped}" if traced.skipped else ""))

st.subheader("The sink's diagnosis of this layer")
diagnosis = diagnose(run, layer)
fig_d = diagnosis_figure(diagnosis)
st.plotly_chart(fig_d, width="stretch", key="why_diagnosis")
figure_downloads(fig_d, {**meta, "figure": "diagnosis"}, key="why_diagnosis_x")

st.subheader("Queries and keys of this head (AttentionViz)")
v1, v2 = st.columns([1, 2])
pooled = v1.slider("Pool corpus samples", 0, 8, 0, key="why_pool",
                   help="add the first texts of the default corpus (Python's pydoc topics, 96 tokens each) to the "
                        "picture, as AttentionViz pools a corpus's samples")
method = v2.radio("Projection", list(PROJECTIONS), list(PROJECTIONS).index(defaults.one(query_key_view, "method")),
                  horizontal=True, key="why_method",
                  format_func={"pca": "PCA", "tsne": "t-SNE", "umap": "UMAP"}.get,
                  help="PCA needs nothing and is deterministic; t-SNE and UMAP need scikit-learn / umap-learn")
runs = [run]
for sample in corpus_samples(loaded, pooled):
    extra = get_residual(loaded, sample, recipe)
    if extra is None:
        st.stop()
    runs.append(extra)
try:
    with st.spinner(f"Projecting {2 * sum(r.n_tokens for r in runs)} points ({method})…"):
        view = query_key_view(runs, layer, head, method)
except AttnvizError as err:
    st.error(str(err))
    st.stop()
fig_q = query_key_figure(view)
picked = st.plotly_chart(fig_q, width="stretch", key="why_qk", on_select="rerun", selection_mode="points")
figure_downloads(fig_q, {**meta, "figure": "query-key", "projection": method, "texts": len(runs)}, key="why_qk_x")
points = (picked or {}).get("selection", {}).get("points", []) if picked else []
point = (points[0].get("curve_number"), points[0].get("point_index")) if points else None
if point is not None and point != st.session_state.get("why_last_point"):  # a new click, handled once
    st.session_state["why_last_point"] = point
    if point[0] == 0:  # a query: its attention row, and its attribution
        _, sample, position = view.where(int(point[1]))
        st.session_state["why_clicked"] = (sample, position)
        if sample == 0 and position != query and run.allowed(layer)[position, key]:
            st.session_state["why_query_clicked"] = position  # the attribution above follows the click
            st.rerun()
clicked = st.session_state.get("why_clicked")
if clicked is None or clicked[0] == 0 or clicked[0] >= len(runs) or clicked[1] >= runs[clicked[0]].n_tokens:
    clicked = (0, query) if query != "all" else None  # the first text's row is the query picked above
if clicked is None:
    st.caption("Click a query (a circle) to see its attention row and its attribution.")
else:
    sample, position = clicked
    chosen = runs[sample]
    chosen_part = part if sample == 0 else chosen.head(layer, head)
    row = chosen.probabilities(layer, head, chosen_part)[position]
    shown = key if sample == 0 else chosen.sink_key(layer, head, chosen_part)
    where = "" if sample == 0 else f" of pooled text {sample}"
    fig_r = attention_row_figure(row.numpy(), list(chosen.tokens), position, shown,
                                 f"layer {layer} head {head}: the attention row of query {position}{where} "
                                 f"({chosen.tokens[position]!r}); key {shown} marked")
    st.plotly_chart(fig_r, width="stretch", key="why_row")
    figure_downloads(fig_r, {**meta, "figure": "attention-row", "query": position, "text_index": sample},
                     key="why_row_x")
    if sample > 0 and chosen.allowed(layer)[position, shown]:  # the page's attribution is the first text's
        fig_e = attribution_figure(chosen.explain(layer, head, position, shown, chosen_part))
        st.plotly_chart(fig_e, width="stretch", key="why_pooled_attribution")
        figure_downloads(fig_e, {**meta, "figure": "attribution", "query": position, "key": shown,
                                 "text_index": sample}, key="why_pooled_attribution_x")
