"""Download widgets: figures as PNG / SVG / PDF (paper presets, embedded metadata), data as .npz / CSV."""

from __future__ import annotations

import shlex
import weakref

import streamlit as st

from attnviz.figures import export
from attnviz.figures.style import PRESETS


def figure_downloads(fig, meta: dict, key: str) -> None:
    """Paper export of ``fig`` (a figure, or a function making it: made only when a file is asked for)."""
    figure = fig if callable(fig) else (lambda: fig)
    with st.expander("Export this figure"):
        cols = st.columns([2, 2, 1, 1, 1, 2])
        fmt = cols[0].selectbox("Format", export.FORMATS, index=2, key=f"{key}_fmt")
        preset = cols[1].selectbox("Size", list(PRESETS), index=1, key=f"{key}_preset",
                                   help="paper-single ≈ 3.5 in column, paper-double ≈ 7 in page width")
        colorbar = cols[2].checkbox("Colour bar", True, key=f"{key}_cbar")
        title = cols[3].checkbox("Title", False, key=f"{key}_title", help="Papers usually put it in the caption")
        serif = cols[4].checkbox("Serif", False, key=f"{key}_serif", help="Times-like letters, to match LaTeX text")
        if cols[5].button("Prepare file", key=f"{key}_make"):
            try:
                with st.spinner(f"Rendering {fmt.upper()} …"):
                    data = export.figure_bytes(figure(), fmt, meta, preset=preset, colorbar=colorbar, title=title,
                                               font="serif" if serif else "sans")
                st.session_state[f"{key}_file"] = (data, export.filename(meta, fmt), fmt)
            except export.ExportError as err:
                st.error(str(err))
        ready = st.session_state.get(f"{key}_file")
        if ready:
            data, name, fmt = ready
            st.download_button(f"Download {name}", data, file_name=name, key=f"{key}_dl",
                               mime={"png": "image/png", "svg": "image/svg+xml", "pdf": "application/pdf"}[fmt])
        st.download_button("Download interactive HTML", lambda: export.html_bytes(figure()),
                           file_name=export.filename(meta, "html"), key=f"{key}_html", mime="text/html")


def _held_weakly(cap, make):
    """The file's bytes, made at click time from ``cap`` (or a list of captures) if still alive.
    Streamlit keeps a deferred download's callable for the session; a closure over the capture itself
    would keep every capture a session has seen alive past the cache's eviction (and the memory budget)."""
    many = isinstance(cap, (list, tuple))
    refs = [weakref.ref(c) for c in (cap if many else [cap])]

    def data() -> bytes:
        held = [r() for r in refs]
        if any(h is None for h in held):
            return b"This capture has left the server's memory since the page was drawn: reload the page.\n"
        return make(held if many else held[0])

    return data


def report_download(caps, model: str, key: str) -> None:
    """"Download report": the self-contained HTML file of ``caps`` (``attnviz report``'s), made on click;
    ``model``: the model as the sidebar names it (for the command in its provenance)."""
    from attnviz.reports.html import report_html

    first = caps[0]
    command = (f"attnviz report --model {shlex.quote(model)} "
               f"--text-file TEXT.txt --arch {shlex.quote('; '.join(c.arch for c in caps))}"
               + (f" --intervene {shlex.quote(first.meta['intervene'])}" if first.meta.get("intervene") else "")
               + " --out report.html")
    st.download_button("Download report", _held_weakly(list(caps), lambda held: report_html(held, command=command).encode()),
                       file_name=export.filename({**export.describe(first, arch=" vs ".join(c.arch for c in caps)),
                                                  "figure": "report"}, "html"),
                       mime="text/html", key=key, icon="📄",
                       help="One HTML file with these architectures' maps (the viewer), the sink-shifting panel, sink "
                            "profiles and alpha grids, and the provenance: no server, no network, mail it as it is")


def data_downloads(cap, key: str) -> None:
    with st.expander("Export data"):
        meta = export.describe(cap)
        c1, c2 = st.columns(2)
        c1.download_button("Capture (.npz)", _held_weakly(cap, export.capture_bytes), file_name=export.filename(meta, "npz"),
                           key=f"{key}_npz", mime="application/octet-stream")
        if cap.query_tokens is None:  # sink metrics are defined for self-attention maps
            c2.download_button("Metrics (.csv)", _held_weakly(cap, lambda c: export.csv_bytes(export.metrics_frame(c))),
                               file_name=export.filename({**meta, "figure": "metrics"}, "csv"), key=f"{key}_csv",
                               mime="text/csv")
