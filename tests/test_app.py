"""Every page through Streamlit's AppTest, on the real default model."""

import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from streamlit.testing.v1 import AppTest

from attnviz.effects import walkthrough as W

TIMEOUT = 300


ROOT = Path(__file__).resolve().parent.parent


def app_test(tmp_path, instant: bool = False) -> AppTest:
    """AppTest of app.py, run through a link in an empty folder.

    AppTest treats a ``pages/`` folder beside the entry script as old-style multipage pages and then
    reruns the page alone, skipping app.py (and its sidebar). A real `streamlit run` with
    ``st.navigation`` does not; running the same file from a folder without ``pages/`` avoids it.
    """
    link = tmp_path / "app.py"
    link.symlink_to(ROOT / "app.py")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    at = AppTest.from_file(str(link), default_timeout=TIMEOUT)
    # the Heatmaps page's server-side view (Plotly, what exports draw): AppTest runs no browser script,
    # so the instant viewer is tested in Chromium (test_viewer.py) and by its payload
    at.session_state["hm_instant"] = instant
    return at


@pytest.fixture
def app(model_cache, tmp_path):
    at = app_test(tmp_path)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def on_page(at, page):
    at.switch_page(str(ROOT / page)).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def charts(at):
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def arr(value) -> np.ndarray:
    """A Plotly JSON array: a list, or plotly's typed array {dtype, bdata, shape}."""
    if isinstance(value, dict) and "bdata" in value:
        data = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
        shape = [int(x) for x in str(value.get("shape", len(data))).split(",")]
        return data.reshape(shape).astype(float)
    return np.array(value, dtype=float)


def title(spec):
    t = spec["layout"].get("title")
    return t.get("text") if isinstance(t, dict) else t


def texts(elements):
    return " | ".join(str(e.value) for e in elements)


def test_heatmaps_default_shows_a_sink_and_sliders_move_it(app):
    first = charts(app)[0]
    assert title(first) == "layer 29 · fwd · mean over heads"
    z = arr(first["data"][0]["customdata"])
    assert np.nanmean(z[1:, 0]) > 0.3  # the first key takes a large share in the last layer
    app.slider(key="hm_layer").set_value(3).run()
    assert title(charts(app)[0]) == "layer 3 · fwd · mean over heads"
    app.select_slider(key="hm_head").set_value(4).run()
    assert title(charts(app)[0]) == "layer 3 · fwd · head 4 (KV group 1)"
    app.toggle(key="hm_log").set_value(True).run()
    assert "log10" in charts(app)[0]["data"][0]["colorbar"]["title"]["text"]


def test_architecture_controls_change_the_capture(app):
    app.sidebar.selectbox(key="arch_pick").set_value("MASK0-BIDIR").run()
    app.sidebar.slider(key="arch_k").set_value(4).run()
    assert title(charts(app)[0]) == "layer 29 · nosink-bidir · mean over heads"
    z = arr(charts(app)[0]["data"][0]["customdata"])
    assert np.isnan(z[1:, 0]).all()  # key 0 hidden from later queries: drawn as masked, not as zero


@pytest.mark.parametrize("setup,message", [
    (lambda at: at.sidebar.text_area(key="text").input("   "), "text is empty"),
    (lambda at: at.sidebar.text_area(key="text").input("word " * 9000), "takes at most 8192"),
    (lambda at: (at.sidebar.selectbox(key="arch_pick").set_value("Advanced (string)").run(),
                 at.sidebar.text_input(key="arch_text").input("fwd*20 + bidr*10")), "unknown mask type 'bidr'"),
    (lambda at: (at.sidebar.selectbox(key="arch_pick").set_value("Advanced (string)").run(),
                 at.sidebar.text_input(key="arch_text").input("mask0-bidir(k=40)")), "k=40 but the model has 30 layers"),
    (lambda at: at.sidebar.text_input(key="model").input("no-such-org/no-such-model"), "cannot find model"),
])
def test_bad_input_shows_a_message(app, setup, message):
    setup(app)
    app.run()
    assert not app.exception
    assert message in texts(app.error) + texts(app.warning)


