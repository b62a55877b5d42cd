"""Every page of the app on one long text (default 8,192 tokens), through Streamlit's AppTest.

    python bench/pages_long.py [--n 8192] [--only heatmaps,sinks]

Every page must work at the model's full context. This drives the real app script (the
sidebar, the capture cache, the memory plan) in one process on the default model, page by page, in
the order a user would visit them, and prints for each the wall time (captures included: pages that
share a capture find it cached), the charts drawn, and every error the page showed (a refusal that
says what would fit is an error message, not an exception). Ends with
``pages_long N=<N> pages=<k> exceptions=<e> total_s=<t>``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parent.parent
SENTENCE = ("The old lighthouse keeper climbed the narrow stairs every evening to light the lamp, and the "
            "ships passing the rocky coast relied on its steady beam. ")  # 28 tokens when repeated (+1 BOS)


def app(folder: Path) -> AppTest:
    """app.py through a link in a folder without pages/ (see tests/test_app.py: app_test)."""
    link = folder / "app.py"
    link.symlink_to(ROOT / "app.py")
    sys.path.insert(0, str(ROOT))
    return AppTest.from_file(str(link), default_timeout=7200)


def visit(at: AppTest, page: str, then=None) -> dict:
    start = time.perf_counter()
    at.switch_page(str(ROOT / "pages" / f"{page}.py")).run()
    failed = []
    if then is not None:
        try:
            then(at)
        except Exception as err:  # e.g. the widget it clicks was not drawn: reported, the next page goes on
            failed.append(f"{type(err).__name__}: {err}")
    return {"page": page + (f" ({then.__doc__})" if then is not None else ""), "s": time.perf_counter() - start,
            "charts": len(at.get("plotly_chart")), "errors": [e.value for e in at.error],
            "exceptions": [e.value for e in at.exception] + failed}


def value_view(at):
    """value-weighted view"""
    at.radio(key="hm_mode").set_value("value").run()


def zoom_region(at):
    """a full-resolution region"""
    at.button(key="hm_zoom_go").click().run()


def why(at):
    """why: value norms and activations"""
    at.toggle(key="sk_why").set_value(True).run()


def generate(at):
    """generation with a KV cache"""
    at.radio(key="fx_section").set_value("Generation").run()
    at.button(key="fx_gen_run").click().run()


STEPS = {"heatmaps": [None, zoom_region, value_view], "sinks": [None, why], "shifting": [None], "compare": [None],
         "effects": [generate], "designer": [None], "walkthrough": [None]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--only", default="", help="comma-separated pages (default: all)")
    args = parser.parse_args()
    pages = [p for p in STEPS if not args.only or p in args.only.split(",")]
    at = app(Path(tempfile.mkdtemp()))
    at.run()
    text = SENTENCE * max(1, (args.n - 1) // 28)  # at most n tokens
    start = time.perf_counter()
    at.sidebar.text_area(key="text").input(text).run()
    print(f"text set: {time.perf_counter() - start:.1f} s (the first capture)", flush=True)
    if at.error or at.exception:
        sys.exit(f"the text was refused: {[e.value for e in at.error] + [e.value for e in at.exception]}")
    rows = []
    for page in pages:
        for then in STEPS[page]:
            row = visit(at, page, then)
            rows.append(row)
            print(f"{row['page']:<45} {row['s']:8.1f} s  charts={row['charts']}  exceptions={len(row['exceptions'])}",
                  flush=True)
            for message in row["errors"] + row["exceptions"]:
                print(f"    ! {str(message)[:300]}", flush=True)
    n = next((c.value for c in at.caption if " tokens" in str(c.value)), "")
    print(f"captions: {n}")
    print(f"pages_long N={args.n} pages={len(rows)} exceptions={sum(len(r['exceptions']) for r in rows)} "
          f"total_s={time.perf_counter() - start:.0f}")


if __name__ == "__main__":
    main()
