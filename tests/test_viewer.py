"""The client-side heatmap viewer: its payload against the capture, and the component
in headless Chromium as a static file and in the app (slider moves repaint in the browser, a box
drag asks the app for a full-resolution region, a layer outside the payload comes on request)."""

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from attnviz.figures.style import max_pool
from attnviz.viewer import payload as payload_mod
from attnviz.viewer.static import standalone_html

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from appserver import browser_page, running_app, wait_for_app  # noqa: E402

needs_chromium = pytest.mark.skipif(not shutil.which("chromium") and not os.environ.get("ATTNVIZ_REQUIRE_BROWSER"),
                                    reason="needs chromium (bash scripts/setup.sh dev)")
TEXT = "The cat sat on the mat. The dog sat on the log."


@pytest.fixture(scope="module")
def cap(default_model):
    from attnviz import capture
    from attnviz.recipe import Recipe
    from attnviz.plan import Keep

    return capture(default_model, TEXT, "fwd")


def test_sixteen_bit_codes_give_the_capture_s_values(cap):
    data = payload_mod.payload([cap])
    assert data["encoding"] == {"bits": 16, "lo": -8.0, "hi": 0.0}
    assert data["layers"] == list(range(30)) and len(data["panels"][0]["layers"]) == 30
    layer = data["panels"][0]["layers"]["29"]
    allowed = cap.allowed[29]
    probs = cap.layer_probs(29)
    for index, expected in ((0, probs.mean(0)), (4, probs[3])):
        values = payload_mod.decode(layer["heads"][index], **data["encoding"])
        ok = allowed & (expected > 1e-8)
        np.testing.assert_allclose(values[ok], expected[ok], rtol=3e-4)  # 8 decades in 65,535 codes
    mask = payload_mod.decode(layer["mask"], 0.0, 1.0, 8) > 1  # white (1.0 -> 10) where allowed
    assert (mask == allowed).all() and layer["factor"] == 1


def test_pooled_eight_bit_codes_are_the_max_pooled_log_values(cap):
    data = payload_mod.payload([cap], size=4)  # 16 tokens drawn in 4 px a side: 4 tokens a pixel
    assert data["encoding"]["bits"] == 8
    layer = data["panels"][0]["layers"]["29"]
    assert layer["factor"] == 4 and layer["shape"] == [4, 4]
    expected = max_pool(np.where(cap.allowed[29], cap.layer_probs(29)[2], np.nan), 4, 4)
    values = payload_mod.decode(layer["heads"][3], **data["encoding"])
    ok = ~np.isnan(expected) & (expected > 1e-4)
    step = 4 / 255  # one code in log10 units
    assert np.abs(np.log10(values[ok]) - np.log10(expected[ok])).max() <= step / 2 + 1e-9


def test_webp_codes_stay_within_a_few_levels_and_the_mask_stays_exact(cap):
    png = payload_mod.payload([cap], size=8)
    webp = payload_mod.payload([cap], size=8, image_format="webp", quality=90)
    a, b = png["panels"][0]["layers"]["10"], webp["panels"][0]["layers"]["10"]
    assert b["heads"][0].startswith("data:image/webp;base64,")
    assert a["mask"] == b["mask"]
    codes = [np.log10(payload_mod.decode(x["heads"][1], **png["encoding"])) for x in (a, b)]
    assert np.abs(codes[0] - codes[1]).mean() < 4 * 4 / 255


def test_the_window_takes_the_nearest_layers_the_budget_holds():
    assert payload_mod.window(list(range(30)), 29, 100, limit=300) == [27, 28, 29]
    assert payload_mod.window(list(range(30)), 10, 100, limit=500) == [8, 9, 10, 11, 12]
    assert payload_mod.window(list(range(30)), 10, 100, limit=10**6) == list(range(30))
    assert payload_mod.window(list(range(30)), 3, 10**9, limit=1) == [3]  # the asked layer always


def test_side_by_side_captures_must_share_their_tokens(cap, default_model):
    from attnviz import capture
    from attnviz.recipe import Recipe
    from attnviz.plan import Keep

    other = capture(default_model, "Another text.", "fwd")
    with pytest.raises(ValueError, match="same tokens"):
        payload_mod.payload([cap, other])
    two = payload_mod.payload([cap, capture(default_model, TEXT, "nosink-fwd")], titles=["fwd", "nosink"])
    assert [p["title"] for p in two["panels"]] == ["fwd", "nosink"]
    assert two["panels"][1]["masks"]["0"] != two["panels"][0]["masks"]["0"]


def shown(page, index=0) -> str:
    return page.locator(".avz-canvas").nth(index).get_attribute("data-shown") or ""


def pixels(page, index=0) -> str:
    return page.evaluate(f"() => document.querySelectorAll('.avz-canvas')[{index}].toDataURL()")