def test_sinks_page(app):
    on_page(app, "pages/sinks.py")
    metric = app.metric[0]
    assert "key 0" in metric.label and int(metric.value.rstrip("%")) > 50
    assert {title(c) for c in charts(app)} >= {"where each layer's attention goes"}
    before = app.metric[0].value
    app.slider(key="sk_eps").set_value(0.9).run()
    assert int(app.metric[0].value.rstrip("%")) < int(before.rstrip("%"))
    app.number_input(key="sk_key").set_value(1).run()
    assert "key 1" in app.metric[0].label


def test_sink_shifting_page_moves_the_sink(app):
    on_page(app, "pages/shifting.py")
    panel = charts(app)[0]
    bars = [t for t in panel["data"] if t["type"] == "bar"]
    sinks = [int(np.argmax(arr(b["y"]))) for b in bars]
    assert sinks[:3] == [0, 1, 2]  # fwd, nosink-fwd, nosink-fwd(m=2)
    assert arr(bars[3]["y"]).max() < 0.2  # mask0-bidir: no sink left in the top layer
    app.text_input(key="sh_archs").input("fwd").run()
    assert "2 to 4" in texts(app.error)


def test_compare_page(app):
    on_page(app, "pages/compare.py")
    kl = float(app.metric[0].value.split()[0])
    assert kl > 0
    app.text_input(key="cmp_b").input("fwd").run()
    assert float(app.metric[0].value.split()[0]) == pytest.approx(0, abs=1e-6)
    app.text_input(key="cmp_b").input("fwd*3").run()
    assert "covers 3 layers but the model has 30" in texts(app.error)


def test_mask_designer(app):
    app.sidebar.selectbox(key="arch_pick").set_value("MASK0&BIDIR").run()
    on_page(app, "pages/designer.py")
    masks = charts(app)[0]
    assert len([t for t in masks["data"] if t["type"] == "heatmap"]) == 30
    top = arr(masks["data"][29]["z"])
    assert top[:, 0].tolist() == [1] + [0] * (len(top) - 1)  # NoSink-BIDIR in the top layer
    app.text_area(key="md_edit").input("fwd*10 + bidir*10").run()
    assert "covers 20 layers" in texts(app.error)
    app.text_area(key="md_edit").input("fwd*28 + nosink-fwd*2").run()
    app.button(key="md_apply").click().run()
    assert app.session_state["arch_text"] == "fwd*28 + nosink-fwd*2"


def test_walkthrough(model_cache, tmp_path):
    at = app_test(tmp_path)
    at.run()
    on_page(at, "pages/walkthrough.py")
    weights = [c for c in charts(at) if title(c).startswith("3.")][0]
    expected = W.steps(W.Q, W.K, W.V, "FWD")["weights"]
    np.testing.assert_allclose(arr(weights["data"][0]["z"]), expected, atol=1e-9)
    assert np.triu(expected, 1).max() == 0
    at.selectbox(key="wt_mask").set_value("BIDIR").run()
    bidir = [c for c in charts(at) if title(c).startswith("3.")][0]
    assert arr(bidir["data"][0]["z"])[np.triu_indices(3, 1)].min() > 0  # future keys now get weight: the leak
    at.text_area(key="wt_q").input("1, 2\n3, x").run()
    assert "Q: every entry must be a number" in texts(at.error)


def test_text_survives_a_visit_to_the_walkthrough(app):
    on_page(app, "pages/walkthrough.py")
    on_page(app, "pages/heatmaps.py")
    assert "text is empty" not in texts(app.warning)
    assert title(charts(app)[0]).startswith("layer 29")


