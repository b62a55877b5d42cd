"""The Emergence page end to end: `streamlit run app.py` on localhost, driven in Debian's headless Chromium, as
tests/test_e2e_browser.py drives the other pages: a tiny run trained here, its map moved along the step slider, its
token labels thinned, a run trained on the page and the time estimate following the typed steps."""

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from appserver import browser_page, running_app, wait_for_app  # noqa: E402
from test_e2e_browser import no_exception, wait_title  # noqa: E402

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not shutil.which("chromium") and not os.environ.get("ATTNVIZ_REQUIRE_BROWSER"),
                                 reason="needs chromium (bash scripts/setup.sh dev)")]


def test_the_emergence_page_moves_a_runs_map_along_its_checkpoints(model_cache, tmp_path):
    from attnviz.lab.tasks import BigramBackcopy
    from attnviz.lab.train import Setup, train

    runs = tmp_path / "runs"
    train(Setup(layers=1, width=32, heads=2, steps=8, every=4, batch=4, warmup=2,
                task=BigramBackcopy(vocab=24, triggers=2, length=40)), runs / "tiny")
    with running_app() as url, browser_page() as page:
        page.goto(f"{url}/emergence")
        page.locator('[data-testid="stMain"] h1').filter(has_text="Emergence").first.wait_for(timeout=180_000)
        wait_for_app(page)
        folder = page.locator('[data-testid="stMain"] input[aria-label="Runs folder"]')
        folder.fill(str(runs))
        folder.press("Enter")
        wait_title(page, "tiny · step 8 · layer 0")
        wait_for_app(page)
        no_exception(page)
        # the step slider, moved with the keyboard to the first checkpoint: the map follows
        slider = page.locator('[data-testid="stMain"] [data-testid="stSlider"] input[type="range"]').first
        slider.focus()
        slider.press("Home")
        wait_title(page, "tiny · step 0 · layer 0")
        wait_for_app(page)
        no_exception(page)
        # the map's 40 tokens: at most 24 labelled under it, every second one (the Routes page's token axis)
        labels = page.locator('[data-testid="stMain"] [data-testid="stPlotlyChart"]').first.locator(".xtick text")
        assert 10 <= labels.count() <= 24, labels.all_text_contents()
        # the curves over training, from the run's own table
        page.wait_for_function("() => [...document.querySelectorAll('[data-testid=\"stMain\"] .gtitle')]"
                               ".some(e => e.textContent.includes('the sink forming'))", timeout=120_000)
        titles = page.locator('[data-testid="stMain"] .gtitle').all_text_contents()
        assert any("the sink forming" in t for t in titles), titles
        # a run trained here, then the time estimate follows the steps as they are typed (no Train pressed)
        page.get_by_text("Train a small run").click()
        steps = page.locator('[data-testid="stMain"] input[aria-label="Steps"]')
        steps.fill("2")
        steps.press("Tab")
        wait_for_app(page)
        page.get_by_role("button", name="Train", exact=True).click()
        page.get_by_text("Trained: softmax-fwd-seed0-2steps", exact=False).first.wait_for(timeout=180_000)
        wait_title(page, "softmax-fwd-seed0-2steps · step 2 · layer 0")
        steps.fill("20")
        steps.press("Tab")
        estimate = page.get_by_text("ms a step, measured on this server", exact=False).first
        page.wait_for_function("() => /about [0-9,]+ s here/.test(document.querySelector('[data-testid=\"stMain\"]')"
                               ".innerText) && [...document.querySelectorAll('input[aria-label=\"Steps\"]')]"
                               ".every(e => e.value === '20')", timeout=60_000)
        wait_for_app(page)
        said = re.search(r"about ([\d,]+) s here \(([\d.,]+) ms a step", estimate.inner_text())
        total, per = float(said.group(1).replace(",", "")), float(said.group(2).replace(",", ""))
        assert abs(total - 20 * per / 1000) <= 0.5 + 0.05 * total, said.group(0)  # 20 steps, not the default 400
        no_exception(page)
        # a folder that is no run: one line, no traceback
        folder.fill(str(tmp_path / "nowhere"))
        folder.press("Enter")
        page.get_by_text("is no training run and holds none", exact=False).first.wait_for(timeout=60_000)
        no_exception(page)


def test_the_sweeps_pages_grid_of_trained_runs_opens_a_cell_in_emergence(model_cache, tmp_path):
    """A tiny training sweep (2 seeds, `--local`), its grid on the Sweeps page, a cell opened in the Emergence page."""
    from attnviz.cli import main

    spec = tmp_path / "grid.toml"
    spec.write_text('[train]\nseed = [0, 1]\nsteps = 8\nevery = 4\nwidth = 32\nheads = 2\nbatch = 4\nwarmup = 2\n'
                    'vocab = 16\ntriggers = 2\nlength = 24\n[measures.emergence]\nsamples = 4\n')
    out = tmp_path / "results"
    assert main(["sweep", str(spec), "--out", str(out), "--local"]) == 0
    first = sorted(p.name for p in (out / "runs").iterdir())[0]
    with running_app() as url, browser_page() as page:
        page.goto(f"{url}/sweeps")
        page.locator('[data-testid="stMain"] h1').filter(has_text="Sweeps").first.wait_for(timeout=180_000)
        folder = page.locator('[data-testid="stMain"] input[aria-label="Results folder"]')
        folder.fill(str(out))
        folder.press("Enter")
        wait_title(page, "Trained runs: step the sink forms, seed × kind")
        wait_for_app(page)
        no_exception(page)
        page.get_by_role("button", name="Open in Emergence").click()
        wait_title(page, f"{first} · step 8 · layer 0")  # the cell's first run, at its last checkpoint
        wait_for_app(page)
        no_exception(page)
        assert page.locator('[data-testid="stMain"] input[aria-label="Runs folder"]').input_value() == str(out / "runs")
