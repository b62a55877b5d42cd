"""Attention sinks: attention to a key by query position, alpha and sink rate per head, allocation."""

import numpy as np
import streamlit as st

from attnviz import export, metrics
from attnviz.figures import allocation_bars, alpha_grid, discarded_figure, key_profile, sink_grid
from ui.export import data_downloads, figure_downloads
from ui.state import current_capture

settings, loaded = st.session_state["settings"], st.session_state["loaded"]
st.title("Attention sinks")
cap = current_capture(settings, loaded)
if cap is not None:
    c1, c2 = st.columns(2)
    key = c1.number_input("Key", 0, cap.n_tokens - 1, 0, key="sk_key",
                          help="0 is the first token; under NoSink-m look at key m")
    eps = c2.slider("Sink threshold eps (alpha > eps)", 0.05, 0.95, 0.3, 0.05, key="sk_eps")
    rate = metrics.sink_rate(np.stack([cap.stat(l, "alpha")[:, key] for l in cap.layers]), eps)
    st.metric(f"Sink rate at key {key} ({cap.tokens[key]!r}), all layers and heads",
              "undefined" if np.isnan(rate) else f"{rate:.0%}",
              help="share of heads with alpha > eps, over the heads where alpha is defined (SPEC §6)")
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
    fig_b = allocation_bars(cap)
    st.plotly_chart(fig_b, width="stretch", key="sk_alloc")
    figure_downloads(fig_b, export.describe(cap, figure="allocation"), key="sk_alloc_x")
    discarded = max(float(cap.stat(l, "discarded").max()) for l in cap.layers)
    if discarded > 1e-3:
        st.plotly_chart(discarded_figure(cap), width="stretch", key="sk_discarded")
    else:
        st.caption("Rows sum to 1 in every layer: no discarded mass (StableMask or learned sinks would show here).")
    data_downloads(cap, key="sk_data")