def test_effects_perplexity_compares_architectures(app, default_model):
    from attnviz.effects.evaluate import evaluate

    on_page(app, "pages/effects.py")
    app.selectbox(key="fx_ppl_source").set_value("The sidebar text").run()
    app.button(key="fx_ppl_run").click().run()
    assert not app.exception
    bars = charts(app)[0]["data"][0]
    assert list(bars["x"]) == ["fwd", "nosink-fwd"]
    ids = default_model.tokenizer(app.session_state["text"])["input_ids"]
    expected = [evaluate(default_model, ids, a, window=len(ids)).perplexity for a in ("fwd", "nosink-fwd")]
    np.testing.assert_allclose(arr(bars["y"]), expected, rtol=1e-4)
    app.text_input(key="fx_ppl_archs").input("fwd; sliding(w=8)").run()
    app.button(key="fx_ppl_run").click().run()
    assert list(charts(app)[0]["data"][0]["x"]) == ["fwd", "sliding(w=8)"]
    app.text_input(key="fx_ppl_archs").input("fwd; bidir").run()
    assert "read the token it predicts" in texts(app.error)
    app.number_input(key="fx_ppl_window").set_value(1).run()  # below the widget's minimum: clamped, no traceback
    assert not app.exception


def test_effects_streaming_curves_and_bad_policies(app, default_model):
    from attnviz.effects.evaluate import evaluate

    on_page(app, "pages/effects.py")
    app.radio(key="fx_section").set_value("Streaming (KV cache)").run()
    app.selectbox(key="fx_st_source").set_value("The sidebar text").run()
    app.text_input(key="fx_st_policies").input("dense; window(w=8); sink(s=4, w=4)").run()
    app.button(key="fx_st_run").click().run()
    assert not app.exception
    curves = [t for t in charts(app)[0]["data"] if t["type"] == "scatter"]
    assert [c["name"] for c in curves] == ["dense", "window(w=8)", "sink(s=4, w=4)"]
    ids = default_model.tokenizer(app.session_state["text"])["input_ids"]
    dense = evaluate(default_model, ids, "fwd", window=len(ids)).perplexity
    assert arr(curves[0]["y"])[-1] == pytest.approx(dense, rel=1e-3)  # dense streaming = the plain forward
    assert arr(curves[1]["y"])[-1] > arr(curves[2]["y"])[-1]  # losing the first tokens costs more than keeping 4
    app.text_input(key="fx_st_policies").input("dense; window(w=0)").run()
    assert "must be positive" in texts(app.error)
    app.text_input(key="fx_st_policies").input("window(w=500)").run()
    assert "would never evict" in texts(app.error)
    app.text_input(key="fx_st_policies").input("dense").run()
    app.text_input(key="fx_st_arch").input("inplace-bidir(k=2)").run()
    assert "cannot decode" in texts(app.error)


def test_effects_k_sweep(app):
    on_page(app, "pages/effects.py")
    app.radio(key="fx_section").set_value("Embedding k-sweep").run()
    app.text_input(key="fx_sw_ks").input("0, 30").run()
    app.number_input(key="fx_sw_m").set_value(8).run()
    app.number_input(key="fx_sw_docs").set_value(6).run()
    app.button(key="fx_sw_run").click().run()
    assert not app.exception
    lines = charts(app)[0]["data"]
    assert [t["name"] for t in lines] == ["mask0-bidir", "inplace-bidir"]
    assert list(lines[0]["x"]) == [0, 30]
    assert arr(lines[0]["y"])[0] == arr(lines[1]["y"])[0]  # k = 0 is plain FWD for both
    assert "recall@1" in title(charts(app)[0])
    app.radio(key="fx_sw_metric").set_value("mrr").run()
    assert "MRR" in title(charts(app)[0])  # the score control changes the figure without a re-run
    app.text_input(key="fx_sw_archs").input("fwd").run()
    assert "needs a named architecture" in texts(app.error)


