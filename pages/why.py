"""Why: what makes a head attend where it does: one score by rotary pair and by source, its position-free
counterfactual, the layer's sink diagnosis and the head's query-key view (docs/methods.md#score-attribution)."""

import pandas as pd
import streamlit as st

from attnviz.effects.explain import diagnose, query_key_view
from attnviz.errors import AttnvizError
from attnviz.figures.why import attribution_figure, diagnosis_figure, query_key_figure
from ui.cache import get_residual
from ui.docs import definitions
from ui.export import figure_downloads
from ui.sidebar import page_context

settings, loaded = page_context()
st.title("Why: what makes a head attend there")
definitions("score-attribution", "the-sinks-diagnosis", "query-key-view")


def _param(name: str, default):
    """A cell opened from the Heatmaps page arrives as ?layer=..&head=..&query=..&key=.."""
    value = st.query_params.get(name)
    if value is None:
        return default
    return value if value == "all" else int(value) if value.lstrip("-").isdigit() else default


if loaded is None:
    st.warning("Load a model in the sidebar.")
    st.stop()
run = get_residual(loaded, settings.text, settings.arch, settings.intervene, settings.prepend, settings.residual)
if run is None:
    st.stop()
n = run.n_tokens
asked = tuple(st.query_params.get(k) for k in ("layer", "head", "query", "key"))
if "why_layer" not in st.session_state or (any(asked) and asked != st.session_state.get("why_asked")):
    # a first visit, or a new cell from the Heatmaps page's link: that cell, else the top layer's sink
    st.session_state["why_asked"] = asked
    st.session_state["why_layer"] = min(max(_param("layer", loaded.n_layers - 1), 0), loaded.n_layers - 1)
    st.session_state["why_head"] = min(max(_param("head", 0), 0), loaded.n_heads - 1)
    query = _param("query", "all")
    st.session_state["why_query"] = query if query == "all" or 0 <= query < n else "all"
    key = _param("key", None)
    if key is not None and 0 <= key < n:
        st.session_state["why_key"] = key
    else:
        st.session_state.pop("why_key", None)
c1, c2, c3, c4 = st.columns([3, 1, 1, 1])
layer = c1.slider("Layer", 0, loaded.n_layers - 1, key="why_layer")
head = c2.selectbox("Head", list(range(loaded.n_heads)), key="why_head")
sink = run.sink_key(layer, head)
if st.session_state.get("why_key", 0) >= n:
    st.session_state["why_key"] = sink
key = int(c3.number_input("Key", 0, n - 1, sink, key="why_key", help=f"this head's sink key is {sink}"))
choices = ["all"] + list(range(n))
if st.session_state.get("why_query") not in choices:
    st.session_state["why_query"] = "all"
query = c4.selectbox("Query", choices, key="why_query", help="all: the mean over every query that may see the key")
try:
    e = run.explain(layer, head, query, key)
except AttnvizError as err:
    st.error(str(err))
    st.stop()
meta = {"tool": "attnviz", **e.recipe, "text": settings.text, "layer": layer, "head": head, "query": query, "key": key}
m1, m2, m3, m4 = st.columns(4)
m1.metric("Score s_ij", f"{e.score:.4g}", help="q_i · k_j · scaling, before any mask or intervention")
m2.metric("Without rotation", f"{e.nope_score:.4g}", f"{e.nope_score - e.score:+.3g}", delta_color="off",
          help="the same product with no rotary rotation: how much of the score position makes")
m3.metric("Top 4 rotary pairs", f"{e.top_pairs_share(4):.0%}", help="their share of Σ_p |c_p|")
split = e.key_split
m4.metric("Key side: MLP / attention / embedding", " / ".join(f"{split[k]:.3g}" for k in ("mlp", "attn", "embed")))
fig = attribution_figure(e)
st.plotly_chart(fig, width="stretch", key="why_attribution")
figure_downloads(fig, {**meta, "figure": "attribution"}, key="why_attribution_x")
st.caption(f"Key {key} is {e.tokens[1]!r}; averaged over {e.queries} quer{'y' if e.queries == 1 else 'ies'}. Each "
           "bar chart sums to the score: the pairs exactly, each side's sources with the layer's norm scale frozen.")
with st.expander("Numbers (CSV)"):
    rows = pd.DataFrame([{"part": f"pair {p}", "frequency": e.frequencies[p], "contribution": c}
                         for p, c in enumerate(e.by_pair)]
                        + [{"part": f"key side {s}", "contribution": v} for s, v in e.key_sources.items()]
                        + [{"part": f"query side {s}", "contribution": v} for s, v in e.query_sources.items()])
    st.dataframe(rows, hide_index=True, height=240)
    st.download_button("Attribution (.csv)", rows.to_csv(index=False).encode(), key="why_csv", mime="text/csv",
                       file_name=f"attnviz_why_L{layer}_h{head}_q{query}_k{key}.csv")

st.subheader("The sink's diagnosis of this layer")
diagnosis = diagnose(run, layer)
fig_d = diagnosis_figure(diagnosis)
st.plotly_chart(fig_d, width="stretch", key="why_diagnosis")
figure_downloads(fig_d, {**meta, "figure": "diagnosis"}, key="why_diagnosis_x")

st.subheader("Queries and keys of this head (AttentionViz)")
view = query_key_view(run, layer, head)
fig_q = query_key_figure(view)
picked = st.plotly_chart(fig_q, width="stretch", key="why_qk", on_select="rerun", selection_mode="points")
figure_downloads(fig_q, {**meta, "figure": "query-key"}, key="why_qk_x")
points = (picked or {}).get("selection", {}).get("points", []) if picked else []
if points and points[0].get("curve_number") == 0:  # a query: its attention row and its attribution above
    chosen = int(points[0]["point_index"])
    if chosen != st.session_state.get("why_query") and run.allowed(layer)[chosen, key]:
        st.session_state["why_query"] = chosen
        st.rerun()
st.caption("Click a query (a circle) to explain its score on the key above; its attention row is the map's row "
           "on the Heatmaps page.")
