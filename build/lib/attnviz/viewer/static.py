"""The viewer in a plain HTML file: the script, its style and the payload inline; no server, no
network, no CDN."""

from __future__ import annotations

import html
import json

from attnviz.viewer import asset


def script_json(data) -> str:
    """JSON safe inside a ``<script>`` element (no ``</script>``, no ``<!--``)."""
    return json.dumps(data, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e")


def viewer_block(data: dict, element_id: str) -> str:
    """One viewer: a ``<div>`` and the script that mounts it (the page must hold :func:`head` once)."""
    return (f'<div id="{element_id}" class="avz-host"></div>\n'
            f'<script type="application/json" id="{element_id}-data">{script_json(data)}</script>\n'
            f'<script>attnvizHeatmap(document.getElementById("{element_id}"), '
            f'JSON.parse(document.getElementById("{element_id}-data").textContent), {{}});</script>\n')


def head() -> str:
    """The viewer's style and script, inline."""
    return f"<style>{asset('heatmap.css')}</style>\n<script>{asset('heatmap.js')}</script>\n"


def standalone_html(data: dict, title: str = "attnviz") -> str:
    """A whole page with one viewer of ``data`` (:func:`attnviz.viewer.payload.payload`)."""
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>\n"
            f"{head()}</head><body>\n{viewer_block(data, 'attnviz-viewer')}</body></html>\n")
