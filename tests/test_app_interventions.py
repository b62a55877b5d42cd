"""Interventions and the BOS control in the app, through AppTest on the default model."""

import numpy as np

from test_app import app_test, arr, charts, on_page, texts, title


def test_the_sidebar_intervention_changes_every_page(model_cache, tmp_path):
    at = app_test(tmp_path)
    at.run()
    before = charts(at)[0]
    at.sidebar.selectbox(key="iv_pick").set_value("sinkscale (ACT)").run()
    at.sidebar.slider(key="iv_beta").set_value(0.0).run()
    assert not at.exception and not at.error, texts(at.error)
    assert "intervention `sinkscale(key=0, beta=0)@20-29`" in texts(at.sidebar.caption)
    after = charts(at)[0]
    assert title(after) == title(before) == "layer 29 · fwd · mean over heads"
    sink_before = np.nanmean(arr(before["data"][0]["customdata"])[1:, 0])
    sink_after = np.nanmean(arr(after["data"][0]["customdata"])[1:, 0])
    assert sink_before > 0.3 and sink_after < 1e-3  # beta = 0: the sink's attention moved to the other keys
    on_page(at, "pages/sinks.py")
    assert not at.error, texts(at.error)


def test_a_bad_intervention_string_is_one_message(model_cache, tmp_path):
    at = app_test(tmp_path)
    at.run()
    at.sidebar.selectbox(key="iv_pick").set_value("Advanced (string)").run()
    at.sidebar.text_input(key="iv_text").input("sinkscale(beta=3)@2").run()
    assert not at.exception
    assert "Intervention: sinkscale beta must be between 0 and 1" in texts(at.error)
    at.sidebar.text_input(key="iv_text").input("ablate(heads=12)").run()
    assert "head 12 does not exist" in texts(at.error)


def test_compare_with_and_without_an_intervention(model_cache, tmp_path):
    at = app_test(tmp_path)
    at.run()
    on_page(at, "pages/compare.py")
    at.radio(key="cmp_mode").set_value("with and without an intervention").run()
    at.text_input(key="cmp_intervene").input("sinkscale(beta=0)@29").run()
    assert not at.exception and not at.error, texts(at.error)
    panels = charts(at)[0]
    names = [a["text"] for a in panels["layout"]["annotations"]]
    assert any("A: fwd" == n for n in names) and any("B: fwd · sinkscale(key=0, beta=0)@29" == n for n in names)
    assert float(str(at.metric[0].value).split()[0]) > 0  # KL(A ‖ B): the intervention changed the output


def test_bos_toggle_prepends_the_bos_token(model_cache, default_model, tmp_path):
    at = app_test(tmp_path)
    at.run()
    at.sidebar.toggle(key="bos").set_value(True).run()
    assert not at.exception and not at.error, texts(at.error)
    assert "BOS prepended" in texts(at.sidebar.caption)
    n = len(default_model.tokenizer(texts(at.sidebar.text_area))["input_ids"])
    assert arr(charts(at)[0]["data"][0]["customdata"]).shape == (n + 1, n + 1)
    on_page(at, "pages/sinks.py")
    assert not at.error and charts(at)


def test_compare_without_and_with_a_bos_token(model_cache, tmp_path):
    at = app_test(tmp_path)
    at.run()
    on_page(at, "pages/compare.py")
    at.radio(key="cmp_mode").set_value("without and with a BOS token first").run()
    assert not at.exception and not at.error, texts(at.error)
    names = [a["text"] for a in charts(at)[0]["layout"]["annotations"]]
    assert "A: fwd" in names and "B: fwd · BOS first" in names
    assert "one more token" in texts(at.caption)


def test_the_sidebar_patches_a_block_and_the_sink_goes(model_cache, default_model, tmp_path):
    """The sidebar's "patch a block": MLP 11's write at the sink token removed, the top layer's sink on the
    heatmap falls to the value a capture of the same recipe gives."""
    from attnviz.capture import capture
    from attnviz.recipe import Recipe

    at = app_test(tmp_path)
    at.run()
    before = charts(at)[0]
    at.sidebar.selectbox(key="iv_pick").set_value("patch a block").run()
    at.sidebar.text_input(key="iv_layers").input("11").run()
    assert not at.exception and not at.error, texts(at.error)
    spec = "patch(block=mlp, tokens=sink, value=zero)@11"
    assert f"intervention `{spec}`" in texts(at.sidebar.caption)
    after = charts(at)[0]
    sink_before = np.nanmean(arr(before["data"][0]["customdata"])[1:, 0])
    sink_after = np.nanmean(arr(after["data"][0]["customdata"])[1:, 0])
    cap = capture(default_model, at.session_state["text"], Recipe.of(default_model, "fwd", spec))
    expected = np.nanmean(cap.layer_probs(29).mean(0)[1:, 0])
    assert abs(sink_after - expected) < 2e-3 and sink_after < sink_before / 2


def test_the_sidebar_attention_kind_changes_the_maps_and_a_page_that_cannot_take_it_says_so(model_cache, tmp_path):
    """A what-if kind on the default model's weights (docs/methods.md#attention-kinds): the heatmap's rows no longer
    sum to 1 under softpick, the caption says so; head classes run the model's own kind and refuse another."""
    at = app_test(tmp_path)
    at.run()
    before = arr(charts(at)[0]["data"][0]["customdata"])
    at.sidebar.selectbox(key="kind").set_value("softpick").run()
    assert not at.exception and not at.error, texts(at.error)
    assert "kind `softpick`" in texts(at.sidebar.caption)
    after = arr(charts(at)[0]["data"][0]["customdata"])
    assert np.allclose(np.nansum(before, -1), 1.0, atol=2e-3)
    assert (np.nansum(after, -1)[1:] < 0.999).any() and not np.allclose(after, before, atol=1e-3, equal_nan=True)
    on_page(at, "pages/heads.py")
    assert not at.exception
    assert "head classes does not apply the attention kind softpick" in texts(at.error) or not charts(at)
