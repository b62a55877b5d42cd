"""The viewer's files shipped with the package (``heatmap.js``, ``heatmap.css``, ``embed.js``)."""

from __future__ import annotations

from importlib.resources import files


def asset(name: str) -> str:
    """A file shipped with the package (``heatmap.js``, ``heatmap.css``, ``embed.js``)."""
    return (files("attnviz.viewer") / name).read_text(encoding="utf-8")
