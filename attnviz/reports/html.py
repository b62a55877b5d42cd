"""A self-contained HTML report of one text under several architectures.

One file, no server, no network, no CDN: it can be mailed to a co-author. It holds
- the heatmap viewer (:mod:`attnviz.viewer`) with every architecture side by side on one colour
  scale (layer, head, log/linear in the browser);
- the sink-shifting panel (the head-mean maps of the top layer and the mass per key; the sink key
  of every head);
- per architecture, the sink profile (attention to key 0 by query position) and the alpha grid;
- the provenance: model, text, architectures with their per-layer masks, intervention, versions.
Static figures are SVG made by kaleido (plotly.js would add 3.5 MB); the page's
Content-Security-Policy forbids every request, so nothing can leave it.

Size: the maps are the bulk. A report embeds every layer's per-head maps max-pooled to ``size``
pixels (default 256: 8 tokens a pixel at 2,048 tokens) as lossy WebP (quality 80: ~3 of 255 code
levels of error where attention is allowed, ~10 % of a value; the mask exact, hover says "≈"). Three
architectures at 2,048 tokens on the default model take ~13 MB (quality 90: ~17 MB; lossless PNG:
~30 MB), measured with ``attnviz report`` (docs/viewer.md).
"""

from __future__ import annotations

import datetime
import html
import json

from attnviz import __version__
from attnviz.capture import Capture, capture
from attnviz.recipe import Recipe
from attnviz.plan import Keep
from attnviz.core.spec.arch import resolve as resolve_arch
from attnviz.core.loading.models import LoadedModel
from attnviz.errors import InputError
from attnviz.figures import alpha_grid, key_profile, shift_panels, sink_key_grids
from attnviz.figures.export import ExportError, figure_bytes
from attnviz.viewer import payload as payload_mod
from attnviz.viewer.static import head as viewer_head
from attnviz.viewer.static import viewer_block

CSP = ("default-src 'none'; img-src data: blob:; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
       "font-src data:; connect-src 'none'; form-action 'none'")
STYLE = """
body { font-family: Arial, Helvetica, sans-serif; margin: 24px auto; max-width: 1400px; color: #222; padding: 0 16px; }
h1 { font-size: 24px; margin-bottom: 4px; } h2 { font-size: 19px; margin-top: 28px; border-bottom: 1px solid #ddd; }
h3 { font-size: 15px; } .lead { color: #555; } .figs { display: flex; flex-wrap: wrap; gap: 12px; }
.fig svg { max-width: 100%; height: auto; } table.prov td { padding: 2px 10px 2px 0; vertical-align: top; }
code, pre { font-size: 12px; } pre { white-space: pre-wrap; background: #f7f7f7; padding: 8px; max-height: 240px; overflow: auto; }
"""


def split_archs(spec: str) -> list[str]:
    """"fwd; nosink-fwd; mask0-bidir(k=8)" -> the architectures, in order."""
    archs = [a.strip() for a in spec.split(";") if a.strip()]
    if not archs:
        raise InputError("give at least one architecture, e.g. --arch \"fwd; nosink-fwd\"")
    if len(archs) > 6:
        raise InputError(f"a report compares at most 6 architectures side by side (got {len(archs)})")
    return archs


def captures(loaded: LoadedModel, text: str, archs: list[str], intervene: str | None = None,
             max_tokens: int | None = None, on_progress=None) -> list[Capture]:
    """One capture per architecture, statistics and maps max-pooled to 512 (what the report shows).
    ``on_progress(done, total)`` counts layers over all architectures."""
    for arch in archs:  # every architecture string checked before the first forward
        resolve_arch(arch, loaded.n_layers)
    caps, total = [], len(archs) * loaded.n_layers
    for i, arch in enumerate(archs):
        step = (lambda layer, i=i: on_progress(i * loaded.n_layers + layer + 1, total)) if on_progress else None
        caps.append(capture(loaded, text, Recipe.of(loaded, arch, intervene=intervene),
                            Keep(statistics=True, pool=payload_mod.MAX_PX), max_tokens=max_tokens, on_layer=step))
    return caps


