"""Shared look of every figure: paper presets, the colour scale, pooling and the matrix renderer.

A matrix of n tokens is drawn as a ``go.Heatmap`` with hover labels while n is small, and above
``HOVER_MAX`` as one PNG image (a data URI, as ``px.imshow(binary_string=True)`` makes), max-pooled down to at most
``MAX_PX`` pixels a side so that sinks stay visible: the browser never gets n² numbers as JSON.
Cells the mask forbids are drawn in ``MASKED`` grey, distinct from zero attention (white).
"""

from __future__ import annotations

import functools

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from plotly.colors import sample_colorscale

COLORSCALE = "Blues"
MASKED = "#c9c9c9"
HOVER_MAX = 96
MAX_PX = 512
LOG_FLOOR = 1e-4
FONT = "Arial, Helvetica, sans-serif"
TEMPLATE = "simple_white"

#: Paper presets: width in px at 96 dpi-equivalent; kaleido scales them for PNG.
PRESETS = {
    "screen": {"width": None, "height": None, "font": 13},
    "paper-single": {"width": 340, "height": 300, "font": 9},   # ~3.5 in column
    "paper-double": {"width": 700, "height": 420, "font": 10},  # ~7 in page width
}


def layout(fig: go.Figure, title: str | None = None, height: int | None = None, masked_bg: bool = False) -> go.Figure:
    """The house style; ``masked_bg`` puts grey exactly behind each heatmap's cells, so NaN (masked)
    cells read as masked and nothing outside the matrix turns grey (paper exports)."""
    house_template(fig)
    fig.update_layout(font=dict(family=FONT, size=13),
                      margin=dict(l=60, r=20, t=50 if title else 20, b=50), title=title)
    if height:
        fig.update_layout(height=height)
    if masked_bg:
        grey_behind_data(fig)
    return fig


@functools.lru_cache(maxsize=1)
def _template() -> go.layout.Template:
    return go.layout.Template(pio.templates[TEMPLATE])


def house_template(fig: go.Figure) -> None:
    """Put the house template on ``fig`` without validating it again, as Plotly does with its default
    template (``BaseFigure._initialize_layout_template``): ``update_layout(template=name)`` deep-copies
    and validates the whole template, ~30-60 ms of every figure, and a slider move waits for it."""
    layout_obj = fig.layout
    layout_obj._validate = False
    try:
        layout_obj.template = _template()
    finally:
        layout_obj._validate = True


def _extent(coords, count: int) -> tuple[float, float]:
    """[first cell's lower edge, last cell's upper edge] of a heatmap axis (centres ``coords``)."""
    if coords is None or len(coords) == 0:
        return -0.5, count - 0.5
    values = np.asarray(coords, dtype=float)
    step = float(values[1] - values[0]) if len(values) > 1 else 1.0
    return float(values[0]) - step / 2, float(values[-1]) + step / 2


def grey_behind_data(fig: go.Figure) -> None:
    """A grey rectangle under each heatmap trace's cells (transparent NaN cells show it), on its axes."""
    for trace in fig.data:
        if trace.type != "heatmap" or trace.z is None:
            continue
        z = np.asarray(trace.z, dtype=object)
        x0, x1 = _extent(trace.x, z.shape[1])
        y0, y1 = _extent(trace.y, z.shape[0])
        fig.add_shape(type="rect", xref=trace.xaxis or "x", yref=trace.yaxis or "y", x0=x0, x1=x1, y0=y0, y1=y1,
                      fillcolor=MASKED, opacity=1, line_width=0, layer="below")


def grey_under(fig: go.Figure, row: int, col: int) -> None:
    """Grey behind one subplot's heatmap, so its masked (NaN) cells read as masked."""
    fig.add_shape(type="rect", xref="x domain", yref="y domain", x0=0, x1=1, y0=0, y1=1, fillcolor=MASKED,
                  opacity=1, line_width=0, layer="below", row=row, col=col)