@pytest.mark.browser
@needs_chromium
def test_a_static_file_moves_through_layers_and_heads_offline(cap, tmp_path):
    path = tmp_path / "viewer.html"
    path.write_text(standalone_html(payload_mod.payload([cap], log=False)))
    with browser_page() as page:
        requests, errors = [], []
        page.on("request", lambda r: requests.append(r.url))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(path.as_uri())
        page.wait_for_function("() => document.querySelector('.avz-canvas')?.getAttribute('data-shown')")
        assert shown(page) == "29/mean/linear"
        assert page.locator(".avz-title").inner_text() == "layer 29 · fwd · mean over heads"
        before = pixels(page)
        slider = page.locator(".avz-layer")
        slider.focus()
        slider.press("Home")
        page.wait_for_function("() => document.querySelector('.avz-canvas').getAttribute('data-shown') === '0/mean/linear'")
        assert pixels(page) != before
        head = page.locator(".avz-head")
        head.focus()
        head.press("ArrowRight")
        head.press("ArrowRight")
        page.wait_for_function("() => document.querySelector('.avz-canvas').getAttribute('data-shown') === '0/1/linear'")
        linear = pixels(page)
        page.locator(".avz-log").check()
        page.wait_for_function("() => document.querySelector('.avz-canvas').getAttribute('data-shown') === '0/1/log'")
        assert pixels(page) != linear
        # hover at full resolution: the tokens and the value of that cell
        box = page.locator(".avz-canvas").bounding_box()
        geom = page.evaluate("() => { const g = document.querySelector('.avz-root').__attnviz.panels[0].geom;"
                             " return [g.left, g.top, g.W, g.H, g.m.w]; }")
        left, top, width, height, n = geom
        q, k = 9, 1
        page.mouse.move(box["x"] + left + (k + 0.5) * width / n, box["y"] + top + (q + 0.5) * height / n)
        tip = page.locator(".avz-tip").inner_text()
        assert f"query {q} {json.dumps(cap.tokens[q])} → key {k} {json.dumps(cap.tokens[k])}" in tip
        value = float(tip.split("p = ")[1])
        assert value == pytest.approx(float(cap.layer_probs(0)[1][q, k]), rel=1e-3)
        # a box drag in a static file asks nobody and says why
        page.mouse.move(box["x"] + left + 5, box["y"] + top + 5)
        page.mouse.down()
        page.mouse.move(box["x"] + left + width / 2, box["y"] + top + height / 2, steps=4)
        page.mouse.up()
        assert "this file is static" in page.locator(".avz-note").inner_text()
        assert [r for r in requests if not r.startswith(("file:", "data:"))] == [] and errors == []


def viewer_title(page) -> str:
    return page.locator(".avz-title").first.inner_text()


def wait_viewer(page, expected: str, timeout=60_000) -> None:
    page.wait_for_function(f"() => [...document.querySelectorAll('.avz-title')].some(e => e.textContent === {expected!r})",
                           timeout=timeout, polling=20)


@pytest.mark.browser
@needs_chromium
def test_the_app_viewer_repaints_without_the_server_and_asks_it_for_regions_and_layers(model_cache, monkeypatch):
    """A move inside the payload sends nothing to the server; a box drag returns the region at full
    resolution; with a payload of a few layers, a far layer comes in one round trip."""
    monkeypatch.setenv("ATTNVIZ_VIEWER_MB", "0.3")  # ~3 layers of the 48-token default text
    with running_app() as url, browser_page() as page:
        sent = []
        page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(len(payload))))
        page.goto(url)
        wait_for_app(page)
        wait_viewer(page, "layer 29 · fwd · mean over heads")
        sent.clear()
        slider = page.locator(".avz-layer")
        slider.focus()
        slider.press("ArrowLeft")  # layer 28: in the payload
        wait_viewer(page, "layer 28 · fwd · mean over heads")
        assert sent == []  # repainted in the browser: no message to the server
        page.keyboard.press("Home")  # layer 0: asked for, once
        wait_viewer(page, "layer 0 · fwd · mean over heads", timeout=120_000)
        assert len(sent) >= 1
        page.wait_for_timeout(1500)  # the view reported where it rests
        wait_for_app(page)

        # a box drag: the app answers with the region at full resolution
        box = page.locator(".avz-canvas").first.bounding_box()
        left, top, width, height, n = page.evaluate(
            "() => { const g = document.querySelector('.avz-root').__attnviz.panels[0].geom;"
            " return [g.left, g.top, g.W, g.H, g.m.w]; }")
        cell = width / n
        page.mouse.move(box["x"] + left + 0.5 * cell, box["y"] + top + 30.5 * cell)
        page.mouse.down()
        page.mouse.move(box["x"] + left + 9.5 * cell, box["y"] + top + 39.5 * cell, steps=5)
        page.mouse.up()
        page.wait_for_function("() => [...document.querySelectorAll('.gtitle')].some(e => e.textContent.includes("
                               "'queries 30–39 × keys 0–9'))", timeout=120_000)
        wait_for_app(page)
        title = [t for t in page.locator(".gtitle").all_text_contents() if "queries" in t][0]
        assert title.startswith("layer 0 · fwd · mean over heads")
        assert page.locator('[data-testid="stException"]').count() == 0


