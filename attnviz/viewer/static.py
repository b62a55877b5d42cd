"""The viewer in a plain HTML file: the script, its style and the payload inline; no server, no
network, no CDN."""

from __future__ import annotations

import html
import json
from pathlib import Path

from attnviz.viewer.files import asset


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


def save_html(attention, tokens=None, path="attention.html", *, query_tokens=None, batch: int = 0,
              layer: int | None = None, head: int | None = None, log: bool | None = None, size: int = 256,
              title: str = "attnviz") -> Path:
    """One self-contained HTML file of the viewer (no server, no network) of a capture or of any attention
    tensors (:func:`attnviz.viewer.tensors.from_attention`): every layer's maps, max-pooled to ``size``
    pixels a side (sinks stay visible; exact 16-bit hover values up to 256 tokens). Returns the path."""
    from attnviz.figures.export import write_atomic
    from attnviz.viewer.payload import payload
    from attnviz.viewer.tensors import from_attention

    cap = from_attention(attention, tokens, query_tokens=query_tokens, batch=batch)
    data = payload([cap], layer=layer, head=head, log=log, size=size, note=cap.meta.get("note", ""),
                   regions_note="A region at full resolution: attnviz.show(attention, tokens) in a notebook "
                                "(a box drag there cuts it from the tensors the kernel holds).")
    path = Path(path)
    write_atomic(path, standalone_html(data, title).encode())
    return path
