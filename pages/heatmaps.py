"""Heatmaps: one layer and head (or the head mean), and every layer × head at a glance."""

import streamlit as st

from attnviz import export
from attnviz.errors import AttnvizError
from attnviz.figures import heatmap, overview, tile_at
from ui.export import data_downloads, figure_downloads
from ui.state import current_capture, page_context

settings, loaded = page_context()
st.title("Attention heatmaps")
SHOW = {"weight": "attention weight A", "value": "value-weighted norm ‖A·W_O v‖", "logits": "pre-softmax QKᵀ/√d",
        "rollout": "attention rollout"}
EXTRAS = {"value": ("value_norms",), "logits": ("scores",)}  # recorded only when this view asks
mode = st.radio("Show", list(SHOW), format_func=SHOW.get, horizontal=True, key="hm_mode",
                help="Weight is what softmax gives; the value-weighted norm (Kobayashi et al. 2020) also counts how "
                     "much each key's value can move the output; rollout (Abnar & Zuidema 2020) multiplies the "
                     "head-mean maps of layers 0..l with the residual identity")
if mode == "rollout":
    st.caption("Rollout assumes attention and the residual mix linearly. Under a causal mask row i traces back to "
               "tokens 0..i; under BIDIR/BACK layers it mixes in later tokens, because those layers do. It shows "
               "where information could have come from, not what the model used.")
cap = current_capture(settings, loaded, extras=EXTRAS.get(mode, ()))
if cap is not None:
    st.caption(f"{cap.meta['model']} · `{cap.arch}` · {cap.n_tokens} tokens · forward {cap.timing['forward_s']:.2f} s")
    # a click on the overview moves the sliders (applied before they are drawn)
    if "hm_jump" in st.session_state:
        st.session_state["hm_layer"], st.session_state["hm_head"] = st.session_state.pop("hm_jump")
    c1, c2, c3, c4 = st.columns([3, 2, 1, 1])
    layer = c1.slider("Layer", 0, loaded.n_layers - 1, min(st.session_state.get("hm_layer", loaded.n_layers - 1),
                                                            loaded.n_layers - 1), key="hm_layer")
    heads = ["mean"] + list(range(cap.n_heads))
    head = c2.select_slider("Head", heads, key="hm_head",
                            format_func=lambda h: "mean" if h == "mean" else f"{h} (g{cap.kv_groups[h]})")
    log = c3.toggle("Log scale", key="hm_log")
    row_norm = c4.toggle("Row-normalise", key="hm_rownorm")
    head = None if head == "mean" else int(head)
    try:
        fig = heatmap(cap, layer, head, log=log, row_normalise=row_norm, mode=mode)
    except AttnvizError as err:
        st.error(str(err))
        st.stop()
    st.plotly_chart(fig, width="stretch", key="hm_chart")
    st.caption("Grey cells are masked by the architecture; white cells were allowed but got ~0 attention.")
    figure_downloads(fig, export.describe(cap, layer, head), key="hm")

    st.subheader("Every layer × head")
    over = overview(cap, log=log)
    event = st.plotly_chart(over, width="stretch", key="hm_overview", on_select="rerun", selection_mode="points")
    points = (event or {}).get("selection", {}).get("points", []) if event else []
    if points:
        target = tile_at(cap, points[0]["x"], points[0]["y"])
        if target != (layer, head):
            st.session_state["hm_jump"] = target
            st.rerun()
    data_downloads(cap, key="hm_data")
