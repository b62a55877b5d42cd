"""The viewer in notebooks: examples/quickstart.ipynb executed by nbclient, its widgets
saved with the notebook, and the exported HTML working in Chromium with nothing fetched."""

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from appserver import browser_page  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VIEW = "application/vnd.jupyter.widget-view+json"
STATE = "application/vnd.jupyter.widget-state+json"


@pytest.fixture(scope="module")
def executed(model_cache):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", store_widget_state=True,
                   resources={"metadata": {"path": str(ROOT / "examples")}}).execute()
    return nb


def widget_outputs(nb):
    """The attnviz widgets' outputs (the model's loading bar is a widget too)."""
    state = nb.metadata["widgets"][STATE]["state"]
    return [(cell, out) for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
            if VIEW in out.get("data", {}) and "_esm" in state[out["data"][VIEW]["model_id"]]["state"]]


def test_the_quickstart_runs_and_saves_its_widgets(executed):
    errors = [o for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
    views = widget_outputs(executed)
    assert len(views) == 2  # attnviz.show, attnviz.show_compare
    state = executed.metadata["widgets"][STATE]["state"]
    for _, out in views:
        saved = state[out["data"][VIEW]["model_id"]]
        assert saved["model_name"] == "AnyModel" and "attnvizHeatmap" in saved["state"]["_esm"]
    single, compare = (state[o["data"][VIEW]["model_id"]]["state"]["data"] for _, o in views)
    assert len(single["panels"]) == 1 and len(compare["panels"]) == 2
    assert [p["title"] for p in compare["panels"]] == ["fwd", "nosink-fwd"]
    assert len(single["panels"][0]["layers"]) == 30 and single["encoding"]["bits"] == 16


def test_the_widget_asks_the_kernel_for_layers_and_regions(default_model, use_settings):
    from attnviz import capture, show

    cap = capture(default_model, "The cat sat on the mat. The dog sat on the log.", "fwd")
    use_settings(viewer_mb=0.1)  # ATTNVIZ_VIEWER_MB: a payload of a few layers
    widget = show(cap)
    sent = sorted(int(k) for k in widget.data["panels"][0]["layers"])
    assert 29 in sent and 0 not in sent
    widget.want = 0  # what the browser sets when the slider reaches layer 0
    assert 0 in {int(k) for k in widget.data["panels"][0]["layers"]}
    widget.box = {"layer": 3, "head": None, "queries": [2, 9], "keys": [0, 5]}
    region = widget.region
    assert region.queries == (2, 9) and region.keys == (0, 5)
    assert abs(region.values[:, 4, 1] - cap.layer_probs(3)[:, 6, 1]).max() < 1e-6


@pytest.mark.browser
@pytest.mark.skipif(not shutil.which("chromium") and not os.environ.get("ATTNVIZ_REQUIRE_BROWSER"),
                    reason="needs chromium (bash scripts/setup.sh dev)")
def test_the_exported_notebook_moves_its_sliders_offline(executed, tmp_path):
    from attnviz.viewer.notebook import notebook_html

    path = tmp_path / "quickstart.html"
    path.write_text(notebook_html(executed))
    with browser_page() as page:
        outside, errors = [], []
        page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(("file:", "data:", "blob:")) else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(path.as_uri())
        page.wait_for_function("() => [...document.querySelectorAll('.avz-canvas')].filter(c => "
                               "c.getAttribute('data-shown')).length === 3", timeout=60_000)
        before = page.evaluate("() => document.querySelector('.avz-canvas').toDataURL()")
        slider = page.locator(".avz-layer").first
        slider.focus()
        slider.press("ArrowLeft")
        page.wait_for_function("() => document.querySelector('.avz-canvas').getAttribute('data-shown').startsWith('28/')")
        assert page.evaluate("() => document.querySelector('.avz-canvas').toDataURL()") != before
        assert page.locator(".avz-title").first.inner_text() == "layer 28 · fwd · mean over heads"
        assert errors == [] and outside == [], (errors, outside)
