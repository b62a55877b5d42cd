"""Routes: which tokens, through which heads and MLPs, feed a token's prediction (contribution graphs), and how much
of the attention flow the sink key carries; two recipes side by side on one scale."""

import json
from pathlib import Path

import streamlit as st

from attnviz import defaults, flow
from attnviz.errors import AttnvizError
from attnviz.figures import routes_figure, sink_share_figure
from attnviz.figures.routes import MAX_EDGES
from attnviz.figures.style import token_text
from ui.cache import get_flow
from ui.docs import definitions
from ui.export import figure_downloads
from ui.sidebar import page_context, switch_page

settings, loaded = page_context()
st.title("Routes")
definitions("contributions", "routes")
if loaded is None or not settings.text.strip():
    st.warning("Load a model and give a text in the sidebar.")
    st.stop()
if loaded.is_encoder_decoder:
    st.error(f"{loaded.model_id} is an encoder-decoder model: routes are traced in decoder-only models.")
    st.stop()

c1, c2 = st.columns([1, 2])
beside = c1.checkbox("Compare with a second architecture", True, key="rt_compare")
other = c2.text_input("Second architecture", "nosink-fwd", key="rt_other", disabled=not beside)
recipes = [settings.recipe(loaded)] + ([settings.recipe(loaded, other.strip())] if beside and other.strip() else [])
if any(r is None for r in recipes):
    st.stop()
flows = [get_flow(loaded, settings.text, r) for r in recipes]
if any(f is None for f in flows):
    st.stop()
tokens = flows[0].tokens
graph_defaults = defaults.of(flow.graph)  # the token (negative: from the end), τ and the heads start at the library's
c1, c2, c3 = st.columns([3, 2, 1])
token = c1.selectbox("Token", range(len(tokens)), index=graph_defaults["token"] % len(tokens), key="rt_token",
                     format_func=lambda i: f"{i}: {tokens[i]!r}", help="the token whose routes are traced, from the top")
threshold = c2.slider("Threshold τ", 0.01, 0.2, graph_defaults["threshold"], 0.01, key="rt_threshold",
                      help="an edge is kept when its contribution is at least τ (0.04: Ferrando & Voita's)")
heads = c3.radio("Heads", ["split", "sum"], ["split", "sum"].index(graph_defaults["heads"]), horizontal=True,
                 key="rt_heads",
                 help="attention edges one per head, or the heads of a layer summed")
renormalise = st.checkbox("Renormalise the kept edges", graph_defaults["renormalise"], key="rt_renormalise",
                          help="divide the edges kept into each node by their sum, as the LLM Transparency Tool "
                               "does; off, each edge shows its share of the whole node, comparable across nodes")
try:
    graphs = [flow.graph(f, token, threshold, heads, renormalise) for f in flows]
except AttnvizError as err:
    st.error(str(err))
    st.stop()
titles = [f.arch for f in flows]
fig = routes_figure(graphs, titles)
most = max(len(g.edges) for g in graphs)
if most > MAX_EDGES:
    st.caption(f"Drawing the {MAX_EDGES} heaviest edges of each graph (up to {most:,} are kept at τ = {threshold}); "
               "raise τ to see them all.")
event = st.plotly_chart(fig, width="stretch", key="rt_graph", on_select="rerun", selection_mode="points")
meta = {"tool": "attnviz", "model": loaded.model_id, "figure": "routes", "arch": " vs ".join(titles),
        "token": token, "threshold": threshold, "heads": heads,
        "renormalise": renormalise, "text": settings.text}
figure_downloads(fig, meta, key="rt_x")
st.download_button("Download the graph (JSON)", json.dumps([g.as_json() for g in graphs]),
                   file_name="attnviz_routes.json", mime="application/json", key="rt_json")


def open_head(layer: int, head: int) -> None:
    """That head's heatmap on the Heatmaps page (the sidebar's architecture)."""
    st.session_state["hm_jump"] = (layer, head)
    st.session_state["hm_jump_view"] = {"layer": layer, "head": head,
                                        "n": st.session_state.get("hm_jump_view", {}).get("n", 0) + 1}
    switch_page(Path(__file__).resolve().parent / "heatmaps.py")


points = (event or {}).get("selection", {}).get("points", []) if event else []
picked = points[0].get("customdata") if points else None
if picked and picked != st.session_state.get("rt_seen"):  # a new click, handled once
    st.session_state["rt_seen"] = picked
    if len(picked) == 7 and picked[2] == "attn" and int(picked[1]) >= 0:
        open_head(int(picked[0]), int(picked[1]))
    elif len(picked) == 4:
        st.session_state["rt_node"] = (int(picked[0]), str(picked[1]), int(picked[2]), int(picked[3]))
st.caption("Click an attention edge's midpoint to open that head's heatmap; click a node for its logit lens.")

st.subheader("Where the attention flow comes from")
st.plotly_chart(sink_share_figure(graphs, titles, [flow.sink_share_all(f, threshold) for f in flows]),
                width="stretch", key="rt_share")

attn_edges = sorted((e for e in graphs[0].edges if e.via == "attn" and e.head is not None), key=lambda e: -e.weight)
if attn_edges:
    c1, c2 = st.columns([4, 1])
    edge = c1.selectbox("Attention edge", attn_edges[:50], key="rt_edge",
                        format_func=lambda e: f"layer {e.layer} head {e.head}: {e.source} → {e.target} ({e.weight:.3f})")
    if c2.button("Open its heatmap", key="rt_open"):
        open_head(edge.layer, edge.head)

st.subheader("Logit lens")
node = st.session_state.get("rt_node") or (flows[0].n_layers - 1, "mlp", token, 0)
layer, point, at, panel = node
panel = panel if panel < len(flows) else 0
try:
    readings = [flow.lens(loaded, flows[panel], layer, point, at)]
    if layer >= 0:
        readings.append(flow.lens(loaded, flows[panel], layer, point, at, write=True))
except AttnvizError as err:
    st.error(str(err))
else:
    for column, reading in zip(st.columns(len(readings)), readings):
        column.markdown(f"**{reading.what}** ({titles[panel]})")
        column.dataframe({"promoted": [token_text(t) for t, _ in reading.promoted],
                          "logit": [v for _, v in reading.promoted],
                          "suppressed": [token_text(t) for t, _ in reading.suppressed],
                          "logit ": [v for _, v in reading.suppressed]}, hide_index=True)
