"""A notebook with attnviz widgets as one HTML file that works offline.

``jupyter nbconvert --to html`` keeps the widget state but draws widgets with the standard widget
manager, which it loads from a CDN: offline, the maps are blank. :func:`notebook_html` runs the
same exporter with ``embed.js`` in its place (inline, as a data URI): it renders every anywidget
from the state saved in the notebook, the viewer included. The notebook must be saved with its
widget state (nbclient ``store_widget_state=True``; JupyterLab: Save Widget State Automatically).
"""

from __future__ import annotations

import base64
from pathlib import Path

from attnviz.viewer.files import asset

NOTHING = "data:text/javascript,"  # in place of require.js, MathJax, jQuery and Mermaid: nothing to fetch


def notebook_html(notebook) -> str:
    """``notebook`` (a path or an ``nbformat`` node) as one self-contained HTML page."""
    import nbformat
    from nbconvert import HTMLExporter

    node = nbformat.read(str(notebook), as_version=4) if isinstance(notebook, (str, Path)) else notebook
    renderer = "data:text/javascript;base64," + base64.b64encode(asset("embed.js").encode()).decode()
    exporter = HTMLExporter(template_name="lab", widget_renderer_url=renderer, require_js_url=NOTHING,
                            mathjax_url=NOTHING, jquery_url=NOTHING, mermaid_js_url=NOTHING)
    body, _ = exporter.from_notebook_node(node)
    return body
