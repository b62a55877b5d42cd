"""Screenshots of the main pages for the README: `.venv/bin/python scripts/screenshots.py [PAGE ...]`
(default: every page below)."""

import sys

from appserver import ROOT, browser_page, running_app, wait_for_app

PAGES = {"heatmaps": "", "sinks": "sinks", "shifting": "shifting", "compare": "compare", "effects": "effects",
         "designer": "designer", "walkthrough": "walkthrough"}


def main() -> None:
    out = ROOT / "assets" / "screenshots"
    out.mkdir(parents=True, exist_ok=True)
    with running_app() as url, browser_page() as page:
        for name, path in PAGES.items():
            if sys.argv[1:] and name not in sys.argv[1:]:
                continue
            page.goto(f"{url}/{path}")
            if name == "effects":  # computes on request: show the default perplexity comparison
                page.get_by_role("button", name="Compute perplexity").click(timeout=180_000)
            wait_for_app(page)
            if name == "heatmaps":  # the viewer draws once its images are decoded
                page.wait_for_function("() => document.querySelector('.avz-canvas')?.getAttribute('data-shown')")
                page.wait_for_timeout(500)
            page.screenshot(path=str(out / f"{name}.png"), full_page=False)
            print(f"wrote {out / (name + '.png')}")


if __name__ == "__main__":
    main()