def _svg(fig, meta: dict, preset: str = "paper-double") -> str:
    """A figure as inline SVG (its XML prolog dropped); a note where no browser can render it."""
    try:
        data = figure_bytes(fig, "svg", meta, preset=preset, title=True).decode("utf-8")
    except ExportError as err:
        return f"<p class='lead'>(figure not rendered: {html.escape(str(err))})</p>"
    return data[data.index("<svg"):]


def provenance(caps: list[Capture], command: str | None) -> list[tuple[str, str]]:
    first = caps[0]
    rows = [("model", str(first.meta.get("model"))), ("dtype", str(first.meta.get("dtype"))),
            ("tokens", str(first.n_tokens)),
            ("architectures", "; ".join(c.arch for c in caps))]
    if first.meta.get("intervene"):
        rows.append(("intervention", str(first.meta["intervene"])))
    for cap in caps:
        rows.append((f"masks of {cap.arch}", ", ".join(f"{l}:{m}" for l, m in enumerate(cap.layer_masks))))
    versions = first.meta.get("versions") or {}
    rows.append(("versions", ", ".join(f"{k} {v}" for k, v in {"attnviz": __version__, **versions}.items())))
    rows.append(("made", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")))
    if command:
        rows.append(("command", command))
    return rows


def report_html(caps: list[Capture], size: int = 256, image_format: str = "webp", quality: int = 80,
                command: str | None = None, on_figure=None) -> str:
    """The report of captures of one text (:func:`captures`) as one HTML string."""
    if not caps:
        raise InputError("a report needs at least one capture")
    first, titles = caps[0], [c.arch for c in caps]
    meta = {"tool": "attnviz", "model": first.meta.get("model"), "arch": " vs ".join(titles),
            "n_tokens": first.n_tokens}
    data = payload_mod.payload(caps, titles, size=size, image_format=image_format, quality=quality,
                               note=f"{first.meta.get('model')} · {first.n_tokens} tokens")
    figures = [("shift", lambda: shift_panels(caps, titles, first.layers[-1], log=first.n_tokens > 256)),
               ("keys", lambda: sink_key_grids(caps, titles))]
    for cap in caps:
        figures += [(f"profile:{cap.arch}", lambda cap=cap: key_profile(cap)),
                    (f"alpha:{cap.arch}", lambda cap=cap: alpha_grid(cap))]
    svgs = {}
    for i, (name, make) in enumerate(figures):
        svgs[name] = _svg(make(), meta)
        if on_figure:
            on_figure(i + 1, len(figures))
    parts = [f"<h1>attnviz report</h1><p class='lead'>{html.escape(str(first.meta.get('model')))} · "
             f"{first.n_tokens} tokens · {html.escape(' · '.join(titles))}"
             + (f" · intervention {html.escape(str(first.meta['intervene']))}" if first.meta.get("intervene") else "")
             + "</p>",
             "<h2>Attention maps</h2><p class='lead'>Every architecture on one colour scale; the sliders move all "
             "of them. Each pixel is the maximum over the tokens it covers, so sinks stay visible.</p>",
             viewer_block(data, "attnviz-maps"),
             "<h2>Sink shifting</h2><p class='lead'>Masking the first key in every layer moves the sink to the "
             "next key; MASK0-BIDIR in the top layers removes it (seed 000, Fig F–K).</p>",
             f"<div class='figs'><div class='fig'>{svgs['shift']}</div><div class='fig'>{svgs['keys']}</div></div>"]
    for cap in caps:
        parts.append(f"<h2>{html.escape(cap.arch)}</h2><div class='figs'>"
                     f"<div class='fig'>{svgs['profile:' + cap.arch]}</div>"
                     f"<div class='fig'>{svgs['alpha:' + cap.arch]}</div></div>")
    rows = "".join(f"<tr><td><b>{html.escape(k)}</b></td><td><code>{html.escape(v)}</code></td></tr>"
                   for k, v in provenance(caps, command))
    parts.append(f"<h2>Provenance</h2><table class='prov'>{rows}</table>"
                 f"<details><summary>text</summary><pre>{html.escape(first.text)}</pre></details>")
    title = f"attnviz report · {first.meta.get('model')} · {' vs '.join(titles)}"
    meta_json = html.escape(json.dumps({**meta, "text": first.text[:2000]}))
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">"
            f"<meta name='attnviz' content=\"{meta_json}\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style>{viewer_head()}</head><body>\n" + "\n".join(parts) + "\n</body></html>\n")