def test_effects_generation_view(app):
    on_page(app, "pages/effects.py")
    app.radio(key="fx_section").set_value("Generation").run()
    app.text_input(key="fx_gen_policy").input("sink(s=2, w=16)").run()
    app.number_input(key="fx_gen_new").set_value(3).run()
    app.button(key="fx_gen_run").click().run()
    assert not app.exception
    fig = charts(app)[0]
    evicted, attention = fig["data"][0], fig["data"][1]
    z = arr(evicted["z"])
    assert np.nansum(z[-1]) == z.shape[1] - 2 - 16 - 1  # last step: all but the 2 sinks, the last 16 and itself
    assert np.isnan(z[-1, :2]).all()  # the sink tokens stay in the cache
    assert "layer 29" in title(fig)
    app.slider(key="fx_gen_layer").set_value(0).run()
    assert "layer 0" in title(charts(app)[0])
    app.text_input(key="fx_gen_arch").input("bidir").run()
    assert "cannot generate" in texts(app.error)


def test_effects_generation_replays_steps(app):
    on_page(app, "pages/effects.py")
    app.radio(key="fx_section").set_value("Generation").run()
    app.number_input(key="fx_gen_new").set_value(2).run()
    app.button(key="fx_gen_run").click().run()
    full = arr(charts(app)[0]["data"][1]["z"])
    app.slider(key="fx_gen_steps").set_value(5).run()
    part = arr(charts(app)[0]["data"][1]["z"])
    np.testing.assert_array_equal(part[:5], full[:5])
    assert np.isnan(part[5:]).all() and np.isfinite(full[5:]).any()


def test_heatmap_modes_value_logits_rollout(app, default_model):
    from attnviz import capture
    from attnviz.plan import Keep
    from attnviz.stats import metrics

    weight = arr(charts(app)[0]["data"][0]["customdata"])
    app.radio(key="hm_mode").set_value("value").run()
    assert not app.exception
    first = charts(app)[0]
    assert "value-weighted" in title(first) and "||A·f(v)||" in first["data"][0]["colorbar"]["title"]["text"]
    cap = capture(default_model, app.session_state["text"], "fwd", Keep(value_norms=True, storage_dtype=torch.float32))
    expected = np.where(cap.allowed[29], cap.value_weighted(29).mean(0), np.nan)
    np.testing.assert_allclose(arr(first["data"][0]["customdata"]), expected, rtol=2e-3, atol=1e-4)
    app.radio(key="hm_mode").set_value("logits").run()
    logits = arr(charts(app)[0]["data"][0]["customdata"])
    assert np.nanmin(logits) < 0 and np.isnan(logits[0, 1:]).all()  # signed scores; the future stays masked
    app.radio(key="hm_mode").set_value("rollout").run()
    roll = arr(charts(app)[0]["data"][0]["customdata"])
    np.testing.assert_allclose(roll.sum(1), 1, atol=1e-3)
    assert "rollout of layers 0–29" in title(charts(app)[0])
    assert any("linearly" in str(c.value) for c in app.caption)
    assert not np.allclose(weight, roll, equal_nan=True)
    ref = metrics.rollout([cap.layer_probs(l).mean(0) for l in range(30)])
    np.testing.assert_allclose(roll, ref, atol=2e-3)


def test_sinks_dataset_mode_with_gu_preset(app, default_model):
    from attnviz import corpus
    from attnviz.effects import dataset

    on_page(app, "pages/sinks.py")
    app.radio(key="sk_view").set_value("a dataset").run()
    app.number_input(key="sk_maxlen").set_value(16).run()
    app.slider(key="sk_eps").set_value(0.5).run()
    app.button(key="sk_gu").click().run()
    assert app.number_input(key="sk_maxlen").value == 64 and app.slider(key="sk_eps").value == 0.3
    app.number_input(key="sk_maxlen").set_value(16).run()
    app.number_input(key="sk_samples").set_value(5).run()
    app.button(key="sk_ds_run").click().run()
    assert not app.exception
    rates = charts(app)[0]["data"][0]
    direct = dataset.sinks(default_model, corpus.stdlib().documents, "fwd", "doc", 16, 5)
    expected = [np.nanmean(direct.rates()[:, l]) for l in range(30)]
    np.testing.assert_allclose(arr(rates["y"]), expected, atol=1e-6)
    assert "error_y" in rates and "95%" in app.metric[0].delta
    assert len(charts(app)) == 3  # rates, alpha by key, averaged map
    before = arr(charts(app)[2]["data"][0]["customdata"])
    app.toggle(key="sk_ds_spread").set_value(True).run()
    assert not np.allclose(arr(charts(app)[2]["data"][0]["customdata"]), before, equal_nan=True)
    app.text_input(key="sk_ds_arch").input("fwd*3").run()
    assert "covers 3 layers" in texts(app.error)


