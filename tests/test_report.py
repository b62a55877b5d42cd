"""`attnviz report`: one self-contained HTML file that works in Chromium with no
network, its sliders moving every architecture's map, and its figures and provenance inside."""

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from attnviz.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from appserver import browser_page  # noqa: E402

TEXT = "The cat sat on the mat. The dog sat on the log. A bird sang in the old tree."


@pytest.fixture(scope="module")
def report(model_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "report.html"
    assert main(["report", "--text", TEXT, "--arch", "fwd; nosink-fwd; mask0-bidir(k=8)",
                 "--intervene", "sinkscale(beta=0.5)@29", "--out", str(out)]) == 0
    return out


def test_the_file_holds_every_part_and_nothing_from_outside(report, capsys):
    page = report.read_text()
    assert page.count("<svg") >= 2 + 2 * 3  # shifting panels and sink keys, then profile + alpha per architecture
    for part in ("Attention maps", "Sink shifting", "Provenance", "masks of mask0-bidir(k=8)", "SmolLM2-135M",
                 "versions", "attnviz report --text", "intervention sinkscale(key=0, beta=0.5)@29"):
        assert part in page, part
    assert "<h2>nosink-fwd</h2>" in page and "<h2>mask0-bidir(k=8)</h2>" in page
    # no reference to anything outside the file: no src/href to a URL, a CSP that forbids requests
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page)
    assert "default-src 'none'" in page
    data = json.loads(re.search(r'id="attnviz-maps-data">(.*?)</script>', page, re.S).group(1))
    assert [p["title"] for p in data["panels"]] == ["fwd", "nosink-fwd", "mask0-bidir(k=8)"]
    assert data["regions"] == "off" and len(data["panels"][0]["layers"]) == 30  # every layer, no host to ask


@pytest.mark.browser
@pytest.mark.skipif(not shutil.which("chromium") and not os.environ.get("ATTNVIZ_REQUIRE_BROWSER"),
                    reason="needs chromium (bash scripts/setup.sh dev)")
def test_the_report_works_offline_in_chromium(report):
    with browser_page() as page:
        outside, errors = [], []
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                   else (outside.append(route.request.url), route.abort()))
        page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(("file:", "data:", "blob:")) else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(report.as_uri())
        page.wait_for_function("() => [...document.querySelectorAll('.avz-canvas')].length === 3 && "
                               "[...document.querySelectorAll('.avz-canvas')].every(c => c.getAttribute('data-shown'))")
        canvases = page.locator(".avz-canvas")

        def images():
            return page.evaluate("() => [...document.querySelectorAll('.avz-canvas')].map(c => c.toDataURL())")

        first = images()
        assert len(set(first)) == 3  # three architectures, three different maps
        slider = page.locator(".avz-layer")
        slider.focus()
        slider.press("PageDown")
        page.wait_for_function("() => [...document.querySelectorAll('.avz-canvas')].every(c => "
                               "c.getAttribute('data-shown') && !c.getAttribute('data-shown').startsWith('29/'))")
        moved = images()
        assert all(a != b for a, b in zip(first, moved))
        titles = page.locator(".avz-title").all_text_contents()
        assert titles[2].endswith("— mask0-bidir(k=8)") and "nosink-bidir" not in titles[0]
        head = page.locator(".avz-head")
        head.focus()
        head.press("End")
        page.wait_for_function("() => document.querySelector('.avz-canvas').getAttribute('data-shown').includes('/8/')")
        assert images() != moved
        assert canvases.count() == 3 and outside == [] and errors == []


@pytest.mark.parametrize("argv,message", [
    (["--arch", "fwd; bidr", "--out", "r.html"], "unknown mask type 'bidr'"),
    (["--out", "report.pdf"], "--out must name an .html file"),
    (["--out", "no/such/folder/r.html"], "does not exist"),
    (["--size", "4", "--out", "r.html"], "--size must be 16 to 512"),
    (["--arch", " ; ", "--out", "r.html"], "at least one architecture"),
])
def test_bad_input_is_one_line_and_exit_2(model_cache, tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(["report", "--text", TEXT] + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.browser
@pytest.mark.skipif(not shutil.which("chromium") and not os.environ.get("ATTNVIZ_REQUIRE_BROWSER"),
                    reason="needs chromium (bash scripts/setup.sh dev)")
def test_the_app_downloads_the_same_report(model_cache, tmp_path):
    from appserver import running_app, wait_for_app

    with running_app() as url, browser_page() as page:
        page.goto(f"{url}/shifting")
        button = page.get_by_role("button", name="Download report")
        button.wait_for(timeout=240_000)
        wait_for_app(page)
        with page.expect_download(timeout=240_000) as info:
            button.click()
        target = tmp_path / info.value.suggested_filename
        info.value.save_as(target)
    page_text = target.read_text()
    assert target.suffix == ".html" and "default-src 'none'" in page_text
    data = json.loads(re.search(r'id="attnviz-maps-data">(.*?)</script>', page_text, re.S).group(1))
    assert [p["title"] for p in data["panels"]] == ["fwd", "nosink-fwd", "nosink-fwd(m=2)", "mask0-bidir(k=8)"]
    assert "attnviz report --model default" in page_text and "Sink shifting" in page_text
