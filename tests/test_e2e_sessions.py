"""Eight people on one server: eight Chromium contexts, each with its own text and
architecture, all get their own correct heatmap, none an error, and the model is loaded once."""

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from appserver import CHROMIUM_ARGS, chromium_path, running_app, wait_for_app  # noqa: E402

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not shutil.which("chromium") and not os.environ.get("ATTNVIZ_REQUIRE_BROWSER"),
                                 reason="needs chromium (bash scripts/setup.sh dev)")]

SESSIONS = 8
SENTENCE = "Session {i} reads its own words about lighthouses and storms. "
TITLES = "[...document.querySelectorAll('.avz-title')].map(e => e.textContent)"  # the Heatmaps page's viewer


def _pick_architecture(page, name: str) -> None:
    box = page.locator('[data-testid="stSidebar"] [data-testid="stSelectbox"]').filter(has_text="Architecture")
    field = box.locator("input").first
    field.click()
    field.fill(name)  # typing filters the list; the first match, the exact name, is chosen with Enter
    field.press("Enter")


def test_eight_concurrent_sessions_each_get_their_own_result(model_cache, default_model, tmp_path):
    from playwright.sync_api import sync_playwright

    texts = [SENTENCE.format(i=i) * (i + 1) for i in range(SESSIONS)]
    archs = ["FWD" if i % 2 == 0 else "BIDIR" for i in range(SESSIONS)]
    tokens = [len(default_model.tokenizer(t, add_special_tokens=True)["input_ids"]) for t in texts]
    log_path = tmp_path / "streamlit.log"  # this test's own server log (another worker may run a server too)
    with running_app(log_path=log_path) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
        pages = [browser.new_context(viewport={"width": 1400, "height": 900}).new_page() for _ in range(SESSIONS)]
        for page in pages:  # all eight open at once
            page.goto(url)
        for page in pages:
            wait_for_app(page)
        for page, text, arch in zip(pages, texts, archs):  # each asks for its own capture, none waits
            if arch != "FWD":
                _pick_architecture(page, arch)
            area = page.locator('[data-testid="stSidebar"] textarea').first
            area.fill(text)
            area.press("Control+Enter")
        for i, (page, arch) in enumerate(zip(pages, archs)):
            page.wait_for_function(
                "() => [...document.querySelectorAll('[data-testid=\"stCaptionContainer\"]')]"
                f".some(e => e.textContent.includes('· {tokens[i]} tokens ·'))", timeout=300_000)
            wait_for_app(page)
            page.wait_for_function(  # the viewer holds this session's own capture
                f"() => document.querySelector('.avz-root')?.__attnviz?.data.n_tokens === {tokens[i]}", timeout=120_000)
            assert page.locator('[data-testid="stException"]').count() == 0
            assert page.locator('[data-testid="stAlert"]').filter(has_text="rror").count() == 0
            titles = page.evaluate(f"() => {TITLES}")
            assert f"layer 29 · {arch.lower()} · mean over heads" in titles, (i, titles)
            caption = page.locator('[data-testid="stCaptionContainer"]').filter(has_text="tokens").first.inner_text()
            assert f"`{arch.lower()}`" in caption or f"{arch.lower()} ·" in caption, caption
        browser.close()
    log = log_path.read_text(errors="replace")
    assert len(re.findall(r"Loading weights:\s+0%", log)) == 1  # one shared model, loaded once
    assert "Traceback" not in log