def test_sinks_why_section(app):
    on_page(app, "pages/sinks.py")
    app.toggle(key="sk_why").set_value(True).run()
    assert not app.exception
    titles = [title(c) for c in charts(app)]
    shares = [c for c in charts(app) if "much attention, little value" in title(c)][0]
    attention, output = arr(shares["data"][0]["z"]), arr(shares["data"][1]["z"])
    assert np.nanmean(attention[15:]) > np.nanmean(output[15:])  # the sink's value is small
    assert any(t.startswith("massive activations") for t in titles)
    assert len(app.dataframe) >= 1


def test_effects_linformer_section(app):
    on_page(app, "pages/effects.py")
    app.radio(key="fx_section").set_value("Linformer what-if").run()
    app.text_input(key="fx_lin_ks").input("2, 8, 16").run()
    assert not app.exception
    fig_map, fig_err = charts(app)[0], charts(app)[1]
    assert "k = 8" in title(fig_map) and len(fig_map["data"][0]["x"]) == 8
    errors = arr(fig_err["data"][0]["y"])
    assert list(fig_err["data"][0]["x"]) == [2, 8, 16] and errors[0] > errors[-1]
    app.select_slider(key="fx_lin_show").set_value(16).run()
    assert "k = 16" in title(charts(app)[0])
    app.text_input(key="fx_lin_ks").input("4, 500").run()
    assert "Linformer k must be between 1 and n - 1" in texts(app.error)


def test_walkthrough_linformer_and_nan(model_cache, tmp_path):
    at = app_test(tmp_path)
    at.run()
    on_page(at, "pages/walkthrough.py")
    assert any(title(c).startswith("E (k × n)") for c in charts(at))
    at.slider(key="wt_lin_k").set_value(3).run()
    assert at.metric[0].value == "0.00%"
    at.text_area(key="wt_v").input("1, 2\n3, inf\n5, 6").run()
    assert "finite number" in texts(at.error)


def test_a_failed_model_is_remembered_with_a_retry_button(app):
    app.sidebar.text_input(key="model").input("no-such-org/no-such-model").run()
    assert "cannot find model" in texts(app.error)
    retry = app.sidebar.button(key="model_retry")
    from ui.cache import _failed_models

    assert ("no-such-org/no-such-model", False) in _failed_models()  # not looked up again on the next rerun
    retry.click().run()
    assert "cannot find model" in texts(app.error)  # looked up once more, failed again, remembered again
    app.sidebar.text_input(key="model").input("default").run()
    assert "cannot find model" not in texts(app.error) and charts(app)


def test_pages_without_a_model_never_load_one(app):
    on_page(app, "pages/walkthrough.py")
    app.sidebar.text_input(key="model").input("some-org/never-loaded").run()
    assert not app.error and charts(app)  # no lookup, no error: the walkthrough needs no model
    from ui.cache import _failed_models

    assert ("some-org/never-loaded", False) not in _failed_models()
    on_page(app, "pages/designer.py")
    assert len([t for t in charts(app)[0]["data"] if t["type"] == "heatmap"]) == 30  # a 30-layer default


