"""Interaction latency of the real app in headless Chromium.

    python bench/ui_latency.py [--n 2048] [--moves 9]

Starts ``streamlit run app.py`` on a free localhost port, opens the Heatmaps page in Debian's
Chromium (Playwright), pastes a text of about ``--n`` tokens into the sidebar and measures
- first paint: from applying the text to the heatmap of that text drawn (the capture included);
- slider repaint: from the key press on the Layer slider, then on the Head slider (its ``keydown``
  event in the page) to the first animation frame after the heatmap of the new layer or head is in
  the page (a MutationObserver sees its title change), ``--moves`` times each; the median of all
  moves is reported. The heatmap is the browser-side viewer (attnviz.viewer) unless ``--server``
  asks for the server-drawn Plotly view. A viewer move needs a round trip only for a layer outside
  its payload: the viewer counts those requests, and the benchmark prints how many moves made one
  (every server-view move is one).
  Measured inside the page, since
  polling the page from Python adds a round trip and its own polling interval to every move; that
  driver-side time is printed beside each move too.
Ends with ``ui_latency N=<N> slider_repaint_median_s=<x> first_paint_s=<y>`` (goal: repaint <= 0.3 s
at 2,048 tokens for the server view, <= 0.05 s at 8,192 tokens for the viewer). Times are wall clock:
server, network and browser rendering.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from appserver import browser_page, running_app, wait_for_app  # noqa: E402

SENTENCE = ("The old lighthouse keeper climbed the narrow stairs every evening to light the lamp, and the "
            "ships passing the rocky coast relied on its steady beam. ")  # 28 tokens when repeated (+1 BOS)
SENTENCE_TOKENS = 28

# In the page: the time of each keydown, and of the frame painted after a heatmap title changes.
PROBE = """
window.__keys = []; window.__paints = [];
document.addEventListener('keydown', () => window.__keys.push(performance.now()), true);
new MutationObserver(() => {
  const t = [...document.querySelectorAll('[data-testid="stMain"] .gtitle, .avz-title')].map(e => e.textContent)
    .find(t => t.startsWith('layer '));
  if (t && t !== window.__title) {
    window.__title = t;
    requestAnimationFrame(() => window.__paints.push([t, performance.now()]));
  }
}).observe(document, {subtree: true, childList: true, characterData: true});
"""

TITLE = ("[...document.querySelectorAll('[data-testid=\"stMain\"] .gtitle, .avz-title')]"
         ".map(e => e.textContent)")


def heatmap_title(page) -> str:
    titles = page.evaluate(f"() => {TITLE}")
    return next((t for t in titles if t.startswith("layer ")), "")


def wait_title(page, prefix: str, timeout_ms: int = 600_000) -> None:
    page.wait_for_function(f"() => {TITLE}.some(t => t.startsWith({prefix!r}))", timeout=timeout_ms, polling=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--moves", type=int, default=9)
    parser.add_argument("--server", action="store_true", help="the server-drawn view (Plotly), not the viewer")
    args = parser.parse_args()
    text = SENTENCE * max(1, (args.n - 1) // SENTENCE_TOKENS)  # at most n tokens
    with running_app() as url, browser_page() as page:
        page.add_init_script(PROBE)
        page.goto(url)
        wait_for_app(page)
        if args.server:
            page.get_by_text("Instant viewer").click()
            wait_for_app(page)
        area = page.locator('[data-testid="stSidebar"] textarea').first
        area.fill(text)
        start = time.perf_counter()
        area.press("Control+Enter")  # apply the text
        page.wait_for_function("() => [...document.querySelectorAll('[data-testid=\"stCaptionContainer\"]')]"
                               f".some(e => / {{0,1}}· \\d+ tokens/.test(e.textContent) && "
                               f"!e.textContent.includes('· 48 tokens'))", timeout=900_000, polling=50)
        caption = page.locator('[data-testid="stCaptionContainer"]').filter(has_text="tokens").first.inner_text()
        n = int(re.search(r"(\d+) tokens", caption).group(1))
        if not args.server:  # the viewer shows the new text once its payload arrived (the old map until then)
            page.wait_for_function(f"() => document.querySelector('.avz-root')?.__attnviz?.data.n_tokens === {n} && "
                                   "document.querySelector('.avz-canvas')?.getAttribute('data-shown')",
                                   timeout=900_000, polling=20)
        wait_title(page, "layer 29 ")
        page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=900_000)
        first_paint = time.perf_counter() - start
        page.wait_for_timeout(1500)  # the page settles (overview, downloads) before the first move, as a person reads it
        main = page.locator('[data-testid="stMain"]')
        times, trips = [], []

        def asked() -> int:
            return page.evaluate("() => document.querySelector('.avz-root')?.__attnviz?.requests || 0")

        def move(slider, key: str, shown: str) -> None:
            """Press ``key`` on ``slider``; time it until a heatmap title containing ``shown`` is painted."""
            page.evaluate("() => { window.__keys = []; window.__paints = []; }")
            asked_before = asked()
            start = time.perf_counter()
            slider.press(key)
            page.wait_for_function(f"() => {TITLE}.some(t => t.includes({shown!r}))", timeout=600_000, polling=20)
            driver = time.perf_counter() - start
            page.wait_for_function(f"() => window.__paints.some(p => p[0].includes({shown!r}))")
            pressed = page.evaluate("() => window.__keys[0]")
            painted = page.evaluate(f"() => window.__paints.find(p => p[0].includes({shown!r}))[1]")
            times.append((painted - pressed) / 1000)
            trips.append(args.server or asked() > asked_before)
            page.wait_for_timeout(300)  # let the app settle, as a person would between moves
            print(f"{shown.strip(' ·')}: {times[-1]:.3f} s (seen from the driver: {driver:.3f} s)"
                  + (" · round trip" if trips[-1] else ""), flush=True)

        layer_slider = main.get_by_role("slider", name="Layer").first
        layer_slider.focus()
        for step in range(args.moves):
            move(layer_slider, "ArrowLeft", f"layer {28 - step} ")
        head_slider = main.get_by_role("slider", name="Head").first
        head_slider.focus()
        for head in range(min(args.moves, 9)):  # "mean" first, then heads 0, 1, ...
            move(head_slider, "ArrowRight", f"· head {head}")
        print(f"round trips: {sum(trips)} of {len(trips)} moves ({'server view' if args.server else 'viewer'})")
        print(f"ui_latency N={n} slider_repaint_median_s={statistics.median(times):.3f} first_paint_s={first_paint:.2f}")


if __name__ == "__main__":
    main()
