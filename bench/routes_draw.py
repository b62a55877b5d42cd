"""How long the Routes page's graph takes to draw in headless Chromium, against the Sink shifting page's panels
drawn in the same browser (same text, same run).

    python bench/routes_draw.py [--n 256] [--repeat 5]

Starts ``streamlit run app.py``, pastes a text of about ``--n`` tokens into the sidebar, opens the Routes page
(FWD beside NoSink-FWD: two graphs, the edges drawn capped) and waits for it; then, inside the page, redraws the
graph's figure with ``Plotly.react`` from scratch (``Plotly.purge`` first) ``--repeat`` times and takes the median
(the browser's drawing alone: no server, no network); the same for the sink-share chart below it, the baseline.
Ends with ``routes_draw N=<N> graph_s=<s> share_chart_s=<s> ratio=<graph/share>`` (the goal: the graph within 1 s
at 256 tokens).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from appserver import browser_page, running_app, wait_for_app  # noqa: E402

SENTENCE = ("The old lighthouse keeper climbed the narrow stairs every evening to light the lamp, and the "
            "ships passing the rocky coast relied on its steady beam. ")  # 28 tokens when repeated (+1 BOS)

DRAW = """async ([title, repeat]) => {
    const el = [...document.querySelectorAll('[data-testid="stPlotlyChart"]')]
        .find(e => [...e.querySelectorAll('.gtitle')].some(t => t.textContent.startsWith(title)));
    const shown = el.querySelector('.js-plotly-plot');
    const data = JSON.parse(JSON.stringify(shown.data)), layout = JSON.parse(JSON.stringify(shown.layout));
    const box = shown.getBoundingClientRect();
    const gd = document.createElement('div');
    gd.style.width = box.width + 'px'; gd.style.height = box.height + 'px';
    document.body.appendChild(gd);
    const times = [];
    for (let i = 0; i < repeat; i++) {
        Plotly.purge(gd);
        const start = performance.now();
        await Plotly.newPlot(gd, data, layout);
        await new Promise(r => requestAnimationFrame(() => r()));
        times.push(performance.now() - start);
    }
    gd.remove();
    times.sort((a, b) => a - b);
    return [times[Math.floor(times.length / 2)] / 1000, gd.data.length,
            gd.data.reduce((n, t) => n + (t.x ? t.x.length : 0), 0)];
}"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    text = SENTENCE * max(1, args.n // 28)
    with running_app() as url, browser_page() as page:
        page.goto(f"{url}/routes")
        wait_for_app(page)
        area = page.locator('[data-testid="stSidebar"] textarea').first
        area.fill(text)
        area.press("Control+Enter")
        page.wait_for_timeout(1000)
        page.locator('[data-testid="stMain"] [data-testid="stPlotlyChart"]').filter(
            has_text="routes of token").first.wait_for(timeout=600_000)
        wait_for_app(page, timeout_ms=600_000)
        import plotly

        # the page's own Plotly is inside Streamlit's bundle: the same library, loaded once more to draw with
        page.add_script_tag(path=str(Path(plotly.__file__).parent / "package_data" / "plotly.min.js"))
        graph_s, traces, points = page.evaluate(DRAW, ["routes of token", args.repeat])
        share_s, _, _ = page.evaluate(DRAW, ["share of the kept attention flow", args.repeat])
        print(f"graph traces={traces} points={points}")
        print(f"routes_draw N={args.n} graph_s={graph_s:.3f} share_chart_s={share_s:.3f} ratio={graph_s / share_s:.2f}")


if __name__ == "__main__":
    main()
