"""Screenshots of every page for the README's page table: `.venv/bin/python scripts/screenshots.py [PAGE ...]`
(default: every page below; PAGE is a page's file name in pages/, as the README links it).

Each page is opened in headless Chromium as a visitor would, with the sidebar's defaults; a page that computes
on request gets its button clicked, the Sweeps page is pointed at a small sweep run first
(`attnviz sweep examples/sinks.toml`, about a minute) and the Emergence page at a lab run trained first (the default
setup, 1,000 steps: about half a minute). Writes assets/screenshots/<page>.png.
"""

import subprocess
import sys
import tempfile

from appserver import ROOT, browser_page, running_app, wait_for_app

#: page file (pages/<name>.py) -> its URL path (the default page has none)
PAGES = {"heatmaps": "", "sinks": "sinks", "shifting": "shifting", "compare": "compare", "heads": "heads",
         "why": "why", "routes": "routes", "patching": "patching", "effects": "effects", "sweeps": "sweeps",
         "emergence": "emergence", "designer": "designer", "walkthrough": "walkthrough", "definitions": "definitions"}
#: pages that compute on request -> the button a visitor clicks
BUTTONS = {"effects": "Compute perplexity", "patching": "Patch"}


def sweep_results() -> str:
    """A results folder of the README's example sweep, for the Sweeps page to show."""
    out = tempfile.mkdtemp(prefix="sweep-example-")
    subprocess.run([sys.executable, "-m", "attnviz", "sweep", str(ROOT / "examples" / "sinks.toml"), "--out", out,
                    "--workers", "1"], cwd=ROOT, check=True)
    return out


def lab_runs() -> str:
    """A folder holding one run of the lab's default setup, for the Emergence page to show."""
    from attnviz.lab.train import Setup, train

    out = tempfile.mkdtemp(prefix="lab-runs-")
    train(Setup(steps=1000), f"{out}/softmax-fwd-seed0")
    return out


def main() -> None:
    asked = sys.argv[1:]
    unknown = sorted(set(asked) - set(PAGES))
    if unknown:
        sys.exit(f"no such page: {', '.join(unknown)} (pages: {', '.join(PAGES)})")
    out = ROOT / "assets" / "screenshots"
    out.mkdir(parents=True, exist_ok=True)
    results = sweep_results() if not asked or "sweeps" in asked else None
    runs = lab_runs() if not asked or "emergence" in asked else None
    with running_app() as url, browser_page() as page:
        for name, path in PAGES.items():
            if asked and name not in asked:
                continue
            page.goto(f"{url}/{path}")
            if name in BUTTONS:
                page.get_by_role("button", name=BUTTONS[name], exact=True).click(timeout=180_000)
            if name == "sweeps":
                folder = page.locator('[data-testid="stMain"] input[aria-label="Results folder"]')
                folder.fill(results)
                folder.press("Enter")
            if name == "emergence":
                folder = page.locator('[data-testid="stMain"] input[aria-label="Runs folder"]')
                folder.fill(runs)
                folder.press("Enter")
            if name in BUTTONS or name in ("sweeps", "emergence"):  # its figure comes after the click
                page.locator('[data-testid="stMain"] [data-testid="stPlotlyChart"]').first.wait_for(timeout=1_200_000)
            if name == "definitions":  # text only: wait for the document and the end of the run
                page.locator('[data-testid="stMain"] h1').first.wait_for(timeout=120_000)
                page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')",
                                       timeout=120_000)
                page.wait_for_timeout(800)
            else:
                wait_for_app(page)
            if name == "heatmaps":  # the viewer draws once its images are decoded
                page.wait_for_function("() => document.querySelector('.avz-canvas')?.getAttribute('data-shown')")
                page.wait_for_timeout(500)
            if page.locator('[data-testid="stException"]').count():
                sys.exit(f"{name}: the page shows an exception")
            page.screenshot(path=str(out / f"{name}.png"), full_page=False)
            print(f"wrote {out / (name + '.png')}", flush=True)


if __name__ == "__main__":
    main()
