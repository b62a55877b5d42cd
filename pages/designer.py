"""Mask designer: the picture of an architecture, a per-layer list editor, StableMask's pseudo-attention."""

import streamlit as st

from attnviz import defaults
from attnviz.core.spec import arch as arch_mod
from attnviz.errors import AttnvizError
from attnviz.figures import architecture_masks, stablemask_pseudo
from ui.export import figure_downloads
from ui.sidebar import page_context
from ui.docs import definitions

settings, loaded = page_context()
n_layers = loaded.n_layers if loaded is not None else 30
st.title("Mask designer")
definitions("masks", "per-layer-architectures", "the-call-syntax", "stablemask")
c1, c2 = st.columns([3, 1])
n = c2.slider("Tokens shown", 4, 24, defaults.one(architecture_masks, "n"), key="md_n")
try:
    architecture = arch_mod.parse(settings.arch, n_layers)
except AttnvizError as err:
    st.error(f"Architecture: {err}")
    architecture = None
if architecture is not None:
    c1.markdown(f"**{architecture.spec}** on {n_layers} layers")
    fig = architecture_masks(architecture, n)
    st.plotly_chart(fig, width="stretch", key="md_masks")
    figure_downloads(fig, {"tool": "attnviz", "arch": architecture.spec, "n_layers": n_layers,
                           "figure": "masks"}, key="md_x")

    st.subheader("Edit the per-layer list")
    edited = st.text_area("Bottom layer first; counts must add up to the layer count",
                          architecture.as_list(), key="md_edit")
    try:
        preview = arch_mod.parse(edited, n_layers)
        st.success(f"valid: {preview.spec}")
        if st.button("Use this architecture", key="md_apply"):
            st.session_state["arch_apply"] = preview.spec  # the sidebar picks it up before drawing its widgets
            st.rerun()
    except AttnvizError as err:
        st.error(str(err))

st.subheader("StableMask pseudo-attention")
g1, g2 = st.columns(2)
gamma = g1.slider("gamma", 0.05, 2.0, defaults.one(stablemask_pseudo, "gamma"), 0.05, key="md_gamma")
alibi = g2.toggle("ALiBi slopes per head (head 0 shown)", key="md_alibi")
st.plotly_chart(stablemask_pseudo(n, "alibi" if alibi else gamma), width="stretch", key="md_stable")
st.caption("Future slots get the pseudo-score −γ·j; after the softmax they are zeroed without renormalising, "
           "so each row keeps less than 1 (the discarded mass) and the first token no longer has to absorb it.")
