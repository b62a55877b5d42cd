"""Compare A vs B: the same layer and head under two architectures, or one architecture with and
without an intervention (docs/methods.md#interventions), and the effect on the output."""

import pandas as pd
import streamlit as st

from attnviz.effects import compare
from attnviz.figures import export
from attnviz.figures import cosine_figure, difference, panels, sink_mass_change
from attnviz.figures.heatmaps import head_label
from ui.export import figure_downloads
from ui.cache import get_capture
from ui.sidebar import page_context
from ui.docs import definitions

settings, loaded = page_context()
st.title("Compare A vs B")
definitions("interventions", "sink-key-and-shift-rate", "bos-control")
if loaded is not None and settings.text.strip():
    mode = st.radio("Compare", ["two architectures", "with and without an intervention",
                                "without and with a BOS token first"], horizontal=True, key="cmp_mode")
    c1, c2 = st.columns(2)
    if mode == "two architectures":
        spec_a = c1.text_input("Architecture A", settings.arch, key="cmp_a")
        spec_b = c2.text_input("Architecture B", f"mask0-bidir(k={min(8, loaded.n_layers)})", key="cmp_b")
        sides = [(spec_a, settings.intervene, settings.prepend), (spec_b, settings.intervene, settings.prepend)]
    elif mode == "without and with a BOS token first":  # Barbero et al. 2025: what the first token does
        spec = c1.text_input("Architecture (A and B)", settings.arch, key="cmp_arch")
        sides = [(spec, settings.intervene, None), (spec, settings.intervene, "bos")]
    else:
        spec = c1.text_input("Architecture (A and B)", settings.arch, key="cmp_arch")
        act = c2.text_input("Intervention of B (A has none)",
                            settings.intervene or f"sinkscale(beta=0.3)@{max(0, loaded.n_layers - 10)}-{loaded.n_layers - 1}",
                            key="cmp_intervene")
        sides = [(spec, None, settings.prepend), (spec, act, settings.prepend)]
    recipes = [settings.recipe(loaded, spec, intervene=act, prepend=first) for spec, act, first in sides]
    a, b = (None if r is None else get_capture(loaded, settings.text, r) for r in recipes)
    if a is not None and b is not None:
        c1, c2 = st.columns([3, 2])
        layer = c1.slider("Layer", 0, loaded.n_layers - 1, loaded.n_layers - 1, key="cmp_layer")
        head = c2.selectbox("Head", ["mean"] + list(range(a.n_heads)), key="cmp_head",
                            format_func=lambda h: "mean over heads" if h == "mean" else head_label(a, h))
        head = None if head == "mean" else int(head)
        names = [c.arch + (f" · {c.meta['intervene']}" if c.meta.get("intervene") else "")
                 + (" · BOS first" if c.meta.get("prepend") else "") for c in (a, b)]
        fig = panels([a, b], [f"A: {names[0]}", f"B: {names[1]}"], layer, head)
        st.plotly_chart(fig, width="stretch", key="cmp_panels")
        figure_downloads(fig, export.describe(a, layer, head, arch=f"{names[0]} vs {names[1]}", figure="ab"),
                         key="cmp_x")
        aligned = a.n_tokens == b.n_tokens  # a BOS token first makes B one token longer: no cell-by-cell difference
        left, right = st.columns(2)
        if aligned:
            left.plotly_chart(difference(a, b, layer, head), width="stretch", key="cmp_diff")
        else:
            left.caption("B has one more token (the BOS token first), so the maps are compared side by side and by "
                         "the first key's mass, not cell by cell.")
        right.plotly_chart(sink_mass_change(a, b, layer), width="stretch", key="cmp_sink")

        st.subheader("Effect on the output")
        kl = compare.kl_divergence(a, b)
        st.metric("KL(A ‖ B) of the next-token distribution", f"{kl:.4f} nats")
        decode = loaded.tokenizer.decode
        top_a, top_b = compare.top_tokens(a, 5), compare.top_tokens(b, 5)
        st.dataframe(pd.DataFrame({
            "A token": [repr(decode([i])) for i, _ in top_a], "A p": [p for _, p in top_a],
            "B token": [repr(decode([i])) for i, _ in top_b], "B p": [p for _, p in top_b],
        }), hide_index=True)
        if a.hidden is not None and b.hidden is not None and aligned:
            st.plotly_chart(cosine_figure(a, b), width="stretch", key="cmp_cos")
        else:
            st.caption("No cosine similarity per layer: hidden states are not recorded under a residual variant, "
                       "nor for a long text (its captures keep statistics and pooled maps).")
else:
    st.warning("Load a model and give a text in the sidebar.")
