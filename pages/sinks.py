"""Attention sinks: of one text (attention to a key by query position, alpha and sink rate per head,
allocation, and why: value norms and massive activations) or of a dataset (Gu et al.'s protocol)."""

import numpy as np
import pandas as pd
import streamlit as st

from attnviz import corpus, defaults
from attnviz.effects import dataset
from attnviz.effects.compare import describe_sinks
from attnviz.figures import export
from attnviz.stats import metrics
from attnviz.core.spec.arch import parse
from attnviz.errors import AttnvizError
from attnviz.figures import (allocation_bars, alpha_by_key, alpha_grid, averaged_map, discarded_figure, key_profile,
                             massive_activations, rate_bars, sink_grid, sink_map, sink_shares, top_activation_rows)
from attnviz.figures.sinks import learned_grid
from attnviz.effects import valley
from attnviz.figures.valley import valley_figure
from ui import cache, jobs
from ui.export import data_downloads, figure_downloads
from attnviz.recipe import Recipe
from ui.sidebar import current_capture, page_context
from ui.docs import definitions

settings, loaded = page_context()
st.title("Attention sinks")
definitions("alpha", "sink-rate", "auto-key", "sinks-at-any-key", "entropy", "discarded-mass", "allocation-by-token-type")


def gu_preset() -> None:
    st.session_state["sk_maxlen"] = dataset.GU_PRESET["max_len"]
    st.session_state["sk_eps"] = dataset.GU_PRESET["eps"]


def one_text(eps: float) -> None:
    cap = current_capture(settings, loaded)
    if cap is None:
        return
    # where the sinks are, at any key: the first token, a delimiter, any other (secondary sinks in red)
    fig_w = sink_map(cap, eps)
    st.plotly_chart(fig_w, width="stretch", key="sk_where")
    figure_downloads(fig_w, export.describe(cap, figure="sink-map", eps=eps), key="sk_where_x")
    st.caption(f"Sinks (alpha > {eps:g} in some head, [definition](definitions#sinks-at-any-key)), every key "
               f"ringed above with the layers where it is one: {describe_sinks(cap, eps, every=True)}.")
    auto = cap.memo("auto_key", lambda: int(np.bincount([metrics.auto_key(cap.allowed[l]) for l in cap.layers]).argmax()))
    key = st.number_input("Key", 0, cap.n_tokens - 1, min(auto, cap.n_tokens - 1), key="sk_key",
                          help="starts at the first key the mask leaves open to its queries: 0 is the first token, "
                               "m under NoSink-m ([definition](definitions#auto-key))")
    rate = metrics.sink_rate(np.stack([cap.stat(l, "alpha")[:, key] for l in cap.layers]), eps)
    st.metric(f"Sink rate at key {key} ({cap.tokens[key]!r}), all layers and heads",
              "undefined" if np.isnan(rate) else f"{rate:.0%}",
              help="share of heads with alpha > eps, over the heads where alpha is defined ([definition](definitions#sink-metrics))")
    fig = key_profile(cap, key)
    st.plotly_chart(fig, width="stretch", key="sk_profile")
    figure_downloads(fig, export.describe(cap, figure=f"key{key}-profile"), key="sk_profile_x")
    left, right = st.columns(2)
    with left:
        fig_a = alpha_grid(cap, key)
        st.plotly_chart(fig_a, width="stretch", key="sk_alpha")
        figure_downloads(fig_a, export.describe(cap, figure=f"alpha{key}"), key="sk_alpha_x")
    with right:
        fig_s = sink_grid(cap, key, eps)
        st.plotly_chart(fig_s, width="stretch", key="sk_sinks")
        figure_downloads(fig_s, export.describe(cap, figure=f"sinks{key}", eps=eps), key="sk_sinks_x")
    fig_l = learned_grid(cap, eps)
    if fig_l is not None:  # a model with a learned sink logit per head (gpt-oss)
        st.plotly_chart(fig_l, width="stretch", key="sk_learned")
        figure_downloads(fig_l, export.describe(cap, figure="learned-sink", eps=eps), key="sk_learned_x")
        st.caption("This model gives each head a learned sink logit that takes a share of every row and is dropped: "
                   "its alpha (the share averaged over the queries) per head, beside each key's above; the map of "
                   "where the sinks are draws it as the column \"sink\" ([definition]"
                   "(definitions#the-learned-sink-as-a-key)).")
    fig_b = allocation_bars(cap)
    st.plotly_chart(fig_b, width="stretch", key="sk_alloc")
    figure_downloads(fig_b, export.describe(cap, figure="allocation"), key="sk_alloc_x")
    discarded = max(float(cap.stat(l, "discarded").max()) for l in cap.layers)
    if discarded > 1e-3:
        st.plotly_chart(discarded_figure(cap), width="stretch", key="sk_discarded")
    else:
        st.caption("Rows sum to 1 in every layer: no discarded mass (StableMask or learned sinks would show here).")
    data_downloads(cap, key="sk_data")
    compression_valley(eps)

    st.subheader("Why is it a sink?")
    if not st.toggle("Value norms and massive activations (one more pass that records them)", key="sk_why"):
        return
    why = current_capture(settings, loaded, extras=("activations", "value_norms"))
    if why is None:
        return
    fig_v = sink_shares(why, key)
    st.plotly_chart(fig_v, width="stretch", key="sk_shares")
    st.caption("Kobayashi et al. 2020: a head's output is Σ_j A[i,j]·W_O v_j. The sink takes a large share of the "
               "weights A but its value vector is small, so its share of the output norm ‖A[i,j]·W_O v_j‖ is much "
               "lower: attention parks there without moving the output much.")
    figure_downloads(fig_v, export.describe(why, figure=f"value-share{key}"), key="sk_shares_x")
    fig_m = massive_activations(why)
    st.plotly_chart(fig_m, width="stretch", key="sk_massive")
    st.caption("Sun et al. 2024: a few hidden-state dimensions take values orders of magnitude above the rest, on "
               "the same tokens that become sinks; the markers are each layer's sink key.")
    figure_downloads(fig_m, export.describe(why, figure="massive-activations"), key="sk_massive_x")
    st.dataframe(pd.DataFrame(top_activation_rows(why)), hide_index=True, height=240)


