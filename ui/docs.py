"""Links from every page to the definitions it shows (docs/methods.md, rendered by the Definitions page)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import streamlit as st

METHODS = Path(__file__).resolve().parent.parent / "docs" / "methods.md"


def anchor(heading: str) -> str:
    """The anchor Streamlit and GitHub give a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")


@functools.cache
def headings() -> dict[str, str]:
    """anchor -> heading text of every section of docs/methods.md."""
    return {anchor(line.lstrip("#")): line.lstrip("#").strip()
            for line in METHODS.read_text(encoding="utf-8").splitlines() if line.startswith("##")}


def definitions(*anchors: str) -> None:
    """One caption line: the definitions this page shows, each a link into the Definitions page."""
    known = headings()
    missing = [a for a in anchors if a not in known]
    if missing:
        raise KeyError(f"docs/methods.md has no section {missing}")
    st.caption("Definitions: " + " · ".join(f"[{known[a]}](definitions#{a})" for a in anchors))
