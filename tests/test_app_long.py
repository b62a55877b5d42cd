"""The app with long texts and a memory budget, through AppTest on the default model."""

import os
import re
import threading

import numpy as np
import pytest

from conftest import ENGLISH
from test_app import app_test, arr, charts, on_page, texts

LONG = " ".join([ENGLISH] * 14)  # ~600 tokens


def _rss_mb() -> float:
    """What the process holds: its resident size after Python's garbage is collected and glibc has given back
    the heap it keeps free (``malloc_trim``). Without the trim, freed-but-kept heap from every test before this
    one in the same process counts as held, and the figure depends on the order the suite ran in."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the plain resident size
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.fixture
def env(monkeypatch):
    return monkeypatch.setenv


@pytest.fixture
def only_this_test_s_models():
    """The app's loaded models count against its memory budget: start with none resident, whichever app tests ran
    before in this process (another model, another precision), so the budget is this test's model's alone."""
    from ui import cache

    cache._models().clear()


def test_a_long_text_gets_pooled_maps_and_full_resolution_regions(model_cache, default_model, tmp_path, env):
    from attnviz.capture import capture
    from attnviz.plan import Keep

    env("ATTNVIZ_FULL_MAPS_MB", "8")  # ~600 tokens would take ~200 MB of full maps: statistics + pooled maps
    at = app_test(tmp_path)
    at.run()
    at.sidebar.text_area(key="text").input(LONG).run()
    assert not at.exception and not at.error, texts(at.error)
    assert "maximum of 2 × 2 tokens" in texts(at.caption)
    assert at.toggle(key="hm_log").value  # log scale by default above 256 tokens
    n = default_model.tokenizer(LONG, add_special_tokens=True)["input_ids"].__len__()
    at.slider(key="hm_zq").set_value((n - 30, n)).run()
    at.slider(key="hm_zk").set_value((0, 20)).run()
    assert not [c for c in charts(at) if "queries" in str(c["layout"].get("title", ""))]  # a forward: on request
    # the long capture kept layer inputs: the region resumes at layer 28's, not at the embeddings
    assert at.button(key="hm_zoom_go").help.startswith("Re-runs layers 28–29 ")
    at.button(key="hm_zoom_go").click().run()
    assert not at.exception and not at.error, texts(at.error)
    region = [c for c in charts(at) if "queries" in str(c["layout"].get("title", ""))][0]
    values = arr(region["data"][0]["customdata"])
    full = capture(default_model, LONG, "fwd", Keep(layers=[29])).layer_probs(29).mean(0)
    np.testing.assert_allclose(values, np.where(np.tril(np.ones((n, n), bool))[n - 30:, :20],
                                                full[n - 30:, :20], np.nan), atol=2e-3, equal_nan=True)
    on_page(at, "pages/sinks.py")  # statistics pages work on the same long capture
    assert not at.error, texts(at.error)
    assert len(charts(at)) >= 3


@pytest.mark.parametrize("where", ["environment", "secrets"])
def test_a_capture_that_cannot_fit_is_refused_before_it_runs(model_cache, tmp_path, env, monkeypatch, where,
                                                              only_this_test_s_models):
    monkeypatch.delenv("ATTNVIZ_MEMORY_MB", raising=False)
    at = app_test(tmp_path)
    if where == "environment":
        env("ATTNVIZ_MEMORY_MB", "600")  # the model's weights take ~540 MB of it
    else:  # .streamlit/secrets.toml: [attnviz] memory_mb = 600
        at.secrets["attnviz"] = {"memory_mb": 600}
    at.run()
    assert not at.error, texts(at.error)  # a short text fits
    at.sidebar.text_area(key="text").input(" ".join([ENGLISH] * 100)).run()
    assert not at.exception
    message = texts(at.error)
    assert "more than the" in message and "What would fit: a text of at most" in message


def test_resident_size_stays_within_the_budget(model_cache, default_model, tmp_path, env, only_this_test_s_models):
    """Captures under different architectures, one after another, each ~670 MB of full maps under an
    800 MB budget: the cache evicts before it computes, so the process holds the budget plus the
    capture being built and its working set (the stated margin, 1 GB), not every capture it made
    (five would be +3.3 GB)."""
    weights = sum(p.numel() * p.element_size() for p in default_model.model.parameters()) / 2**20
    budget_mb, margin_mb = 800, 1000
    env("ATTNVIZ_MEMORY_MB", str(int(weights + budget_mb)))
    at = app_test(tmp_path)
    at.run()
    text = " ".join([ENGLISH] * 23)  # ~1,000 tokens
    at.sidebar.text_area(key="text").input(text).run()
    base = _rss_mb()
    peak = base
    for spec in ("nosink-fwd*30", "bidir*30", "fwd*20 + back*10", "nosink-bidir*30", "back*30"):
        at.sidebar.selectbox(key="arch_pick").set_value("Advanced (string)").run()
        at.sidebar.text_input(key="arch_text").input(spec).run()
        assert not at.exception and not at.error, texts(at.error)
        peak = max(peak, _rss_mb())
    assert peak - base <= budget_mb + margin_mb, f"resident size grew by {peak - base:.0f} MB"


def test_two_sessions_asking_for_the_same_capture_compute_it_once(model_cache, tmp_path, monkeypatch):
    from attnviz.capture import Prepared

    calls = []
    original = Prepared.run

    def counted(self, *args, **kwargs):  # the capture's one run: the app prepares it, its job queue runs it
        calls.append(self.text)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Prepared, "run", counted)
    text = "Two sessions, one capture: " + ENGLISH
    sessions = []
    for i in range(2):
        (tmp_path / str(i)).mkdir()
        at = app_test(tmp_path / str(i))
        at.run()
        at.sidebar.text_area(key="text").input(text)
        sessions.append(at)
    threads = [threading.Thread(target=at.run) for at in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for at in sessions:
        assert not at.exception and not at.error, texts(at.error)
        assert charts(at)
    assert calls.count(text) == 1


def test_every_page_works_on_a_long_capture(model_cache, tmp_path, env):
    """Every page on a text past the full-maps limit (the 8,192-token path at ~600 tokens): the
    statistics pages draw, and each view that needs more than statistics and pooled maps says what
    would fit instead of failing (bench/pages_long.py runs the same pages at 8,192)."""
    env("ATTNVIZ_FULL_MAPS_MB", "12")  # ~670 tokens: 30 full layers ~140 MB do not fit, one (~5 MB) does
    at = app_test(tmp_path)
    at.run()
    at.sidebar.text_area(key="text").input(LONG).run()
    assert not at.exception and not at.error, texts(at.error)
    at.radio(key="hm_mode").set_value("value").run()  # every layer's value-weighted maps, max-pooled
    assert not at.exception and not at.error, texts(at.error)
    assert "layer 29 · fwd · mean over heads · value-weighted" in str(charts(at)[0]["layout"]["title"])
    assert "maximum of 2 × 2 tokens" in texts(at.caption)
    at.slider(key="hm_layer").set_value(5).run()
    assert "layer 5 · fwd · mean over heads · value-weighted" in str(charts(at)[0]["layout"]["title"])
    at.radio(key="hm_mode").set_value("logits").run()  # pre-softmax scores, max-pooled over allowed cells
    assert not at.exception and not at.error, texts(at.error)
    assert "layer 5 · fwd · mean over heads · pre-softmax" in str(charts(at)[0]["layout"]["title"])
    at.radio(key="hm_mode").set_value("rollout").run()
    assert not at.exception and "Rollout multiplies the full maps of every layer" in texts(at.error)
    at.radio(key="hm_mode").set_value("weight").run()
    for page, least_charts in (("sinks", 4), ("shifting", 3), ("compare", 3), ("designer", 1), ("walkthrough", 1)):
        on_page(at, f"pages/{page}.py")
        assert not at.error, (page, texts(at.error))
        assert len(charts(at)) >= least_charts, page
        if page == "compare":  # no hidden-state cosine for a long text, and it says so
            assert "nor for a long text" in texts(at.caption)
    on_page(at, "pages/sinks.py")
    at.toggle(key="sk_why").set_value(True).run()
    assert not at.exception and "What would fit" in texts(at.error)
    assert "One layer alone would take ~28 MB" in texts(at.error)  # packed, with the hidden states of every layer
    env("ATTNVIZ_FULL_MAPS_MB", "30")  # one packed layer and the hidden states fit (~28 MB), two do not
    at.run()
    assert re.search(r"fewer recorded layers \([12] of 30 fit at this length: `attnviz capture --layers`\)",
                     texts(at.error)), texts(at.error)
    env("ATTNVIZ_FULL_MAPS_MB", "12")
    on_page(at, "pages/effects.py")
    at.radio(key="fx_section").set_value("Generation").run()
    at.button(key="fx_gen_run").click().run()
    assert not at.exception and "a prompt of at most ~" in texts(at.error)  # refused before it runs
    at.radio(key="fx_section").set_value("Linformer what-if").run()
    assert not at.exception and not at.error, texts(at.error)
    assert len(charts(at)) == 2