def compression_valley(eps: float) -> None:
    """Queipo-de-Llano et al.'s Fig. 1 on the sidebar's text and recipe: the entropy of each layer's input beside
    the sink and the first token's norm, from one more forward (attnviz.effects.valley), cached like the others."""
    st.subheader("The compression valley")
    definitions("the-compression-valley")
    if not st.toggle("Entropy of each layer's input beside the sink (one more forward)", key="sk_valley"):
        return
    recipe = settings.recipe(loaded)
    if recipe is None:
        return
    found = jobs.run(("valley", recipe.key, settings.text), f"Measuring the compression valley under {recipe.arch}",
                     lambda progress: valley.measure(loaded, settings.text, recipe, cache.budget(), cache.job_tokens(),
                                                     lambda layer: progress(layer + 1, loaded.n_layers)))
    if found is None:
        return
    fig = valley_figure(found, eps)
    st.plotly_chart(fig, width="stretch", key="sk_valley_fig")
    meta = {"tool": "attnviz", "model": found.model, "arch": found.arch, "tokens": found.n_tokens, "eps": eps,
            "figure": "compression-valley"}
    figure_downloads(fig, meta, key="sk_valley_x")
    low = found.valley()
    if low is not None:
        at = found.layers.index(low)
        rate = found.sink_rate(eps)[at]
        st.caption(f"The lowest entropy enters layer {low} (H = {found.entropy[at]:.3f}, from "
                   f"{found.entropy[0]:.3f} entering layer 0); there the first token's norm is "
                   f"{found.first_norm[at]:,.1f} (layer 0: {found.first_norm[0]:,.1f}) and the sink rate at key "
                   f"{found.keys[at]} is {'undefined' if np.isnan(rate) else f'{rate:.0%}'}. H: {found.variant}.")
    st.download_button("Per-layer entropy, norm and sink rate (.csv)", export.csv_bytes(pd.DataFrame(found.rows(eps))),
                       key="sk_valley_csv", mime="text/csv", file_name=export.filename(meta, "csv"))


