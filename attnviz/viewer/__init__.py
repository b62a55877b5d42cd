"""The client-side heatmap viewer: one component in three homes.

A capture's maps go to the browser once as small images (:mod:`.payload`); ``heatmap.js`` swaps
them when a slider moves, with no server round trip. The same script runs
- in the app, as a Streamlit custom component (``ui/viewer.py``: the library imports no Streamlit);
- in notebooks, as an anywidget (:func:`show`, :func:`show_compare`);
- in a self-contained HTML file (:func:`standalone_html`, the report of :mod:`attnviz.reports`).
"""

from __future__ import annotations

from attnviz.viewer.files import asset  # noqa: F401 - the files the viewer ships


def __getattr__(name):  # the notebook widget imports anywidget only when asked for
    if name in ("show", "show_compare", "Heatmap"):
        from attnviz.viewer import widget

        return getattr(widget, name)
    if name in ("standalone_html",):
        from attnviz.viewer import static

        return getattr(static, name)
    raise AttributeError(name)
