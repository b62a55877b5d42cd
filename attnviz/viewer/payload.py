"""What the client-side heatmap viewer receives: a capture's per-head maps as small images.

One payload drives the viewer in every home (the app, a notebook, a static HTML file). Each
(layer, head) map is one grey-scale image whose pixel is a code of log10 of the attention weight,
max-pooled to at most ``size`` pixels a side (sinks stay visible), plus one image per layer of the
cells the mask allows. The browser turns codes into colours (linear or log), so the scale toggle,
row normalisation and hover need no new images and no server.

Codes: ``code = round((log10(max(p, 10**lo)) - lo) / (hi - lo) * (2**bits - 1))``.
- ``bits = 16`` (full-resolution maps of short texts, where hover shows exact values): the code's
  high byte in the red channel, its low byte in green, so ``lo = -8`` keeps four significant
  digits down to 1e-8 after the browser decodes the PNG;
- ``bits = 8`` (long texts' pooled maps): one grey channel, ``lo = -4`` (the log scale's floor), a
  level every ~3.7 % of a value; hover says "≈".
Images are lossless PNG, or lossy WebP (``image_format="webp"``) where a file must stay small (the
report): the lossy codes then wander by ~2 of 255 levels (~7 % of a value), the mask stays exact
because it is its own lossless image.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import json

import numpy as np

from attnviz import settings
from attnviz.capture import Capture
from attnviz.figures.export import describe
from attnviz.figures.heatmaps import head_label
from attnviz.figures.style import COLORSCALE, LOG_FLOOR, MASKED, MAX_PX, max_pool
from attnviz.stats import metrics

#: Full-resolution maps up to this many tokens are sent with 16-bit codes (exact hover values).
EXACT_TOKENS = 256
#: A payload sent to a page holds at most this many image bytes (``ATTNVIZ_VIEWER_MB`` overrides);
#: other layers come on request, one round trip each.
BUDGET_BYTES = 40 << 20


FORMATS = ("png", "webp")


def budget() -> int:
    """Image bytes one payload may hold: the settings' ``viewer_mb`` (``ATTNVIZ_VIEWER_MB``) or :data:`BUDGET_BYTES`."""
    value = settings.active().viewer_mb
    return int(value * (1 << 20)) if value else BUDGET_BYTES


@functools.lru_cache(maxsize=1)
def palette() -> list[str]:
    """The colour scale as 256 "#rrggbb" entries, the figures' own (``style.COLORSCALE``)."""
    from plotly.colors import sample_colorscale

    return ["#%02x%02x%02x" % tuple(int(c) for c in s[4:-1].split(","))
            for s in sample_colorscale(COLORSCALE, list(np.linspace(0, 1, 256)))]


def _uri(image, image_format: str, quality: int) -> str:
    out = io.BytesIO()
    if image_format == "webp":
        image.save(out, format="WEBP", quality=quality, method=6)
    else:
        image.save(out, format="PNG", compress_level=6)
    subtype = "webp" if image_format == "webp" else "png"  # the MIME subtype
    return f"data:image/{subtype};base64," + base64.b64encode(out.getvalue()).decode()


def encode(values: np.ndarray, lo: float, hi: float = 0.0, bits: int = 8, image_format: str = "png",
           quality: int = 90) -> str:
    """One (h, w) map of values (NaN: masked, sent as code 0) as an image data URI of codes."""
    from PIL import Image

    top = (1 << bits) - 1
    with np.errstate(invalid="ignore", divide="ignore"):
        level = (np.log10(np.maximum(np.nan_to_num(values, nan=0.0), 10.0 ** lo)) - lo) / (hi - lo)
    code = np.rint(np.clip(level, 0, 1) * top).astype(np.uint32)
    if bits == 16:
        rgb = np.zeros(values.shape + (3,), dtype=np.uint8)
        rgb[..., 0], rgb[..., 1] = code >> 8, code & 0xFF
        return _uri(Image.fromarray(rgb, "RGB"), "png", quality)  # never lossy: the low byte is the precision
    return _uri(Image.fromarray(code.astype(np.uint8), "L"), image_format, quality)


def decode(uri: str, lo: float, hi: float = 0.0, bits: int = 8) -> np.ndarray:
    """The values an image of :func:`encode` carries (what the browser computes), for tests and tools."""
    from PIL import Image

    data = base64.b64decode(uri.split(",", 1)[1])
    pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float64)
    code = pixels[..., 0] * 256 + pixels[..., 1] if bits == 16 else pixels[..., 0]
    return 10.0 ** (lo + code / ((1 << bits) - 1) * (hi - lo))


def mask_uri(allowed: np.ndarray) -> str:
    """Which cells the mask allows (white) as a lossless 1-bit PNG."""
    from PIL import Image

    return _uri(Image.fromarray(np.asarray(allowed, dtype=bool)), "png", 90)


def encoding(caps: list[Capture], size: int = MAX_PX) -> dict:
    """How the maps of captures shown together are coded: 16 bits where every one has full maps of at
    most :data:`EXACT_TOKENS` tokens drawn unpooled, else 8 (one code for all: one decoder, one scale)."""
    exact = all(cap.n_tokens <= min(EXACT_TOKENS, size) and len(cap.row_tokens) <= EXACT_TOKENS
                and all(cap.pool_factor(l) == 1 for l in cap.layers) for cap in caps)
    return {"bits": 16, "lo": -8.0, "hi": 0.0} if exact else {"bits": 8, "lo": float(np.log10(LOG_FLOOR)), "hi": 0.0}


