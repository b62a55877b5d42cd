"""Start the app on a free localhost port and drive it in Debian's headless Chromium (Playwright).

Used by the end-to-end test and by ``scripts/screenshots.py``. Chromium is launched with the flags
that keep it off the network (this machine has none) and with ``executable_path``: Playwright's own
browser download is never used.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]


def chromium_path() -> str:
    for name in ("chromium", "chromium-browser"):
        if found := shutil.which(name):
            return found
    raise RuntimeError("Debian's chromium is not installed: run `bash scripts/setup.sh dev`")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_app(timeout: float = 180.0, log_path: Path = ROOT / ".streamlit-e2e.log"):
    """Yield the base URL of `streamlit run app.py` on a free localhost port, its output in ``log_path``; stop it
    afterwards."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(port),
                             "--server.address", "127.0.0.1", "--server.headless", "true"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if urllib.request.urlopen(url + "/_stcore/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
            if proc.poll() is not None:
                raise RuntimeError(f"streamlit exited: {Path(log_path).read_text()[-2000:]}")
        else:
            raise RuntimeError("streamlit did not become healthy in time")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@contextmanager
def browser_page(width: int = 1500, height: int = 1000):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport={"width": width, "height": height}, accept_downloads=True)
        try:
            yield context.new_page()
        finally:
            context.close()
            browser.close()


def wait_for_app(page, timeout_ms: int = 240_000) -> None:
    """Wait until the script finished running and at least one chart is drawn (or a message shown)."""
    page.wait_for_function(  # any of them visible (the first in the page may be off screen)
        "() => [...document.querySelectorAll('[data-testid=\"stPlotlyChart\"], [data-testid=\"stAlert\"], "
        ".avz-canvas')].some(e => e.getClientRects().length && e.getBoundingClientRect().height > 0)",
        timeout=timeout_ms, polling=100)
    page.wait_for_function(
        "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=timeout_ms)
    page.wait_for_timeout(800)
