"""Heatmaps: one layer and head (or the head mean), and every layer × head at a glance.

Encoder-decoder models (T5, BART ...) show encoder, decoder or cross-attention (attnviz.seq2seq).
"""

import streamlit as st

from attnviz import export
from attnviz.errors import AttnvizError
from attnviz.figures import heatmap, overview, tile_at
from ui.export import data_downloads, figure_downloads
from ui.state import current_capture, get_seq2seq_capture, page_context

settings, loaded = page_context()
st.title("Attention heatmaps")
SHOW = {"weight": "attention weight A", "value": "value-weighted norm ‖A·W_O v‖", "logits": "pre-softmax QKᵀ/√d",
        "rollout": "attention rollout"}
EXTRAS = {"value": ("value_norms",), "logits": ("scores",)}  # recorded only when this view asks
KINDS = {"decoder": "decoder self-attention", "encoder": "encoder self-attention",
         "cross": "cross-attention (target → source)"}
kind = st.radio("Attention", list(KINDS), format_func=KINDS.get, horizontal=True, key="hm_kind",
                help="A decoder-only LM has decoder self-attention only; encoder-decoder models (T5, BART, Marian) "
                     "also have an encoder and cross-attention, with target tokens as rows and source tokens as columns")
seq2seq = loaded is not None and loaded.is_encoder_decoder


def show(cap, mode: str) -> None:
    """The layer/head sliders, the map, its export and the overview of one capture."""
    # a click on the overview moves the sliders (applied before they are drawn)
    if "hm_jump" in st.session_state:
        st.session_state["hm_layer"], st.session_state["hm_head"] = st.session_state.pop("hm_jump")
    top = len(cap.layers) - 1
    c1, c2, c3, c4 = st.columns([3, 2, 1, 1])
    layer = c1.slider("Layer", 0, top, min(st.session_state.get("hm_layer", top), top), key="hm_layer")
    heads = ["mean"] + list(range(cap.n_heads))
    if st.session_state.get("hm_head") not in heads:
        st.session_state["hm_head"] = "mean"
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


if seq2seq:
    st.caption("The sidebar text is the source. The encoder's stock mask is BIDIR; the sidebar architecture on it "
               "gives seed 004's \"encoder with a causal mask\" and its variants. The decoder stays causal.")
    c1, c2 = st.columns([3, 2])
    target = c1.text_input("Target text", "", key="hm_target",
                           help="Empty: the model's own greedy output (32 tokens at most) under the encoder mask")
    encoder = c2.radio("Encoder mask", ["stock", "sidebar"], horizontal=True, key="hm_encoder",
                       format_func=lambda e: "stock (bidir)" if e == "stock" else f"sidebar: {settings.arch}")
    if not settings.text.strip():
        st.warning("The source text is empty: type something in the sidebar or pick an example.")
        st.stop()
    pair = get_seq2seq_capture(loaded, settings.text, target, "bidir" if encoder == "stock" else settings.arch)
    if pair is not None:
        cap = pair.view(kind)
        st.caption(f"{cap.meta['model']} · encoder `{pair.encoder.arch}` · {pair.encoder.n_tokens} source → "
                   f"{pair.decoder.n_tokens} target tokens" + (" (generated)" if pair.generated else "")
                   + f" · forward {cap.timing['forward_s']:.2f} s")
        if pair.generated:
            st.markdown(f"**Model output:** {pair.target}")
        show(cap, "weight")
elif kind != "decoder" and loaded is not None:
    st.error(f"{loaded.model_id} is a decoder-only model: it has no encoder and no cross-attention. Load an "
             "encoder-decoder (T5, BART, Marian: a Hugging Face id or a local directory) to see them.")
else:
    mode = st.radio("Show", list(SHOW), format_func=SHOW.get, horizontal=True, key="hm_mode",
                    help="Weight is what softmax gives; the value-weighted norm (Kobayashi et al. 2020) also counts "
                         "how much each key's value can move the output; rollout (Abnar & Zuidema 2020) multiplies "
                         "the head-mean maps of layers 0..l with the residual identity")
    if mode == "rollout":
        st.caption("Rollout assumes attention and the residual mix linearly. Under a causal mask row i traces back "
                   "to tokens 0..i; under BIDIR/BACK layers it mixes in later tokens, because those layers do. It "
                   "shows where information could have come from, not what the model used.")
    cap = current_capture(settings, loaded, extras=EXTRAS.get(mode, ()))
    if cap is not None:
        st.caption(f"{cap.meta['model']} · `{cap.arch}` · {cap.n_tokens} tokens · "
                   f"forward {cap.timing['forward_s']:.2f} s")
        show(cap, mode)