def layer_images(cap: Capture, layer: int, code: dict, size: int = MAX_PX, image_format: str = "png",
                 quality: int = 90) -> dict:
    """One layer's images in ``code`` (:func:`encoding`): ``mask``, ``heads`` ([mean, head 0, head 1,
    ...]), ``factor`` (tokens per pixel) and ``bytes``. Kept with the capture: a layer is encoded once
    per code, size and format."""
    def make():
        values, allowed = cap.layer_view(layer)  # full maps, or a long capture's pooled ones
        stored = cap.pool_factor(layer)
        extra = int(np.ceil(max(values.shape[1:]) / size))  # pooled further to fit ``size``
        maps = [values.mean(0)] + list(values)
        heads = [None] + list(range(len(values)))  # each head's own cells where the heads have masks of their own
        pooled = [max_pool(np.where(metrics.head_cells(allowed, h), m, np.nan), size, extra) for h, m in zip(heads, maps)]
        heads = [encode(m, code["lo"], code["hi"], code["bits"], image_format, quality) for m in pooled]
        mask = mask_uri(~np.isnan(pooled[0]))
        return {"mask": mask, "heads": heads, "factor": stored * max(extra, 1),
                "shape": list(pooled[0].shape), "bytes": len(mask) + sum(map(len, heads))}
    return cap.memo(("viewer_layer", layer, code["bits"], size, image_format, quality), make)


def window(layers: list[int], around: int, layer_bytes: int, limit: int | None = None) -> list[int]:
    """The layers to send: ``around`` and its nearest neighbours, as many as ``limit`` bytes (default
    :func:`budget`) hold at ``layer_bytes`` a layer (every layer when they fit, always ``around``)."""
    count = max(1, (budget() if limit is None else limit) // max(layer_bytes, 1))
    return sorted(sorted(layers, key=lambda l: (abs(l - around), l))[:count])


def payload(caps: list[Capture], titles: list[str] | None = None, layers: list[int] | None = None,
            size: int = MAX_PX, image_format: str = "png", quality: int = 90, layer: int | None = None,
            head: int | None = None, log: bool | None = None, regions: str = "off", note: str = "",
            regions_note: str = "") -> dict:
    """The viewer's JSON data for one or more captures of the same tokens shown side by side on
    one colour scale (sliders shared). ``layers``: whose images to include (default all, the others
    are requested when shown); ``layer``/``head``/``log``: the first view (default last layer, head
    mean, log above 256 tokens); ``regions``: "host" when a box drag asks the host for a
    full-resolution region, else "off" (a static file; ``regions_note`` says where regions are made)."""
    if image_format not in FORMATS:
        raise ValueError(f"image format {image_format!r}: expected one of {', '.join(FORMATS)}")
    first = caps[0]
    for cap in caps[1:]:
        if cap.token_ids != first.token_ids or cap.layers != first.layers:
            raise ValueError("captures shown side by side must have the same tokens and recorded layers")
    titles = titles or [cap.arch for cap in caps]
    wanted = first.layers if layers is None else [l for l in first.layers if l in set(layers)]
    code = encoding(caps, size)
    panels = []
    for cap, title in zip(caps, titles):
        images = {str(l): layer_images(cap, l, code, size, image_format, quality) for l in wanted}
        panels.append({"title": title, "masks": {str(l): cap.layer_masks[l] for l in cap.layers},
                       "layers": {k: {key: v[key] for key in ("mask", "heads", "factor", "shape")}
                                  for k, v in images.items()}})
    # what makes each capture (model, text, mask, intervention, BOS, residual variant, attention kind):
    # the viewer merges a new payload into the one it holds only when this is the same
    # (given tensors carry a digest of their values: two tensors of the same tokens are not one capture)
    identity = hashlib.sha1(json.dumps([describe(c) for c in caps] + [c.meta.get("digest") for c in caps]
                                       + [size, image_format, quality], sort_keys=True,
                                       default=str).encode()).hexdigest()[:16]
    meta = describe(first)  # what every export carries (figures.export): the viewer's PNG adds its view
    meta.update(arch=" vs ".join(titles) if len(caps) > 1 else meta["arch"],
                panels=[{"title": t, "recipe": describe(c)["recipe"], "provenance": describe(c)["provenance"]}
                        for c, t in zip(caps, titles)])
    return {
        "id": identity, "meta": json.loads(json.dumps(meta, default=str)), "n_tokens": first.n_tokens, "tokens": first.tokens,
        "row_tokens": first.query_tokens, "layers": first.layers, "n_heads": first.n_heads,
        "kv_groups": first.kv_groups, "head_labels": [head_label(first, None)] + [head_label(first, h) for h in
                                                                                  range(first.n_heads)],
        "encoding": code, "floor": LOG_FLOOR, "palette": palette(),
        "masked": MASKED, "panels": panels, "regions": regions, "note": note, "regions_note": regions_note,
        "view": {"layer": first.layers[-1] if layer is None else layer, "head": head,
                 "log": first.n_tokens > 256 if log is None else bool(log)},
    }


def payload_around(caps: list[Capture], around: int, size: int = MAX_PX, **options) -> dict:
    """:func:`payload` of the layers nearest ``around`` that :func:`budget` holds (every layer when
    they fit): what a host that can send more layers on request (the app, a notebook) sends."""
    code = encoding(caps, size)
    per_layer = sum(layer_images(c, around, code, size)["bytes"] for c in caps)
    return payload(caps, layers=window(caps[0].layers, around, per_layer), size=size, **options)
