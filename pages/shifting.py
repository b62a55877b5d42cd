"""Sink shifting (seed 000): hide the first key(s) and watch the sink move to the next one."""

import re

import streamlit as st

from attnviz.figures import export
from attnviz.effects.compare import describe_sinks, main_sink
from attnviz.stats import metrics
from attnviz.figures import shift_panels, shift_rate_figure, sink_key_grids, where_sinks_went
from ui.export import figure_downloads, report_download
from ui.cache import get_capture
from ui.sidebar import page_context
from ui.docs import definitions

settings, loaded = page_context()
st.title("Sink shifting")
definitions("per-layer-architectures", "sink-key-and-shift-rate", "sinks-at-any-key")
st.markdown("Hide the first key in **every** layer (NoSink; keys 0..m-1 with m), or turn the top layers "
            "bidirectional without it (MASK0-BIDIR), and see where the sink goes on this model and text.")
if loaded is not None and settings.text.strip():
    k = min(8, loaded.n_layers)
    shown = ["fwd", "nosink-fwd", "nosink-fwd(m=2)", f"mask0-bidir(k={k})"]
    text = st.text_input("Architectures, 2 to 4, separated by ';'", "; ".join(shown), key="sh_archs")
    specs = [s.strip() for s in text.split(";") if s.strip()]
    if not 2 <= len(specs) <= 4:
        st.error(f"Give 2 to 4 architectures separated by ';' (got {len(specs)}).")
    else:
        recipes = [settings.recipe(loaded, s) for s in specs]
        caps = [None if r is None else get_capture(loaded, settings.text, r) for r in recipes]
        if all(c is not None for c in caps):
            # what this page measured, not what it expects: Gemma 3's sink, for one, moves to a "." (docs/methods.md)
            st.markdown(f"Measured on **{caps[0].meta['model']}** and this text, each layer's strongest sink (alpha > "
                        f"{metrics.SINK_EPS:g} in some head): "
                        + "; ".join(f"under `{c.arch}`, {main_sink(c)}" for c in caps) + ".")
            layer = st.slider("Layer", 0, loaded.n_layers - 1, loaded.n_layers - 1, key="sh_layer")
            titles = [c.arch for c in caps]
            fig = shift_panels(caps, titles, layer)
            st.plotly_chart(fig, width="stretch", key="sh_panels")
            figure_downloads(fig, export.describe(caps[0], layer, None, arch=" vs ".join(titles),
                                                  figure="shift"), key="sh_panels_x")
            st.plotly_chart(sink_key_grids(caps, titles), width="stretch", key="sh_keys")
            # where the sink went, at any key (not only key m): a delimiter, a later token, or nowhere
            st.plotly_chart(where_sinks_went(caps, titles), width="stretch", key="sh_went")
            st.markdown("\n".join(f"- **{title}**: {describe_sinks(cap)}" for cap, title in zip(caps, titles)))
            # m of each NoSink architecture (its top layer's mask), for "sink moved from key 0 to key m"
            ms = [int(found[1]) if (found := re.search(r"m=(\d+)", c.layer_masks[-1])) else 1 for c in caps[1:]]
            st.plotly_chart(shift_rate_figure(caps[0], caps[1:], titles[1:], ms), width="stretch", key="sh_rate")
            report_download(caps, settings.model, key="sh_report")
else:
    st.warning("Load a model and give a text in the sidebar.")
