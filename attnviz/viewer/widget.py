"""The viewer in notebooks: a Jupyter widget built on anywidget (JupyterLab, Jupyter Notebook 7,
VS Code, Colab: any front end that runs ipywidgets).

``attnviz.show(cap)`` returns the widget; ``attnviz.show_compare(a, b)`` two captures of the same
text side by side on one colour scale. The widget's state (the script and the images) is plain
widget state, so a notebook saved with its widget state (JupyterLab: Settings → Save Widget State
Automatically; nbclient: ``store_widget_state=True``) shows the maps again without a kernel, and
:func:`attnviz.viewer.notebook.notebook_html` turns such a notebook into one HTML file that works
offline. Layers outside the first payload (long texts; :data:`payload.BUDGET_BYTES`) come from the
kernel when the slider reaches them; a box drag on a capture with full maps sets :attr:`Heatmap.region`
to that region at full resolution (:class:`attnviz.regions.Region`).
"""

from __future__ import annotations

import anywidget
import traitlets

from attnviz import regions
from attnviz.capture import Capture
from attnviz.errors import AttnvizError
from attnviz.viewer.files import asset
from attnviz.viewer import payload as payload_mod
from attnviz.viewer.tensors import from_attention

ADAPTER = """
export default {
  render({ model, el }) {
    const root = document.createElement("div");
    root.className = "avz-host";
    el.appendChild(root);
    const host = {
      request: (layer) => { model.set("want", layer); model.save_changes(); },
      view: (v) => { model.set("view", v); model.save_changes(); },
    };
    if (model.get("data").regions === "host") {
      host.region = (box) => { model.set("box", box); model.save_changes(); };
    }
    const draw = () => attnvizHeatmap(root, model.get("data"), host);
    draw();
    model.on("change:data", draw);
    return () => model.off("change:data", draw);
  },
};
"""


class Heatmap(anywidget.AnyWidget):
    """The heatmap viewer of one or more captures. ``view``: where the user rests ({layer, head,
    log}); ``region``: the last box drag's region at full resolution (a capture with full maps)."""

    _esm = asset("heatmap.js") + ADAPTER
    _css = asset("heatmap.css")
    data = traitlets.Dict().tag(sync=True)
    want = traitlets.Int(None, allow_none=True).tag(sync=True)
    view = traitlets.Dict(allow_none=True, default_value=None).tag(sync=True)
    box = traitlets.Dict(allow_none=True, default_value=None).tag(sync=True)

    def __init__(self, caps: list[Capture], titles: list[str] | None = None, layer: int | None = None,
                 head: int | None = None, log: bool | None = None, size: int = payload_mod.MAX_PX):
        self._caps = list(caps)
        self.region: regions.Region | None = None
        start = self._caps[0].layers[-1] if layer is None else layer
        full = all(l in c.probs for c in self._caps for l in c.layers)
        self._options = dict(titles=titles, layer=layer, head=head, log=log, size=size,
                             note=" ".join(c.meta.get("note", "") for c in self._caps).strip(),
                             regions="host" if full else "off",
                             regions_note="" if full else "A region of a long text at full resolution: "
                                                          "attnviz.regions.region(model, text, arch, layer, queries, keys).")
        super().__init__(data=self._payload(start))

    def _payload(self, around: int) -> dict:
        return payload_mod.payload_around(self._caps, around, **self._options)

    @traitlets.observe("want")
    def _send_layer(self, change) -> None:
        if change["new"] in self._caps[0].layers:
            self.data = self._payload(change["new"])  # the viewer keeps the layers it already has

    @traitlets.observe("box")
    def _cut_region(self, change) -> None:
        box = change["new"]
        if not box:
            return
        side = regions.MAX_SIDE
        (q0, q1), (k0, k1) = box["queries"], box["keys"]
        try:
            self.region = regions.from_capture(self._caps[0], box["layer"], (q0, min(q1, q0 + side)),
                                            (k0, min(k1, k0 + side)))
        except AttnvizError:
            self.region = None


def show(attention, tokens=None, *, layer: int | None = None, head: int | None = None, log: bool | None = None,
         query_tokens=None, batch: int = 0) -> Heatmap:
    """The viewer in a notebook: layer and head sliders, log/linear, row normalisation, hover values, a box
    drag for a full-resolution region, PNG download, all in the browser.

    ``attention`` is a capture, or any attention tensors (BertViz's call: ``show(attention, tokens)``):
    a transformers ``output_attentions`` tuple (``batch`` picks the text), a TransformerLens
    ``ActivationCache``, an array or tensor of (layers, heads, q, k), (heads, q, k) or (q, k); for
    cross-attention ``query_tokens`` label the rows (:func:`attnviz.viewer.tensors.from_attention`)."""
    cap = from_attention(attention, tokens, query_tokens=query_tokens, batch=batch)
    return Heatmap([cap], None, layer, head, log)


def show_compare(a: Capture, b: Capture, titles: tuple[str, str] | None = None, layer: int | None = None,
                 head: int | None = None, log: bool | None = None) -> Heatmap:
    """Two captures of the same text (two architectures, with and without an intervention) side by
    side on one colour scale, one set of sliders."""
    if titles is None:
        titles = (a.arch, b.arch) if a.arch != b.arch else (a.arch, f"{b.arch} · {b.meta.get('intervene') or 'B'}")
    return Heatmap([a, b], list(titles), layer, head, log)