def test_the_heatmaps_page_sends_the_viewer_the_capture_s_maps(model_cache, default_model, tmp_path):
    """AppTest runs no browser script: what the page gives the component is checked instead."""
    from test_app import app_test

    from attnviz import capture
    from attnviz.recipe import Recipe
    from attnviz.plan import Keep
    from conftest import ENGLISH

    at = app_test(tmp_path, instant=True)
    at.run()
    assert not at.exception and not at.error
    (element,) = at.get("bidi_component")
    data = json.loads(element.proto.json)
    assert data["regions"] == "host" and data["layers"] == list(range(30))
    assert sorted(int(k) for k in data["panels"][0]["layers"]) == list(range(30))  # a short text: all at once
    assert data["view"]["layer"] is None or data["view"]["layer"] == 29
    full = capture(default_model, ENGLISH, "fwd", Keep(layers=[7])).layer_probs(7)
    values = payload_mod.decode(data["panels"][0]["layers"]["7"]["heads"][3], **data["encoding"])  # head 2
    ok = np.tril(np.ones_like(full[2], bool)) & (full[2] > 1e-6)
    np.testing.assert_allclose(values[ok], full[2][ok], rtol=2e-3)  # the app's fp16 storage, then 16-bit codes


def test_a_payload_names_its_captures_so_the_viewer_never_merges_another_one(cap, default_model):
    """The viewer merges a payload into the one it holds when their ids match: the same capture again,
    never the same text under another intervention or with a BOS token in front."""
    from attnviz import capture
    from attnviz.recipe import Recipe
    from attnviz.plan import Keep

    same = payload_mod.payload([cap], layers=[0])["id"]
    assert payload_mod.payload([cap], layers=[29])["id"] == same
    others = [capture(default_model, TEXT, Recipe.of(default_model, "fwd", intervene="temperature(t=2)")),
              capture(default_model, TEXT, Recipe.of(default_model, "fwd", prepend="bos"))]
    assert all(payload_mod.payload([o], layers=[0])["id"] != same for o in others)


@pytest.mark.browser
@needs_chromium
def test_the_viewer_s_own_png_carries_the_metadata_every_export_carries(tmp_path):
    """The PNG button writes the image as drawn with the same iTXt chunks as every other PNG export
    (figures.export.embed_metadata): "attnviz" (the JSON of describe(), the view's layer and head added) and
    "Description" (model · architecture)."""
    import io

    from PIL import Image

    import tiny
    from attnviz import capture
    from attnviz.figures import export

    lm = tiny.loaded("llama")
    a, b = capture(lm, "the cat sat", "fwd"), capture(lm, "the cat sat", "nosink-fwd")
    path = tmp_path / "viewer.html"
    path.write_text(standalone_html(payload_mod.payload([a, b], titles=["fwd", "nosink"], log=False)))
    with browser_page() as page:
        page.goto(path.as_uri())
        page.wait_for_function("() => document.querySelector('.avz-canvas')?.getAttribute('data-shown')")
        head = page.locator(".avz-head")
        head.focus()
        head.press("ArrowRight")  # head 0
        page.wait_for_function("() => document.querySelector('.avz-canvas').getAttribute('data-shown') === '2/0/linear'")
        with page.expect_download(timeout=60_000) as info:
            page.locator(".avz-png").click()
        data, name = Path(info.value.path()).read_bytes(), info.value.suggested_filename
    assert name == "attnviz_layer2_h0.png"
    image = Image.open(io.BytesIO(data))
    image.load()  # every chunk's CRC holds
    assert image.format == "PNG" and image.size[0] > 0
    meta = export.read_metadata(data, "png")
    want = export.describe(a, 2, 0)
    assert {k: meta[k] for k in want if k != "arch"} == {k: v for k, v in want.items() if k != "arch"}
    assert meta["arch"] == "fwd vs nosink" and meta["figure"] == "viewer" and meta["scale"] == "linear"
    assert [p["recipe"] for p in meta["panels"]] == [export.describe(c)["recipe"] for c in (a, b)]
    assert [p["mask"] for p in meta["panels"]] == [c.layer_masks[2] for c in (a, b)]
    assert image.text["Description"] == f"{want['model']} · fwd vs nosink"
