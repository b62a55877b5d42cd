"""The client-side heatmap viewer (:mod:`attnviz.viewer`) as a Streamlit custom component
(``st.components.v2``, Streamlit >= 1.67).

The browser gets each layer's images once and moves through layers, heads and scales itself; the
server is asked only for layers it has not sent (``want``: a payload holds the layers around the
current one while they fit :data:`attnviz.viewer.payload.BUDGET_BYTES`, every layer of a short
text) and for full-resolution regions (``region``, a box drag). Where the view rests, the
component reports it (``view``, debounced) so exports and zooms follow without a rerun per move.
The component mounts without a shadow root (``isolate_styles=False``): its classes all start
``avz-``, and the page's tests and benchmarks can see its elements.
"""

from __future__ import annotations

import streamlit as st

from attnviz.viewer.files import asset
from attnviz.viewer import payload as payload_mod

ADAPTER = """
export default function (component) {
  const { data, key, parentElement, setStateValue, setTriggerValue } = component;
  let root = parentElement.querySelector(":scope > .avz-host");
  if (!root) { root = document.createElement("div"); root.className = "avz-host"; parentElement.appendChild(root); }
  attnvizHeatmap(root, data, {
    request: (layer) => setStateValue("want", layer),
    region: data.regions === "host" ? (box) => setTriggerValue("region", box) : undefined,
    view: (v) => setStateValue("view", v),
  }, key);
}
"""


@st.cache_resource
def _component():
    return st.components.v2.component("attnviz.heatmap", js=asset("heatmap.js") + ADAPTER,
                                      css=asset("heatmap.css"), isolate_styles=False)


def _nothing() -> None:  # state callbacks: the rerun they cause is all the page needs
    return None


def state(key: str) -> dict:
    """The component's last reported state (``view``, ``want``), before it is drawn in this run."""
    try:
        value = st.session_state.get(key)
    except Exception:  # noqa: BLE001 - not yet registered in this session
        value = None
    return dict(value) if value else {}


def heatmap_viewer(caps, key: str, titles: list[str] | None = None, regions: bool = False, note: str = "",
                   layer: int | None = None, head: int | None = None, log: bool | None = None,
                   jump: dict | None = None):
    """Mount the viewer for ``caps`` (one capture, or several of the same text on one colour scale).
    Returns the component's result: ``view`` ({layer, head, log} where the user rests) and
    ``region`` ({layer, head, queries, keys} in the run a box drag causes). ``jump`` ({layer, head,
    n}) moves the view once per ``n`` (a click elsewhere on the page)."""
    caps = list(caps)
    known = state(key)
    around = known.get("want")
    if around not in caps[0].layers:
        around = (known.get("view") or {}).get("layer", caps[0].layers[-1] if layer is None else layer)
    around = around if around in caps[0].layers else caps[0].layers[-1]
    # the first view comes from the page, never from ``view``: a report of where the user rests must
    # not change the data, or every rest would resend the images
    data = payload_mod.payload_around(caps, around, titles=titles, regions="host" if regions else "off", note=note,
                                      layer=layer, head=head, log=log)
    if jump:
        data["jump"] = jump
    return _component()(key=key, data=data, default={"want": None, "view": None},
                        on_want_change=_nothing, on_view_change=_nothing, on_region_change=_nothing)
