"""Paper export: figures to PNG / SVG / PDF with embedded metadata, captures to .npz, metrics to CSV.

Static images go through kaleido, which drives a Chromium-based browser; ``scripts/setup.sh``
installs Debian's ``chromium`` for that. Without a browser, :func:`figure_bytes` raises
:class:`ExportError` saying so, and interactive HTML (:func:`html_bytes`) still works.
"""

from __future__ import annotations

import io
import json
import re
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from attnviz.capture import Capture
from attnviz.errors import AttnvizError
from attnviz.figures.style import FONT, PRESETS
from attnviz.recipe import Recipe
from attnviz.stats import metrics

FORMATS = ("png", "svg", "pdf")


class ExportError(AttnvizError):
    """A static export that cannot be made here."""


def write_atomic(path: str | Path, data: bytes) -> Path:
    """``data`` to ``path`` through a temporary name beside it: never a half-written file."""
    path = Path(path)
    partial = path.with_name(path.name + ".part")
    partial.write_bytes(data)
    partial.replace(path)
    return path


def describe(cap: Capture, layer: int | None = None, head: int | None = None, **extra) -> dict:
    """The metadata every exported file carries: the capture's recipe (its fields, and its one-line
    ``provenance``), the text, and what the view shows."""
    recipe = cap.recipe or Recipe.from_meta(cap.meta, cap.arch)
    meta = {"tool": "attnviz", **{k: v for k, v in recipe.to_dict().items() if v or k in ("model", "arch", "dtype")},
            "text": cap.text, "storage_dtype": cap.meta.get("storage_dtype"), "n_tokens": cap.n_tokens,
            "recipe": recipe.key, "provenance": recipe.describe()}
    if cap.meta.get("attention"):  # encoder-decoder: which of the three stacks (attnviz.seq2seq.STACKS)
        meta["attention"] = cap.meta["attention"]
        meta["encoder_arch"] = cap.meta.get("encoder_arch")
    if layer is not None:
        meta["layer"] = layer
        meta["mask"] = cap.layer_masks[layer]
    if layer is not None or head is not None:
        meta["head"] = "mean" if head is None else head
    meta.update(extra)
    return meta


def filename(meta: dict, ext: str) -> str:
    """e.g. ``attnviz_SmolLM2-135M_mask0-bidir-k-8_L29_h3.pdf``: safe on every file system."""
    parts = ["attnviz", str(meta.get("model", "model")).split(" ")[0], meta.get("attention", ""), meta.get("arch", ""),
             meta.get("intervene", ""), meta.get("residual", "")]
    if "layer" in meta:
        parts.append(f"L{meta['layer']}")
    if "head" in meta:
        parts.append(f"h{meta['head']}")
    if meta.get("figure"):
        parts.append(meta["figure"])
    slug = "_".join(re.sub(r"[^A-Za-z0-9.]+", "-", str(p)).strip("-") for p in parts if p != "")
    return f"{slug[:150]}.{ext}"


FONTS = {"sans": FONT, "serif": "Times New Roman, Times, Liberation Serif, serif"}  # serif: to match LaTeX
COLORBAR_PX = 70  # what a colour bar and its label take beside the plot


def _thin_ticks(axis, length_px: float, font: int, across: bool) -> None:
    """Keep every k-th token label so neighbours never overlap; labels across an axis (x) are
    turned upright-reading at -90° first, so each needs only its line height."""
    vals, text = axis.tickvals, axis.ticktext
    if axis.tickmode != "array" or not vals or not text:
        return
    spacing = length_px / max(len(vals), 1)
    need = 1.25 * font
    stride = max(1, int(np.ceil(need / max(spacing, 1e-6))))
    axis.update(tickvals=list(vals)[::stride], ticktext=list(text)[::stride], tickfont=dict(size=font))
    if across:
        axis.update(tickangle=-90)


def _label_px(axis, font: int) -> float:
    text = axis.ticktext or [str(v) for v in (axis.tickvals or [0, 1000])]
    return max(len(str(t)) for t in text) * 0.6 * font if text else 4 * 0.6 * font


def _square_size(fig: go.Figure, spec: dict, size: int, colorbar: bool, title: bool) -> tuple[int, int]:
    """(width, height) of a figure whose one matrix is square, so the matrix fills the figure: the
    largest square the preset allows, plus the labels left and below and the colour bar right."""
    tick = max(size - 2, 6)
    top = (size + 16) if title and fig.layout.title.text else 8
    bottom = _label_px(fig.layout.xaxis, tick) + 2.5 * size + 12
    left = _label_px(fig.layout.yaxis, tick) + 2.5 * size + 12
    right = (COLORBAR_PX if colorbar else 0) + 16
    side = min(spec["height"] - top - bottom, spec["width"] - left - right)
    return int(left + side + right), int(top + side + bottom)