def test_residual_variant_in_the_sidebar_changes_the_capture(app):
    top = arr(charts(app)[0]["data"][0]["customdata"])
    app.slider(key="hm_layer").set_value(0).run()
    bottom = arr(charts(app)[0]["data"][0]["customdata"])
    app.sidebar.selectbox(key="residual").set_value("method1").run()
    assert not app.exception
    # layer 0 reads h_{-1} = X under every method: the same map
    np.testing.assert_allclose(arr(charts(app)[0]["data"][0]["customdata"]), bottom, atol=2e-3, equal_nan=True)
    app.slider(key="hm_layer").set_value(29).run()
    assert not np.allclose(arr(charts(app)[0]["data"][0]["customdata"]), top, atol=1e-2, equal_nan=True)
    on_page(app, "pages/compare.py")
    assert "not recorded under a residual variant" in " ".join(str(c.value) for c in app.caption)


def test_effects_residual_table(app, tmp_path):
    from attnviz.core.engine.residual import SEED_TABLE

    (tmp_path / "m1").mkdir()
    (tmp_path / "m1" / "metrics.json").write_text(json.dumps(
        {"residual": "method1", "eval_perplexity": 20.5, "eval_accuracy": 0.4, "steps": 3,
         "before": {"eval_perplexity": 30.0}}))
    on_page(app, "pages/effects.py")
    app.radio(key="fx_section").set_value("Residual methods").run()
    app.text_input(key="fx_res_dir").input(str(tmp_path)).run()
    assert not app.exception
    bars = charts(app)[0]["data"]
    assert list(bars[0]["x"])[:3] == ["baseline", "method1", "method2"]
    assert arr(bars[0]["y"])[1] == SEED_TABLE["method1"][0]
    ours = bars[1]["y"]
    assert ours[1] == 20.5 and ours[0] is None


def test_every_icon_is_shipped_and_none_is_a_material_symbol():
    """A ":material/…:" icon is drawn from Google's servers (the page icon) or a font: the app's are a file it ships
    (assets/icon.png) and emoji, so nothing is fetched offline (tests/test_e2e_browser.py watches the requests)."""
    sources = [ROOT / "app.py", *sorted((ROOT / "pages").glob("*.py")), *sorted((ROOT / "ui").glob("*.py"))]
    assert [p.name for p in sources if ":material/" in p.read_text(encoding="utf-8")] == []
    assert 'ICON = Path(__file__).resolve().parent / "assets" / "icon.png"' in (ROOT / "app.py").read_text()
    assert (ROOT / "assets" / "icon.png").is_file()


def test_compare_page_greys_only_what_both_masks_hide_and_titles_its_maps(app):
    """Compare A vs B at its defaults (FWD against MASK0-BIDIR at layer 29, where B is bidirectional without key 0):
    the difference map shows B's attention above the diagonal, which A may not see, and A's on key 0, which B hides;
    no cell is grey, since no cell is hidden from both. The top pair of maps has a title and its axes' titles."""
    on_page(app, "pages/compare.py")
    specs = charts(app)
    top = next(s for s in specs if "layer 29" in (title(s) or ""))
    assert "mean over heads" in title(top)
    layout = top["layout"]
    assert layout["xaxis"]["title"]["text"] == "key" and layout["yaxis"]["title"]["text"] == "query"
    diff = next(s for s in specs if (title(s) or "").startswith("difference"))
    z = arr(diff["data"][0]["z"])
    n = z.shape[0]
    assert n == 48 and not np.isnan(z).any()  # before: every cell A masks (the upper triangle, and more) was grey
    assert (z[np.triu_indices(n, 1)] >= 0).all() and z[np.triu_indices(n, 1)].max() > 0.01  # B attends where A may not
    assert (z[1:, 0] < 0).all()  # key 0: FWD attends, MASK0 hides


def test_sinks_page_says_which_keys_where_the_sinks_are_shows(app):
    """The lighthouse text has 48 tokens: the map of where the sinks are shows keys 0–23 and says it is the first
    half (before: keys 0–23 with no word of it)."""
    on_page(app, "pages/sinks.py")
    spec = next(s for s in charts(app) if "where the sinks are" in (title(s) or ""))
    assert "keys 0–23 of 48" in title(spec) and "first half" in title(spec)
    assert "keys 0–23 of 48" in spec["layout"]["xaxis"]["title"]["text"]