def max_pool(values: np.ndarray, size: int, factor: int | None = None) -> np.ndarray:
    """Max-pool a matrix to at most ``size`` a side, one factor for both axes so cells stay square
    (NaN-aware: a block is NaN only if all are). Max, not mean: a sink column survives pooling.
    ``factor`` sets the cells' side in entries (default: ceil of the longer side over ``size``)."""
    factor = int(np.ceil(max(values.shape) / size)) if factor is None else int(factor)
    if factor <= 1:
        return values
    pads = [factor * int(np.ceil(n / factor)) - n for n in values.shape]
    padded = np.pad(values, ((0, pads[0]), (0, pads[1])), constant_values=np.nan)
    blocks = padded.reshape(padded.shape[0] // factor, factor, padded.shape[1] // factor, factor)
    with np.errstate(all="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanmax(blocks, axis=(1, 3))


def scaled(values: np.ndarray, log: bool) -> np.ndarray:
    return np.log10(np.clip(values, LOG_FLOOR, None)) if log else values


def colour_range(arrays, log: bool) -> tuple[float, float]:
    """One shared range for several panels."""
    finite = [scaled(np.asarray(a, dtype=np.float64), log) for a in arrays]
    top = max(float(np.nanmax(a)) if np.isfinite(a).any() else 1.0 for a in finite)
    return (np.log10(LOG_FLOOR), max(top, np.log10(LOG_FLOOR) + 1e-6)) if log else (0.0, max(top, 1e-6))


@functools.lru_cache(maxsize=1)
def _palette() -> bytes:
    """The colour scale in 255 RGB entries, then MASKED grey (index 255): a PNG palette, sampled once."""
    lut = [[int(c) for c in s[4:-1].split(",")] for s in sample_colorscale(COLORSCALE, list(np.linspace(0, 1, 255)))]
    grey = [int(MASKED[i:i + 2], 16) for i in (1, 3, 5)]
    return bytes(np.array(lut + [grey], dtype=np.uint8).ravel())


def colour_indices(values: np.ndarray, zmin: float, zmax: float) -> np.ndarray:
    """(h, w) uint8 indices into :func:`_palette`: 0-254 along the colour scale, 255 where NaN (masked)."""
    norm = np.clip((values - zmin) / max(zmax - zmin, 1e-12), 0, 1)
    index = np.rint(np.nan_to_num(norm, nan=0) * 254).astype(np.uint8)
    index[np.isnan(values)] = 255
    return index


def png_data_uri(values: np.ndarray, zmin: float, zmax: float) -> str:
    """A matrix as an indexed (palette) PNG data URI, what ``px.imshow(binary_string=True)`` sends, made
    directly: a third the bytes of RGB and fast compression, since a slider move waits for it to be
    made, sent and decoded."""
    import base64
    import io

    from PIL import Image

    image = Image.fromarray(colour_indices(values, zmin, zmax), mode="P")
    image.putpalette(_palette())
    out = io.BytesIO()
    image.save(out, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def matrix_traces(values: np.ndarray, x_labels, y_labels, zmin: float, zmax: float, log: bool,
                  colorbar_title: str = "attention", show_scale: bool = True, hover_name: str = "p",
                  scale: int = 1, origin: tuple[int, int] = (0, 0)):
    """Traces for one matrix with NaN = masked; returns (traces, is_image).

    ``scale``: tokens per cell (a long capture's pooled maps); ``origin``: the (query, key) of the
    top-left cell (a zoomed region), so axes always read in token positions.
    """
    z = scaled(values, log)
    tick = dict(title=("log10 " if log else "") + colorbar_title, len=0.8)
    q0, k0 = origin
    if values.shape[0] <= HOVER_MAX and values.shape[1] <= HOVER_MAX:
        hover = (f"query %{{y}}<br>key %{{x}}<br>{hover_name} = %{{customdata:.4f}}<extra></extra>")
        return [go.Heatmap(z=z, x=list(k0 + scale * np.arange(values.shape[1])),
                           y=list(q0 + scale * np.arange(values.shape[0])),
                           customdata=values, colorscale=COLORSCALE, zmin=zmin, zmax=zmax,
                           hovertemplate=hover, showscale=show_scale, colorbar=tick, hoverongaps=False,
                           xgap=0, ygap=0)], False
    pooled = max_pool(z, MAX_PX)
    image = go.Image(source=png_data_uri(pooled, zmin, zmax))
    factor = scale * max(values.shape) / max(pooled.shape)
    image.update(x0=k0, dx=factor, y0=q0, dy=factor, hoverinfo="skip")
    # an invisible point carries the colour bar, which images do not have
    bar = go.Scatter(x=[None], y=[None], mode="markers", showlegend=False, hoverinfo="skip",
                     marker=dict(colorscale=COLORSCALE, cmin=zmin, cmax=zmax, color=[zmin],
                                 showscale=show_scale, colorbar=tick))
    return [image, bar], True


def token_text(token: str) -> str:
    """A token as every figure and page shows it: whitespace and control characters as escapes ("\\n", "\\t"), a token
    of spaces alone as ␣, the empty token as ∅, so that no label is blank."""
    text = f"{token!r}"[1:-1]
    return text if text.strip() else text.replace(" ", "␣") or "∅"


def token_axis(tokens: list[str], limit: int = 64, start: int = 0) -> dict:
    """Tick labels with the tokens when they fit, else plain positions; ``start``: the first token's position."""
    if len(tokens) > limit:
        return dict(title=None)
    labels = [token_text(t) for t in tokens]
    return dict(tickmode="array", tickvals=list(range(start, start + len(tokens))), ticktext=labels,
                tickfont=dict(size=9))


def log_ticks(low: float, high: float) -> dict:
    """A log axis's ticks from ``low`` to ``high`` (> 0) written as whole numbers: 1, 2, 5, 10, 20, 50, 100, 200, 500,
    1000 … (Plotly writes the 2 and the 5 after 10 as a bare small "2" and "5"); over more than four decades, the
    powers of ten alone. ``fig.update_xaxes(**log_ticks(...))``."""
    first, last = int(np.floor(np.log10(low))), int(np.ceil(np.log10(high)))
    mantissas = (1,) if last - first > 4 else (1, 2, 5)
    values = [m * 10.0 ** e for e in range(first, last + 1) for m in mantissas]
    values = [v for v in values if low / 1.001 <= v <= high * 1.001] or [low]
    return dict(tickmode="array", tickvals=values, ticktext=[f"{v:g}" if v < 1 else f"{v:.0f}" for v in values])
