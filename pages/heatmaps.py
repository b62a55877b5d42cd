"""Heatmaps: one layer and head (or the head mean), and every layer × head at a glance.

Encoder-decoder models (T5, BART ...) show encoder, decoder or cross-attention (attnviz.seq2seq).
"""

from pathlib import Path

import streamlit as st

from attnviz.figures import export
from attnviz import regions
from attnviz.effects import schemes
from attnviz.errors import AttnvizError
from attnviz.figures import heatmap, overview, region_heatmap, tile_at
from ui import jobs
from ui.export import data_downloads, figure_downloads
from ui.cache import fits_full_maps, get_seq2seq_capture
from ui.sidebar import current_capture, page_context
from ui.viewer import heatmap_viewer
from ui.docs import definitions

# Above this many tokens the colour scale starts logarithmic: a linear scale spends the whole range on
# the sink column (p ~ 0.5-0.9), so the ~1/n attention everywhere else is white and the map reads as a
# white square with a hairline; log10 (floor 1e-4) shows the sink and the local structure together.
LOG_DEFAULT_TOKENS = 256
FIGURES_KEPT = 32  # heatmap figures kept per capture (each an image of at most 512² pixels)

settings, loaded = page_context()
st.title("Attention heatmaps")
definitions("masks", "per-layer-architectures", "value-weighted-attention", "attention-rollout")
SHOW = {"weight": "attention weight A", "value": "value-weighted norm ‖A·W_O v‖", "logits": "pre-softmax QKᵀ/√d",
        "rollout": "attention rollout"}
EXTRAS = {"value": ("value_norms",), "logits": ("scores",)}  # recorded only when this view asks
STACKS = {"decoder": "decoder self-attention", "encoder": "encoder self-attention",
         "cross": "cross-attention (target → source)"}
stack = st.radio("Attention", list(STACKS), format_func=STACKS.get, horizontal=True, key="hm_stack",
                help="A decoder-only LM has decoder self-attention only; encoder-decoder models (T5, BART, Marian) "
                     "also have an encoder and cross-attention, with target tokens as rows and source tokens as columns")
seq2seq = loaded is not None and loaded.is_encoder_decoder


@st.fragment
def show(cap, mode: str) -> None:
    """The map of one layer and head, its export and a full-resolution zoom.

    Attention weights go to the browser's viewer (ui.viewer): a slider move repaints there, with no
    server round trip. The other views (and the viewer switched off) keep server-side sliders in a
    fragment: a move reruns only this function, not the sidebar, the model lookup and the capture
    cache of the whole page."""
    if mode == "weight" and st.session_state.get("hm_instant", True) and not cap.learned_sink:
        show_instant(cap)
        return
    if mode == "weight" and cap.learned_sink:  # the browser's viewer draws the keys only
        st.caption("This model gives each head a learned sink logit: the share of each row it takes is the column "
                   "\"sink\" left of key 0, drawn here by the server ([definition]"
                   "(definitions#the-learned-sink-as-a-key)).")
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
    if not st.session_state.get("hm_log_chosen"):  # follows the text's length until the user sets it
        st.session_state["hm_log"] = cap.n_tokens > LOG_DEFAULT_TOKENS
    log = c3.toggle("Log scale", key="hm_log",
                    on_change=lambda: st.session_state.update(hm_log_chosen=True, hm_log_changed=True))
    if st.session_state.pop("hm_log_changed", False):
        st.rerun()  # the whole page: the overview below this fragment follows the scale too
    row_norm = c4.toggle("Row-normalise", key="hm_rownorm")
    head = None if head == "mean" else int(head)
    figures = cap.memo("heatmap_figures", dict)  # kept with the capture: a slider back is instant
    shown = (layer, head, log, row_norm, mode)
    if shown not in figures:
        try:
            figures[shown] = heatmap(cap, layer, head, log=log, row_normalise=row_norm, mode=mode)
        except AttnvizError as err:
            st.error(str(err))
            st.stop()
        if len(figures) > FIGURES_KEPT:
            figures.pop(next(iter(figures)))
    fig = figures[shown]
    box = st.plotly_chart(fig, width="stretch", key="hm_chart", on_select="rerun", selection_mode="box")
    pooled = cap.pool_factor(layer)
    st.caption("Grey cells are masked by the architecture; white cells were allowed but got ~0 attention."
               + (f" Long text: each pixel is the maximum of {pooled} × {pooled} tokens (sinks stay visible); "
                  "drag a box or pick a region below to see it at full resolution." if pooled > 1 else
                  " Drag a box to zoom into a region with token labels."))
    figure_downloads(fig, export.describe(cap, layer, head), key="hm")
    boxes = ((box or {}).get("selection", {}) or {}).get("box", []) if box else []
    region = None
    if boxes and boxes[0].get("x") and boxes[0].get("y"):  # a box dragged on the map sets the ranges
        (x0, x1), (y0, y1) = sorted(boxes[0]["x"]), sorted(boxes[0]["y"])
        region = ((int(y0 + 0.5), int(y1 + 0.5)), (int(x0 + 0.5), int(x1 + 0.5)))
    zoom_section(cap, layer, head, log, region)
    explain_links(cap, layer, head, region)


