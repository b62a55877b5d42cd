"""Heads: which heads are sinks, streaming heads or inactive (docs/methods.md#head-classes), and the two claims as one-click
tests; which are induction, previous-token, duplicate or dormant heads on repeated random tokens
(docs/methods.md#induction-previous-token-and-duplicate-heads)."""

import streamlit as st

from attnviz import corpus, defaults
from attnviz.figures import export
from attnviz.effects import heads, induction
from attnviz.errors import AttnvizError
from attnviz.figures import heatmap
from attnviz.figures.heads import class_counts, head_classes, repeated_scores
from ui import jobs
from ui.export import figure_downloads
from ui.cache import get_capture
from ui.sidebar import own_kind_only, page_context
from ui.docs import definitions

settings, loaded = page_context()
st.title("Heads: sinks, streaming heads, inactive heads")
definitions("head-classes", "ablate")
st.markdown("Every head of every layer, classified on one text ([definition](definitions#head-classes)): a **sink** head puts more than eps of "
            "its attention on the first token; a **streaming** head keeps at least tau of its attention on the "
            "first s keys plus the last w (DuoAttention's pattern, measured here instead of trained); an "
            "**inactive** head's output norm is under tau of its layer's mean (AHON). A head can hold several: its tile "
            "shows the first of inactive > streaming > sink, and its hover every class it holds. Click a tile to open "
            "its heatmap below.")
SOURCES = ["Python docs: special method names", "The sidebar text"]


def text_of(choice: str, n: int) -> str:
    if choice == "The sidebar text":
        return settings.text
    ids = loaded.tokenizer(corpus.stdlib("specialnames").text, add_special_tokens=False)["input_ids"][:n]
    return loaded.tokenizer.decode(ids)


if loaded is None:
    st.warning("Load a model in the sidebar.")
