"""Gemma 3 270M, the second real model (gemma3_text: 18 layers, 4 heads, one key head, a 512-token sliding window in
five of every six layers, q/k norms, post-norms), against stock transformers with hand-written hooks: maps on a
text longer than its window, ``patch``, score attribution and the causal check; the Why page and "Test it"."""

import numpy as np
import pytest
import torch

from attnviz.capture import capture
from attnviz.core.loading import models
from attnviz.effects import causal
from attnviz.effects.explain import KeptForward
from attnviz.plan import Keep
from attnviz.recipe import Recipe

from conftest import ENGLISH

FULL = Keep(storage_dtype=torch.float32)
LONG = " ".join([ENGLISH] * 14)  # ~600 tokens: past the 512-token window of the sliding layers


@pytest.fixture(scope="module")
def stock(gemma3_model):
    """The same converted weights loaded by stock transformers, eager."""
    from transformers import AutoModelForCausalLM

    source = models.converted(models.SHIPPED["gemma3-270m"], lambda message: None)
    return AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def long_maps(gemma3_model):
    """The full maps of layers 0 (sliding), 5 (global) and 17 on ~600 tokens, once for the module."""
    lm = gemma3_model
    return capture(lm, LONG, Recipe.of(lm, "fwd"), Keep(layers=(0, 5, 17), storage_dtype=torch.float32))


def _ids(lm, text):
    return lm.tokenizer(text)["input_ids"]


def test_it_loads_offline_by_name(gemma3_model):
    lm = gemma3_model
    assert lm.model_id.startswith("Gemma 3 270M") and lm.model_file.endswith("gemma-3-270m-q4_k_m.gguf")
    assert (lm.n_layers, lm.n_heads, lm.n_kv_heads) == (18, 4, 1)
    assert "gemma3-270m" in models.shipped_installed()


def test_maps_past_the_window_equal_stock_eager(long_maps, stock):
    """On ~600 tokens, a sliding layer (0: keys more than 511 back are masked) and a global one (5) equal stock
    eager's ``output_attentions`` within 1e-4, masked cells included."""
    cap = long_maps
    n = cap.n_tokens
    assert n > 560
    with torch.no_grad():
        ref = stock(input_ids=torch.tensor([cap.token_ids]), output_attentions=True).attentions
    for layer in (0, 5, 17):
        np.testing.assert_allclose(cap.layer_probs(layer), ref[layer][0].numpy(), atol=1e-4, err_msg=f"layer {layer}")
    assert not cap.allowed[0][n - 1, 0] and cap.allowed[0][n - 1, n - 512] and cap.allowed[5][n - 1, 0]
    assert float(ref[0][0, :, n - 1, : n - 512].abs().max()) == 0.0  # stock's window, the same cells


def test_patch_equals_a_hook_on_its_post_norm(gemma3_model, stock):
    """Gemma 3 adds each block's write after its post-norm: patch(block=mlp, value=mean) at token 0 of layer 3
    equals a stock forward hook on ``post_feedforward_layernorm`` doing the same."""
    lm = gemma3_model
    text = ENGLISH
    ids = _ids(lm, text)

    def hook(module, args, out):
        t = out.clone()
        t[:, 0] = t[:, 1:].mean(1)
        return t

    handle = stock.model.layers[3].post_feedforward_layernorm.register_forward_hook(hook)
    try:
        with torch.no_grad():
            ref = stock(input_ids=torch.tensor([ids]), output_attentions=True)
    finally:
        handle.remove()
    cap = capture(lm, text, Recipe.of(lm, "fwd", "patch(block=mlp, tokens=0, value=mean)@3"), FULL)
    for layer in (3, 4, 12, 17):
        np.testing.assert_allclose(cap.layer_probs(layer), ref.attentions[layer][0].numpy(), atol=1e-4)
    np.testing.assert_allclose(cap.next_logprobs, torch.log_softmax(ref.logits[0, -1], -1).numpy(), atol=1e-4)


def test_score_attribution_sums_to_the_captured_score(gemma3_model):
    lm = gemma3_model
    cap = capture(lm, ENGLISH, "fwd", Keep(layers=(9, 17), scores=True, storage_dtype=torch.float32))
    run = KeptForward(lm, ENGLISH)
    for layer, head, i, j in ((17, 0, 30, 0), (9, 2, 12, 3)):
        e = run.explain(layer, head, i, j)
        assert e.score == pytest.approx(float(cap.layer_scores(layer)[head, i, j]), abs=1e-4)
        assert sum(e.key_sources.values()) == pytest.approx(e.score, abs=1e-4)
        assert sum(e.query_sources.values()) == pytest.approx(e.score, abs=1e-4)
        assert sum(e.by_pair) == pytest.approx(e.score, abs=1e-4) and len(e.by_pair) == 128  # head dim 256


def test_the_causal_check_patches_the_key_it_measures(gemma3_model):
    lm = gemma3_model
    [check] = causal.check(lm, ENGLISH, "fwd", ["mlp.2"])
    assert check.before.keys == check.after.keys == [0] * lm.n_layers
    assert check.patch == "patch(block=mlp, tokens=sink, value=zero)@2"
    assert len(check.before.attention) == lm.n_layers and check.before.perplexity > 1


def test_the_why_page_and_test_it_run_on_gemma3(gemma3_model, tmp_path):
    from test_app import app_test, charts, on_page, texts

    at = app_test(tmp_path)
    at.run()
    assert list(at.sidebar.selectbox(key="offline_model").options)[:2] == ["SmolLM2-135M-Instruct",
                                                                        "Gemma 3 270M (gemma3-270m)"]
    at.sidebar.selectbox(key="offline_model").set_value("gemma3-270m").run()  # the sidebar's list of offline models
    assert at.sidebar.text_input(key="model").value == "gemma3-270m"
    assert not at.exception and not at.error, texts(at.error)
    at.query_params.update({"layer": "17", "head": "0", "query": "all", "key": "0"})
    on_page(at, "pages/why.py")
    assert not at.exception and not at.error, texts(at.error)
    titles = [str(f["layout"].get("title", {}).get("text", "")) for f in charts(at)]
    assert any("layer 17 head 0, all" in t for t in titles)
    at.button(key="why_test").click().run()
    assert not at.exception and not at.error, texts(at.error)
    assert any("Attention on the sink key" in str(f["layout"]["title"]["text"]) for f in charts(at))


def test_statistics_past_the_window_equal_their_definitions_on_the_full_maps(gemma3_model, long_maps):
    """The statistics route (block by block, each block's rows of the allow-set) on ~600 tokens: alpha and the
    key-0 profile of a sliding layer and a global one equal their numpy definitions on the full maps."""
    from attnviz.stats import metrics

    lm = gemma3_model
    full = long_maps
    stats = capture(lm, LONG, "fwd", Keep(layers=(0, 5), statistics=True))
    for layer in (0, 5):
        probs, allowed = full.layer_probs(layer), full.allowed[layer]
        np.testing.assert_allclose(stats.stat(layer, "alpha"), metrics.alpha(probs, allowed), atol=1e-5, equal_nan=True)
        np.testing.assert_allclose(stats.stat(layer, "key0"), metrics.key_profile(probs, allowed, 0), atol=1e-5,
                                   equal_nan=True)
    assert np.isnan(stats.stat(0, "key0")[:, -1]).all() and np.isfinite(stats.stat(5, "key0")[:, -1]).all()