def explain_links(cap, layer: int, head: int | None, region) -> None:
    """Links to the Why page: this head's sink column (every query), and the box's lower-left cell."""
    if loaded is None:
        return
    try:  # only where score attribution is worked out for the family (attnviz/effects/schemes.py)
        schemes.scheme(loaded)
    except AttnvizError:
        return
    head = 0 if head is None else int(head)
    key = int(cap.stat(layer, "column_mean")[head].argmax())
    why = Path(__file__).resolve().parent / "why.py"
    c1, c2 = st.columns(2)
    c1.page_link(str(why), label=f"Explain: why head {head} of layer {layer} attends to key {key}",
                 icon="❓", query_params={"layer": layer, "head": head, "query": "all", "key": key})
    if region:
        (q0, q1), (k0, _) = region
        c2.page_link(str(why), label=f"Explain this cell: query {q1 - 1}, key {k0}", icon="❓",
                     query_params={"layer": layer, "head": head, "query": q1 - 1, "key": k0})


def show_instant(cap) -> None:
    """The browser's viewer: layers, heads, log scale and row normalisation move there; a box drag
    asks for a full-resolution region below; the export follows the view where it rests."""
    default_log = cap.n_tokens > LOG_DEFAULT_TOKENS
    result = heatmap_viewer([cap], key="hm_viewer", regions=True, log=default_log,
                            jump=st.session_state.get("hm_jump_view"))
    view = result.get("view") or {}  # where the user rests, as the component last reported it
    layer = view.get("layer", cap.layers[-1])
    layer = layer if layer in cap.layers else cap.layers[-1]
    head, log = view.get("head"), bool(view.get("log", default_log))
    figure_downloads(lambda: heatmap(cap, layer, head, log=log), export.describe(cap, layer, head), key="hm")
    region, asked = None, result.get("region")
    if asked:
        layer, head = asked["layer"], asked.get("head")
        region = (tuple(asked["queries"]), tuple(asked["keys"]))
    zoom_section(cap, layer, head, log, region)
    explain_links(cap, layer, head, region)


def show_overview(cap) -> None:
    """Every layer × head, outside the slider fragment: a slider move does not resend it (~0.3 MB
    the browser would parse again). A click on a tile moves the sliders."""
    st.subheader("Every layer × head")
    over = overview(cap, log=st.session_state.get("hm_log", False))
    event = st.plotly_chart(over, width="content", key="hm_overview", on_select="rerun", selection_mode="points")
    points = (event or {}).get("selection", {}).get("points", []) if event else []
    clicked = (points[0]["x"], points[0]["y"]) if points else None
    # the selection stays on the chart: act on a new click only, or a later rerun would undo slider moves
    if clicked and clicked != st.session_state.get("hm_overview_seen"):
        st.session_state["hm_overview_seen"] = clicked
        st.session_state["hm_jump"] = tile_at(cap, *clicked)
        layer, head = st.session_state["hm_jump"]
        st.session_state["hm_jump_view"] = {"layer": layer, "head": head,
                                            "n": st.session_state.get("hm_jump_view", {}).get("n", 0) + 1}
        st.rerun()
    data_downloads(cap, key="hm_data")


