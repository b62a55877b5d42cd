"""The same attention in three notebook viewers, side by side in one run, measured in headless Chromium.

    pip install 'attnviz[bench]'            # BertViz and CircuitsVis (never runtime dependencies)
    python bench/viewers.py [--sizes 128,512,2048] [--out /tmp/attnviz-viewers] [--max-mb 300]

For each size, the default model's stock eager ``output_attentions`` of a text of that many tokens
(Python's reference docs) is written three ways:
- ``bertviz``: BertViz's ``head_view(attention, tokens, html_action="return")``, every layer;
- ``circuitsvis``: CircuitsVis' ``attention_patterns(tokens, attention[last layer][0])``, one layer (its
  own inline script, so it works offline);
- ``attnviz``: ``attnviz.save_html(attention, tokens, path)``, every layer.
Each file is opened in headless Chromium from disk with the network cut, and the bench prints its size,
the time to the first drawn map (from navigation start, read in the page), the time a layer change
takes to repaint (from the key press or select change to the drawn map, read in the page; median of 5)
and the page's JS heap after drawing. A file that would exceed ``--max-mb`` is not written (its
projected size is printed); a file that does not draw within a minute is reported as not drawn.
Measure on a quiet machine (nothing else running).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from common import ids_on

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

DRAWN = {  # per viewer: a JS expression true once its first map is drawn
    "attnviz": "!!document.querySelector('.avz-canvas')?.getAttribute('data-shown')",
    "bertviz": "document.querySelectorAll('#vis svg line, #vis svg rect, svg .attention-line').length > 0",
    "circuitsvis": "[...document.querySelectorAll('[id^=circuits-vis] canvas, [id^=circuits-vis] svg, "
                   "[id^=circuits-vis] td')].some(e => e.getBoundingClientRect().height > 0)",
}
FLOAT_CHARS = 20  # a float32 written by json.dumps: the bulk of the peers' files


def attention_of(n: int):
    """The default model's eager attention of the first ``n`` tokens of the stdlib docs, and its tokens."""
    import torch

    import attnviz
    from attnviz import corpus

    lm = attnviz.load("default")
    ids = corpus.head_ids(lm.tokenizer, corpus.stdlib().text, n)
    model = lm.model
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attention = model(ids_on(model, ids), output_attentions=True).attentions
    tokens = [lm.tokenizer.decode([i]) for i in ids]
    return attention, tokens


def write_files(attention, tokens, out: Path, max_mb: float) -> dict:
    """Each viewer's file (or why it was not written), with the time it took to make."""
    import attnviz

    n, layers, heads = len(tokens), len(attention), attention[0].shape[1]
    files = {}
    start = time.perf_counter()
    path = attnviz.save_html(attention, tokens, out / f"attnviz-{n}.html")
    files["attnviz"] = {"path": path, "build_s": time.perf_counter() - start}
    projected = {"bertviz": layers * heads * n * n * FLOAT_CHARS, "circuitsvis": heads * n * n * FLOAT_CHARS}
    for name, size in projected.items():
        if size > max_mb * 2**20:
            files[name] = {"skipped": f"not written: ~{size / 2**20:,.0f} MB of JSON floats (> --max-mb {max_mb:g})"}
            continue
        start = time.perf_counter()
        if name == "bertviz":
            from bertviz import head_view

            parts = head_view(attention, tokens, html_action="return")
            html = f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{parts.data}</body></html>"
        else:
            from circuitsvis.attention import attention_patterns

            rendered = attention_patterns(tokens, attention[-1][0])
            html = f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{rendered.local_src}</body></html>"
        path = out / f"{name}-{n}.html"
        path.write_text(html, encoding="utf-8")
        files[name] = {"path": path, "build_s": time.perf_counter() - start}
    return files


def measure(page, name: str, path: Path, layers: int) -> dict:
    """Size, first drawn map, layer-change repaint and JS heap of one file in the browser."""
    out = {"mb": path.stat().st_size / 2**20}
    page.context.route("http*://**", lambda route: route.abort())  # offline, as a lab's notebook may be
    try:
        page.goto(path.as_uri(), wait_until="commit", timeout=600_000)
        page.wait_for_function(f"() => {DRAWN[name]}", timeout=60_000, polling="raf")
        out["first_map_s"] = page.evaluate("() => performance.now()") / 1000
    except Exception as err:  # noqa: BLE001 - a peer that does not draw is a result, not a crash
        out["first_map_s"] = None
        out["note"] = f"not drawn within 60 s ({type(err).__name__})"
        return out
    times = []
    if name == "attnviz":
        page.evaluate("""() => { window.__t = []; const c = document.querySelector('.avz-canvas');
            new MutationObserver(() => window.__t.push(performance.now())).observe(c, {attributes: true,
            attributeFilter: ['data-shown']}); }""")
        slider = page.locator(".avz-layer")
        slider.focus()
        for _ in range(5):
            page.evaluate("() => { window.__t = []; window.__k = performance.now(); }")
            slider.press("ArrowLeft")
            page.wait_for_function("() => window.__t.length > 0", timeout=60_000, polling="raf")
            times.append(page.evaluate("() => window.__t[0] - window.__k") / 1000)
    elif name == "bertviz" and layers > 1:
        for layer in range(layers - 2, layers - 7, -1):
            page.evaluate("() => { window.__k = performance.now(); }")
            page.select_option("#layer", str(layer))
            page.wait_for_function(f"() => {DRAWN[name]}", timeout=60_000, polling="raf")
            page.evaluate("() => new Promise(r => requestAnimationFrame(() => r()))")
            times.append(page.evaluate("() => performance.now() - window.__k") / 1000)
    out["repaint_s"] = statistics.median(times) if times else None
    cdp = page.context.new_cdp_session(page)
    cdp.send("Performance.enable")
    metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
    out["heap_mb"] = metrics.get("JSHeapUsedSize", 0) / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="128,512,2048")
    parser.add_argument("--out", default="/tmp/attnviz-viewers")
    parser.add_argument("--max-mb", type=float, default=300.0)
    args = parser.parse_args()
    from appserver import browser_page

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        attention, tokens = attention_of(n)
        files = write_files(attention, tokens, out, args.max_mb)
        layers = len(attention)
        del attention
        for name in ("bertviz", "circuitsvis", "attnviz"):
            row = {"n": len(tokens), "viewer": name, **{k: v for k, v in files[name].items() if k != "path"}}
            if "path" in files[name]:
                with browser_page() as page:
                    row.update(measure(page, name, files[name]["path"], layers))
            rows.append(row)
            print(json.dumps(row, default=lambda x: round(x, 3) if isinstance(x, float) else str(x)), flush=True)
    print("\n| tokens | viewer | file (MB) | first map (s) | layer repaint (s) | JS heap (MB) | note |")
    print("|---|---|---|---|---|---|---|")
    fmt = lambda v, f="{:.2f}": "—" if v is None else f.format(v)  # noqa: E731
    for r in rows:
        print(f"| {r['n']} | {r['viewer']} | {fmt(r.get('mb'), '{:.1f}')} | {fmt(r.get('first_map_s'))} | "
              f"{fmt(r.get('repaint_s'), '{:.3f}')} | {fmt(r.get('heap_mb'), '{:.0f}')} | "
              f"{r.get('skipped') or r.get('note') or ''} |")


if __name__ == "__main__":
    main()