def styled(fig: go.Figure, preset: str = "paper-single", colorbar: bool = True, title: bool = True,
           font: str = "sans") -> go.Figure:
    """A copy of the figure sized and lettered for a paper column (or the page width).

    Paper presets: one font family and size everywhere (``font="serif"`` to match LaTeX), the title
    optional (papers use captions), margins that fit the labels and no more, and token labels
    thinned so that none overlap (checked by tests/test_paper_figures.py on the rendered files).
    """
    if preset not in PRESETS:
        raise ExportError(f"unknown preset '{preset}'; choose one of {', '.join(PRESETS)}")
    if font not in FONTS:
        raise ExportError(f"unknown font '{font}'; choose one of {', '.join(FONTS)}")
    spec = PRESETS[preset]
    out = go.Figure(fig)
    size = spec["font"] or 13
    out.update_layout(font=dict(family=FONTS[font], size=size))
    out.update_annotations(font=dict(family=FONTS[font], size=size))
    if not title:
        out.update_layout(title=None)
    if spec["width"]:
        out.update_layout(width=spec["width"], height=spec["height"], title=dict(font=dict(size=size + 1)),
                          margin=dict(l=8, r=8, b=8, t=(size + 16) if (title and out.layout.title.text)
                                      or out.layout.annotations else 8))  # subplot titles need the room
        out.update_xaxes(automargin=True, title_standoff=4)
        out.update_yaxes(automargin=True, title_standoff=4)
        n_cols = max(1, len([k for k in out.layout if k.startswith("xaxis")]))
        if n_cols == 1 and out.layout.yaxis.scaleanchor == "x":  # one square matrix: as wide as it needs
            width, height = _square_size(out, spec, size, colorbar, title)
            out.update_layout(width=width, height=height)
        width = (spec["width"] - 60 - (COLORBAR_PX if colorbar else 0)) / n_cols
        height = spec["height"] - 60 - ((size + 16) if title else 0)
        for name in out.layout:
            if name.startswith(("xaxis", "yaxis")):
                across = name.startswith("xaxis")
                _thin_ticks(out.layout[name], min(width, height), max(size - 2, 6), across)
    if not colorbar:
        out.update_traces(showscale=False, selector=lambda t: hasattr(t, "showscale"))
        out.update_traces(marker_showscale=False, selector=dict(type="scatter"))
    return out


def figure_bytes(fig: go.Figure, fmt: str, meta: dict, preset: str = "paper-single", colorbar: bool = True,
                 scale: float = 3.0, title: bool = True, font: str = "sans") -> bytes:
    """Render to PNG (``scale``× pixels), SVG or PDF and embed ``meta``."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format '{fmt}'; choose png, svg or pdf")
    fig = styled(fig, preset, colorbar, title, font)
    try:
        data = pio.to_image(fig, format=fmt, scale=scale if fmt == "png" else 1)
    except Exception as err:  # kaleido reports a missing browser in several ways
        raise ExportError(
            "static export needs a Chromium browser for kaleido; run `bash scripts/setup.sh` (installs "
            f"Debian's chromium) or `apt-get install chromium`, or download HTML instead ({type(err).__name__})"
        ) from err
    return embed_metadata(data, fmt, meta)


def summary(meta: dict) -> str:
    """The file's one line (a PNG's Description, a PDF's title): ``meta["description"]`` where the page wrote one
    (what a lab run is), else its model · architecture, leaving out what it does not have (never "None")."""
    if meta.get("description"):
        return str(meta["description"])
    return " · ".join(str(meta[k]) for k in ("model", "arch") if meta.get(k) not in (None, "")) or "attnviz figure"


def embed_metadata(data: bytes, fmt: str, meta: dict) -> bytes:
    text = json.dumps(meta, ensure_ascii=False)
    if fmt == "png":
        from PIL import Image, PngImagePlugin

        info = PngImagePlugin.PngInfo()
        info.add_itxt("attnviz", text)
        info.add_itxt("Description", summary(meta))
        out = io.BytesIO()
        Image.open(io.BytesIO(data)).save(out, format="PNG", pnginfo=info)
        return out.getvalue()
    if fmt == "svg":
        svg = data.decode("utf-8")
        escaped = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        svg = re.sub(r"(<svg[^>]*>)", lambda m: m.group(1) + f'<metadata id="attnviz">{escaped}</metadata>', svg,
                     count=1)
        return svg.encode("utf-8")
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(data)))
    writer.add_metadata({"/Title": f"attnviz: {summary(meta)}", "/Subject": str(meta.get("text", ""))[:200],
                         "/Creator": "attnviz", "/Keywords": text})
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def read_metadata(data: bytes, fmt: str) -> dict:
    """The metadata :func:`embed_metadata` wrote (for checks and for users)."""
    if fmt == "png":
        from PIL import Image

        return json.loads(Image.open(io.BytesIO(data)).text["attnviz"])
    if fmt == "svg":
        import html

        found = re.search(r'<metadata id="attnviz">(.*?)</metadata>', data.decode("utf-8"), re.S)
        return json.loads(html.unescape(found.group(1)))
    from pypdf import PdfReader

    return json.loads(PdfReader(io.BytesIO(data)).metadata["/Keywords"])


def html_bytes(fig: go.Figure) -> bytes:
    return pio.to_html(fig, include_plotlyjs="cdn", full_html=True).encode("utf-8")


def capture_bytes(cap: Capture) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        return cap.save(Path(tmp) / "capture.npz").read_bytes()


def metrics_frame(cap: Capture, eps: float = metrics.SINK_EPS) -> pd.DataFrame:
    """One row per (layer, head): mask, KV group, alpha_0/1, sink flag, sink key, entropy, discarded mass."""
    rows = []
    for layer in cap.layers:
        alphas = cap.stat(layer, "alpha")
        keys = cap.stat(layer, "column_mean").argmax(-1)
        ent = cap.stat(layer, "entropy").mean(-1)
        disc = cap.stat(layer, "discarded").mean(-1)
        for head in range(cap.n_heads):
            a0 = alphas[head, 0]
            a1 = alphas[head, 1] if cap.n_tokens > 1 else np.nan
            rows.append({"layer": layer, "mask": cap.layer_masks[layer], "head": head,
                         "kv_group": cap.kv_groups[head], "alpha_0": a0, "alpha_1": a1,
                         "sink_0": bool(np.nan_to_num(a0, nan=-1) > eps), "sink_key": int(keys[head]),
                         "entropy_norm": float(ent[head]), "discarded_mass": float(disc[head])})
    return pd.DataFrame(rows)


def csv_bytes(frame: pd.DataFrame) -> bytes:
    return frame.to_csv(index=False).encode("utf-8")