def zoom_section(cap, layer: int, head, log: bool, box) -> None:
    """A region (queries × keys) at full resolution: cut from full maps, or recomputed for a long text
    (the forward stops after this layer). ``box``: ((q0, q1), (k0, k1)) a drag on the map asked for."""
    n, n_q, side = cap.n_tokens, len(cap.row_tokens), regions.MAX_SIDE
    if box:  # a box dragged on the map sets the ranges (at most ``side`` tokens a side)
        (q0, q1), (k0, k1) = box
        k0, q0 = max(0, int(k0)), max(0, int(q0))
        st.session_state["hm_zk"] = (k0, min(n, max(k0 + 1, int(k1)), k0 + side))
        st.session_state["hm_zq"] = (q0, min(n_q, max(q0 + 1, int(q1)), q0 + side))
    boxes = [box] if box else []
    with st.expander("Zoom: a region at full resolution", expanded=bool(boxes) or cap.pool_factor(layer) > 1):
        c1, c2 = st.columns(2)
        queries = c1.slider("Queries", 0, n_q, (max(0, n_q - min(side, 48)), n_q), key="hm_zq")
        keys = c2.slider("Keys", 0, n, (0, min(n, 48)), key="hm_zk")
        if queries[1] - queries[0] > side or keys[1] - keys[0] > side:
            st.warning(f"A region shows at most {side} × {side} tokens; narrow the ranges.")
            return
        if queries[0] == queries[1] or keys[0] == keys[1]:
            st.warning("Pick a range of at least one query and one key.")
            return
        wanted = (layer, queries, keys)
        if layer not in cap.probs:  # a long text: the region costs a forward up to this layer, so on request
            if boxes or c1.button("Show this region at full resolution", key="hm_zoom_go",
                                  help=f"Re-runs layers {regions.resumes_at(cap, layer)}–{layer} on the text, "
                                       "keeping only this region"):
                st.session_state["hm_zoom_for"] = (cap.text, cap.arch, *wanted)
            asked = st.session_state.get("hm_zoom_for")
            if not asked or asked[:2] != (cap.text, cap.arch):
                return
            layer, queries, keys = asked[2:]
        try:
            if layer in cap.probs:
                region = regions.from_capture(cap, layer, queries, keys)
            else:  # recomputed with the capture's own recipe (intervention, BOS control, residual variant)
                region = jobs.run(("region", cap.recipe.key, cap.text, layer, queries, keys),
                                  f"Layer {layer}, queries {queries[0]}–{queries[1] - 1} × keys {keys[0]}–{keys[1] - 1}",
                                  lambda progress: regions.of_capture(loaded, cap, layer, queries, keys,
                                                                   on_layer=progress))
        except AttnvizError as err:
            st.error(str(err))
            return
        if region is not None:
            st.plotly_chart(region_heatmap(region, head, log=log), width="stretch", key="hm_region")


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
        cap = pair.view(stack)
        st.caption(f"{cap.meta['model']} · encoder `{pair.encoder.arch}` · {pair.encoder.n_tokens} source → "
                   f"{pair.decoder.n_tokens} target tokens" + (" (generated)" if pair.generated else "")
                   + f" · forward {cap.timing['forward_s']:.2f} s")
        if pair.generated:
            st.markdown(f"**Model output:** {pair.target}")
        show(cap, "weight")
        show_overview(cap)
elif stack != "decoder" and loaded is not None:
    st.error(f"{loaded.model_id} is a decoder-only model: it has no encoder and no cross-attention. Load an "
             "encoder-decoder (T5, BART, Marian: a Hugging Face id or a local directory) to see them.")
else:
    c1, c2 = st.columns([5, 1])
    c2.toggle("Instant viewer", True, key="hm_instant",
              help="Attention weights move in your browser: every layer and head without a server round trip, "
                   "hover values, a box drag for a full-resolution region. Off: the server draws each view "
                   "(Plotly, as exported)")
    mode = c1.radio("Show", list(SHOW), format_func=SHOW.get, horizontal=True, key="hm_mode",
                    help="Weight is what softmax gives; the value-weighted norm (Kobayashi et al. 2020) also counts "
                         "how much each key's value can move the output; rollout (Abnar & Zuidema 2020) multiplies "
                         "the head-mean maps of layers 0..l with the residual identity")
    if mode == "rollout":
        st.caption("Rollout assumes attention and the residual mix linearly. Under a causal mask row i traces back "
                   "to tokens 0..i; under BIDIR/BACK layers it mixes in later tokens, because those layers do. It "
                   "shows where information could have come from, not what the model used.")
    long_text = loaded is not None and settings.text.strip() and not fits_full_maps(loaded, settings.text)
    if mode == "rollout" and long_text:  # the other views serve a long text from pooled maps
        st.error("Rollout multiplies the full maps of every layer, which a text this long does not keep (they "
                 "would pass the per-capture limit, ATTNVIZ_FULL_MAPS_MB). What would fit: a shorter text, or "
                 "the weight, value or logits view.")
        st.stop()
    cap = current_capture(settings, loaded, extras=EXTRAS.get(mode, ()))
    if cap is not None:
        st.caption(f"{cap.meta['model']} · `{cap.arch}` · {cap.n_tokens} tokens · "
                   f"forward {cap.timing['forward_s']:.2f} s")
        show(cap, mode)
        show_overview(cap)