def over_a_dataset(eps: float) -> None:
    c1, c2, c3, c4 = st.columns([2, 1, 1, 1])
    sources = {"Python reference docs (stdlib)": "stdlib", "Lines of the sidebar text": "sidebar"}
    source = sources[c1.selectbox("Samples from", list(sources), key="sk_ds_source")]
    unit = c2.radio("One sample per", ["doc", "line"], horizontal=True, key="sk_ds_unit",
                    index=1 if source == "sidebar" else 0)
    run = defaults.of(dataset.sinks)
    max_len = int(c3.number_input("Tokens T", 2, 512, run["max_len"], key="sk_maxlen",
                                  help="the first T tokens of each sample"))
    n_samples = int(c4.number_input("Samples", 1, 2000, run["n_samples"], key="sk_samples"))
    c5, c6, c7 = st.columns([2, 1, 1])
    spec = c5.text_input("Architecture", settings.arch, key="sk_ds_arch")
    c6.button("Gu et al. preset", on_click=gu_preset, key="sk_gu",
              help="T = 64 tokens and eps = 0.3, as in Gu et al. (ICLR 2025) Table 1")
    choice = c7.selectbox("Key", ["auto"] + list(range(max_len)), key="sk_ds_key",
                          help="auto: the first key each layer's mask leaves open to its queries (0 under fwd, "
                               "m under nosink-fwd(m)); [definition](definitions#auto-key)")
    key_pos = "auto" if choice == "auto" else int(choice)
    try:
        architecture = parse(spec, loaded.n_layers)
        made = Recipe.of(loaded, architecture.spec, kind=settings.kind)  # the sidebar's attention kind too
        docs = corpus.stdlib().documents if source == "stdlib" else corpus.from_text(settings.text, "the sidebar text").documents
    except AttnvizError as err:
        st.error(str(err))
        return
    job = ("dataset", loaded.model_id, source, docs if source == "sidebar" else (), unit, max_len, n_samples,
           made.key)
    if not jobs.cached(job) and not st.button("Run over the dataset", key="sk_ds_run", type="primary"):
        st.caption(f"Up to {n_samples} samples of {max_len} tokens under `{architecture.spec}`, in batches.")
        return
    result = jobs.run(job, f"Sinks over {n_samples} samples", lambda progress: dataset.sinks(
        loaded, docs, made, unit, max_len, n_samples, on_progress=progress))
    if result is None:
        return
    doc = result.as_json(key_pos, eps)
    if "note" in doc:
        st.info(doc["note"].capitalize() + ".")
    overall = doc["model_rate"]
    st.metric(f"Sink rate at key {key_pos}, whole model, {result.n_samples} samples",
              "undefined" if overall["mean"] is None else f"{overall['mean']:.1%}",
              None if overall["mean"] is None else
              f"95% interval {overall['ci95'][0]:.1%} – {overall['ci95'][1]:.1%}", delta_color="off")
    meta = {"tool": "attnviz", "model": loaded.model_id, "arch": result.arch, "samples": result.n_samples,
            "max_len": max_len, "unit": unit, "source": source, "eps": eps}
    fig = rate_bars(result, key_pos, eps)
    st.plotly_chart(fig, width="stretch", key="sk_ds_rates")
    figure_downloads(fig, {**meta, "figure": f"dataset-sink-rate{key_pos}"}, key="sk_ds_rates_x")
    fig_k = alpha_by_key(result)
    st.plotly_chart(fig_k, width="stretch", key="sk_ds_alpha")
    figure_downloads(fig_k, {**meta, "figure": "dataset-alpha-by-key"}, key="sk_ds_alpha_x")
    if result.n_full:
        c1, c2, c3 = st.columns([3, 2, 1])
        layer = c1.slider("Layer", 0, loaded.n_layers - 1, loaded.n_layers - 1, key="sk_ds_layer")
        head = c2.select_slider("Head", ["mean"] + list(range(loaded.n_heads)), key="sk_ds_head")
        spread = c3.toggle("Std over samples", key="sk_ds_spread")
        fig_m = averaged_map(result, layer, None if head == "mean" else int(head), spread)
        st.plotly_chart(fig_m, width="stretch", key="sk_ds_map")
        figure_downloads(fig_m, {**meta, "figure": "dataset-map", "layer": layer, "head": head}, key="sk_ds_map_x")
    learned = [r for r in doc["layers"] if "learned_sink_rate" in r]
    if learned:  # a model with a learned sink logit per head: its own sink, beside the keys'
        st.caption("The model's learned sink (a logit per head that takes a share of every row) is a sink in "
                   + ", ".join(f"layer {r['layer']}: {r['learned_sink_rate']['mean']:.0%}" for r in learned)
                   + " of heads (its alpha > eps; [definition](definitions#the-learned-sink-as-a-key)).")
    rows = pd.DataFrame([{"layer": r["layer"], "mask": r["mask"], "sink_rate": r["sink_rate"]["mean"],
                          "ci95_low": (r["sink_rate"]["ci95"] or [None])[0],
                          "ci95_high": (r["sink_rate"]["ci95"] or [None, None])[1],
                          **({"learned_sink_rate": r["learned_sink_rate"]["mean"]} if learned else {})}
                         for r in doc["layers"]])
    st.download_button("Per-layer rates (.csv)", export.csv_bytes(rows), key="sk_ds_csv", mime="text/csv",
                       file_name=export.filename({**meta, "figure": "dataset-rates"}, "csv"))


if loaded is None:
    st.warning("Load a model in the sidebar.")
else:
    c1, c2 = st.columns([2, 3])
    view = c1.radio("Sinks of", ["one text", "a dataset"], horizontal=True, key="sk_view")
    eps = c2.slider("Sink threshold eps (alpha > eps)", 0.05, 0.95, metrics.SINK_EPS, 0.05, key="sk_eps")
    (one_text if view == "one text" else over_a_dataset)(eps)