elif not own_kind_only(settings, "Head classes"):
    tax_defaults = defaults.of(heads.taxonomy)  # every threshold starts at the library's
    c1, c2, c3, c4 = st.columns([3, 1, 1, 1])
    choice = c1.selectbox("Text", SOURCES, key="hd_source")
    n = int(c2.number_input("Tokens", 80, heads.max_tokens(loaded), 384, step=64, key="hd_tokens",
                            help="every layer's maps are kept in fp32 to score the heads: at most ~1 GB of them",
                            disabled=choice == "The sidebar text"))
    s = int(c3.number_input("s: sink keys", 0, 64, tax_defaults["s"], key="hd_s"))
    w = int(c4.number_input("w: recent keys", 1, 4096, tax_defaults["w"], key="hd_w"))
    c1, c2, c3 = st.columns(3)
    eps = c1.slider("eps (sink)", 0.0, 1.0, tax_defaults["eps"], 0.05, key="hd_eps")
    tau_stream = c2.slider("tau (streaming)", 0.0, 1.0, tax_defaults["tau_stream"], 0.05, key="hd_tau_stream")
    tau_inactive = c3.slider("tau (inactive, AHON)", 0.0, 1.0, tax_defaults["tau_inactive"], 0.05,
                             key="hd_tau_inactive")
    text = text_of(choice, n)
    key = ("heads", loaded.model_id, text, settings.arch, s, w)
    found = jobs.run(key, "Scoring every head", lambda progress: heads.taxonomy(
        loaded, [text], settings.arch, s, w, on_progress=progress), units=1)
    if found is not None:
        tax = found.with_thresholds(eps, tau_stream, tau_inactive)
        counts, total = class_counts(tax), tax.sink.size
        for column, name in zip(st.columns(3), ("sink", "streaming", "inactive")):
            holds, drawn = counts[name]
            column.metric(f"{name} heads", f"{holds} ({holds / total:.0%})",
                          help=f"{holds} of the {total} heads hold the test; {drawn} are drawn {name} in the grid "
                               "(a head in several classes is drawn in the first of " + " > ".join(heads.PRECEDENCE) + ")")
        fig = head_classes(tax)
        event = st.plotly_chart(fig, width="stretch", key="hd_grid", on_select="rerun", selection_mode="points")
        points = (event or {}).get("selection", {}).get("points", []) if event else []
        clicked = (int(points[0]["y"]), int(points[0]["x"])) if points else None  # (layer, head)
        if clicked and clicked != st.session_state.get("hd_grid_seen"):  # a new click opens that head's heatmap
            st.session_state["hd_grid_seen"] = st.session_state["hd_open"] = clicked
        figure_downloads(fig, {"tool": "attnviz", "model": loaded.model_id, "arch": tax.arch, "figure": "heads",
                               "eps": eps, "tau_stream": tau_stream, "tau_inactive": tau_inactive, "s": s, "w": w},
                         key="hd_x")

        if "hd_open" in st.session_state:
            layer, head = st.session_state["hd_open"]
            recipe = settings.recipe(loaded)
            cap = None if recipe is None else get_capture(loaded, text, recipe)
            if cap is not None and layer in cap.layers and head < cap.n_heads:
                opened = heatmap(cap, layer, head, log=cap.n_tokens > 256)
                st.plotly_chart(opened, width="stretch", key="hd_heatmap")
                figure_downloads(opened, export.describe(cap, layer, head, figure="head"), key="hd_hx")

        st.subheader("Test the claims on this text")
        left, right = st.columns(2)
        stream_key, ablate_key = ("heads-stream",) + key + (tau_stream,), ("heads-ablate",) + key + (tau_inactive,)
        if left.button("Streaming heads on sink + window, the rest dense", key="hd_claim_stream") \
                or jobs.cached(stream_key):
            try:
                dense, windowed = jobs.run(stream_key, "Perplexity with streaming heads "
                                           "on sink + window", lambda p: heads.streaming_only_perplexity(
                                               loaded, text, tax, settings.arch)) or (None, None)
            except AttnvizError as err:
                left.error(str(err))
                dense = None
            if dense is not None:
                left.metric(f"perplexity, {tax.streaming.sum()} streaming heads on sink(s={s}, w={w})",
                            f"{windowed.perplexity:.3f}", f"{windowed.perplexity - dense.perplexity:+.3f} vs dense "
                            f"{dense.perplexity:.3f}", delta_color="inverse")
        if right.button("Ablate the inactive heads", key="hd_claim_ablate") or jobs.cached(ablate_key):
            try:
                base, ablated, share = jobs.run(ablate_key, "Perplexity with the "
                                                "inactive heads ablated", lambda p: heads.ablate_inactive(
                                                    loaded, text, tax, settings.arch)) or (None, None, 0.0)
            except AttnvizError as err:
                right.error(str(err))
                base = None
            if base is not None:
                right.metric(f"perplexity, {share:.0%} of heads zeroed", f"{ablated.perplexity:.3f}",
                             f"{ablated.perplexity - base.perplexity:+.3f} vs {base.perplexity:.3f}",
                             delta_color="inverse")
                right.metric("next-token accuracy", f"{ablated.accuracy:.1%}",
                             f"{(ablated.accuracy - base.accuracy) * 100:+.1f} points vs {base.accuracy:.1%}")

    st.subheader("Induction, previous-token, duplicate and dormant heads")
    definitions("induction-previous-token-and-duplicate-heads", "dormant-heads")
    st.markdown("Each head scored on random tokens repeated once, BOS r_1..r_L r_1..r_L "
                "([definition](definitions#induction-previous-token-and-duplicate-heads)): the **induction** score is "
                "the second copy's attention to the token after its first occurrence, **previous-token** every "
                "query's to the token before it, **duplicate** the second copy's to its first occurrence; each beside "
                "its random-target baseline. A **dormant** head parks the first copy's queries (nothing to find) on "
                "key 0 and writes little there ([definition](definitions#dormant-heads)).")
    rep_defaults = defaults.of(induction.repeated)
    c1, c2, c3, c4, c5 = st.columns(5)
    longest = max(2, (loaded.max_tokens - 1) // 2)
    length = int(c1.number_input("L: repeated tokens", 2, longest, min(rep_defaults["length"], longest), key="hd_rep_L"))
    samples = int(c2.number_input("Sequences", 1, 64, rep_defaults["samples"], key="hd_rep_n"))
    score = c3.selectbox("Score shown", induction.SCORES, key="hd_rep_score")
    tau = c4.slider("tau (scores)", 0.0, 1.0, rep_defaults["tau"], 0.05, key="hd_rep_tau")
    share = c5.slider("dormant: output share", 0.0, 1.0, rep_defaults["share"], 0.05, key="hd_rep_share")
    rep_key = ("heads-repeated", loaded.model_id, settings.arch, length, samples)
    try:
        scored = jobs.run(rep_key, "Scoring every head on repeated random tokens", lambda progress: induction.repeated(
            loaded, settings.arch, length, samples), units=1)
    except AttnvizError as err:
        st.error(str(err))
        scored = None
    if scored is not None:
        scored = scored.with_thresholds(tau=tau, share=share)
        for column, name in zip(st.columns(4), (*induction.SCORES, "dormant")):
            column.metric(f"{name.replace('_', '-')} heads", int(scored.holds(name).sum()))
        fig_rep = repeated_scores(scored, score)
        st.plotly_chart(fig_rep, width="stretch", key="hd_rep_grid")
        found_heads = scored.heads_of(score)
        st.caption(f"{score.replace('_', '-')} heads: " + (", ".join(f"{l}.{h} ({s:.2f})" for l, h, s in found_heads)
                                                           or "none at this tau"))
        figure_downloads(fig_rep, {"tool": "attnviz", "model": loaded.model_id, "arch": scored.arch,
                                   "figure": "heads-repeated", "score": score, "L": length, "sequences": samples,
                                   "tau": tau, "share": share}, key="hd_rep_x")
