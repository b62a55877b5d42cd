"""Walkthrough (seeds 001 and 004): scaled dot-product attention with a mask, one step at a time."""

import numpy as np
import streamlit as st

from attnviz import defaults
from attnviz.effects import walkthrough as W
from attnviz.errors import InputError
from attnviz.figures import labelled_matrix
from ui.sidebar import page_context
from ui.docs import definitions

page_context()  # a fresh server's first request may come here directly: route it through app.py

st.title("Walkthrough: attention with a mask, step by step")
definitions("masks", "linformer-what-if")
st.markdown("Edit **Q**, **K**, **V** (rows are tokens; defaults: the lecture's practice matrices) and pick "
            "a mask. Every step below is the actual matrix.")


def fmt(matrix) -> str:
    return "\n".join(", ".join(f"{x:g}" for x in row) for row in matrix)


c1, c2, c3, c4 = st.columns(4)
q_text = c1.text_area("Q", fmt(W.Q), key="wt_q")
k_text = c2.text_area("K", fmt(W.K), key="wt_k")
v_text = c3.text_area("V", fmt(W.V), key="wt_v")
mask_name = c4.selectbox("Mask", list(W.MASKS), list(W.MASKS).index(defaults.one(W.steps, "mask_name")), key="wt_mask")
tokens_text = c4.text_input("Token labels", "The cat sat", key="wt_tokens")
try:
    q, k, v = W.parse_matrix(q_text, "Q"), W.parse_matrix(k_text, "K"), W.parse_matrix(v_text, "V")
    result = W.steps(q, k, v, mask_name)
except InputError as err:
    st.error(str(err))
    st.stop()

labels = tokens_text.split()
rows = labels if len(labels) == q.shape[0] else [f"q{i}" for i in range(q.shape[0])]
cols = labels if len(labels) == k.shape[0] else [f"k{j}" for j in range(k.shape[0])]
d_k = k.shape[1]
s1, s2 = st.columns(2)
s1.plotly_chart(labelled_matrix(result["scores"], f"1. scores QKᵀ/√{d_k}", rows, cols), key="wt_scores")
s2.plotly_chart(labelled_matrix(result["masked"], f"2. + {mask_name} mask", rows, cols), key="wt_masked")
s3, s4 = st.columns(2)
s3.plotly_chart(labelled_matrix(result["weights"], "3. softmax → weights (rows)", rows, cols, fmt=".3f"),
                key="wt_weights")
s4.plotly_chart(labelled_matrix(result["output"], "4. output = weights · V", rows,
                                [f"v{j}" for j in range(v.shape[1])]), key="wt_output")
if np.abs(result["discarded"]).max() > 1e-9:
    st.info("StableMask: rows keep " + ", ".join(f"{1 - d:.3f}" for d in result["discarded"]) +
            " of their mass; the rest went to the pseudo-slots and was discarded.")

st.subheader("Why the causal mask prevents leakage")
st.markdown(
    "In training, every position predicts the **next** token in one pass. Without a mask, the row of "
    f"'{rows[0]}' would put weight on the keys after it, including the very token it must predict, so the model "
    "could copy the answer instead of learning to predict it. The causal (FWD) mask sets those future scores to "
    "−∞ before the softmax: their weights become exactly 0, and the output of each row mixes only the values of "
    "tokens at or before it. Switch the mask to BIDIR above and watch the upper triangle of step 3 fill in: that "
    "is the leak.")

st.subheader("Linformer: project the sequence to k slots")
st.markdown("Linformer (seed 004) multiplies K and V by k × n matrices E and F, so each query scores k slots "
            "instead of n keys: linear in n. Every slot mixes early and late positions, so there is no causal "
            "Linformer; it approximates full (unmasked) attention. At k = n segment means are the identity.")
l1, l2 = st.columns(2)
slots = l1.slider("k slots", 1, k.shape[0], max(1, k.shape[0] - 1), key="wt_lin_k")
projections = ["segment", "gaussian"]
method = l2.radio("Projection", projections, projections.index(defaults.one(W.linformer_steps, "method")),
                  horizontal=True, key="wt_lin_projection",
                  help="segment: slot s averages positions s·n/k .. (s+1)·n/k − 1; gaussian: seeded N(0, 1/k)")
try:
    lin = W.linformer_steps(q, k, v, slots, method)
except InputError as err:
    st.error(str(err))
    st.stop()
slot_names = [f"s{s}" for s in range(slots)]
m1, m2 = st.columns(2)
m1.plotly_chart(labelled_matrix(lin["E"], "E (k × n)", slot_names, cols, fmt=".2f"), key="wt_lin_e")
m2.plotly_chart(labelled_matrix(lin["F"], "F (k × n)", slot_names, cols, fmt=".2f"), key="wt_lin_f")
m3, m4 = st.columns(2)
m3.plotly_chart(labelled_matrix(lin["weights"], "softmax(Q (EK)ᵀ/√d)", rows, slot_names, fmt=".3f"), key="wt_lin_p")
m4.plotly_chart(labelled_matrix(lin["output"], "output = P · FV", rows, [f"v{j}" for j in range(v.shape[1])]),
                key="wt_lin_out")
st.metric("Relative error against full softmax attention", f"{lin['error']:.2%}")
