"""Head taxonomy (docs/methods.md#head-classes) on hand-made matrices, and its two claims on a tiny model."""

import json

import numpy as np
import pytest

from attnviz.effects import heads
from attnviz.errors import InputError

from tiny import loaded


def test_streaming_score_on_a_hand_made_matrix():
    n, s, w = 8, 1, 2
    probs = np.zeros((2, n, n))
    for i in range(n):
        probs[0, i, 0] = 0.5  # head 0: half on the sink, half on its own key: all inside the pattern
        probs[0, i, i] += 0.5
        probs[1, i, : i + 1] = 1.0 / (i + 1)  # head 1: uniform over its prefix
    score = heads.streaming_score(probs, s, w)
    assert score[0] == pytest.approx(1.0)
    expected = np.mean([(1 + min(w, i)) / (i + 1) for i in range(s + w, n)])  # key 0 plus keys i-1, i
    assert score[1] == pytest.approx(expected)
    assert np.isnan(heads.streaming_score(probs[:, :3, :3], s, w)).all()  # no query past s + w


def test_output_norms_and_ahon_on_hand_made_values():
    probs = np.array([[[1.0, 0.0], [0.5, 0.5]], [[1.0, 0.0], [0.0, 1.0]]])  # 2 heads, 2 tokens
    values = np.array([[[3.0, 0.0], [0.0, 4.0]]])  # 1 KV head shared by both, d = 2
    w_o = np.eye(4)  # hidden 4 = 2 heads x d 2: W_O^h is the identity on its slice
    norms = heads.output_norms(probs, values, w_o)
    np.testing.assert_allclose(norms, [(3.0 + np.hypot(1.5, 2.0)) / 2, (3.0 + 4.0) / 2])
    np.testing.assert_allclose(heads.ahon(norms), norms / norms.mean())


def test_taxonomy_classes_and_json():
    tax = heads.Taxonomy("m", "fwd", 1, alpha0=np.array([[0.9, 0.1, 0.5]]),
                         streaming_score=np.array([[0.95, np.nan, 0.2]]), ahon=np.array([[1.4, 1.5, 0.1]]))
    assert tax.classes().tolist() == [["streaming", "retrieval", "inactive"]]
    doc = tax.as_json()
    head = doc["layers"][0]["heads"][1]
    assert head == {"head": 1, "alpha0": 0.1, "sink": False, "streaming_score": None, "streaming": False,
                    "ahon": 1.5, "inactive": False}
    assert heads.ablation_spec(tax) == "ablate(heads=2)@0"
    assert tax.with_thresholds(tau_inactive=0.05).inactive.sum() == 0


TEXT = "The keeper climbed the stairs, lit the lamp, and watched the ships pass the rocks all night long. " * 2


def test_taxonomy_of_a_model_and_both_claims():
    lm = loaded("llama")
    tax = heads.taxonomy(lm, [TEXT], s=2, w=8)
    assert tax.alpha0.shape == tax.streaming_score.shape == tax.ahon.shape == (3, 4)
    np.testing.assert_allclose(tax.ahon.mean(1), 1.0)  # normalised by each layer's mean
    forced = tax.with_thresholds(tau_stream=0.0)  # every head streaming: the whole model on sink + window
    dense, windowed = heads.streaming_only_perplexity(lm, TEXT, forced)
    assert dense.perplexity != pytest.approx(windowed.perplexity)
    none = tax.with_thresholds(tau_stream=2.0)  # no streaming head: the same as dense
    d2, w2 = heads.streaming_only_perplexity(lm, TEXT, none)
    assert w2.nll == pytest.approx(d2.nll, abs=1e-6)
    base, ablated, share = heads.ablate_inactive(lm, TEXT, tax.with_thresholds(tau_inactive=1.0))
    assert 0 < share < 1 and ablated.perplexity != pytest.approx(base.perplexity)


def test_too_small_a_dataset_is_refused():
    lm = loaded("llama")
    with pytest.raises(InputError, match="too small"):
        heads.dataset_texts(lm, ["short", "also short"], 10, 64)
    with pytest.raises(InputError, match="needs queries past s \\+ w"):
        heads.taxonomy(lm, ["a short text"], s=4, w=64)


def test_cli_heads(default_model):
    from test_cli import run

    from conftest import ENGLISH

    out = run("heads", "--text", ENGLISH, "--window", "16", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert len(doc["layers"]) == 30 and len(doc["layers"][0]["heads"]) == 9
    assert set(doc["layers"][0]["heads"][0]) == {"head", "alpha0", "sink", "streaming_score", "streaming", "ahon",
                                                  "inactive"}
    repeated = doc["repeated"]  # the induction, previous-token, duplicate and dormant heads beside them
    assert repeated["length"] == 32 and len(repeated["layers"]) == 30
    found = {(layer["layer"], h["head"]) for layer in repeated["layers"] for h in layer["heads"] if h["induction_head"]}
    assert (18, 6) in found and all(17 <= layer <= 23 for layer, _ in found)
    assert sum(h["sink"] for layer in doc["layers"] for h in layer["heads"]) > 100  # SmolLM2's sinks
    bad = run("heads", "--corpus", "stdlib:specialnames", "--samples", "5", "--max-len", "64")
    assert bad.returncode == 2 and "too small" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_heads_page_grid_and_both_claims(model_cache, default_model, tmp_path):
    from test_app import app_test, charts, on_page, texts

    at = app_test(tmp_path)
    at.run()
    on_page(at, "pages/heads.py")
    at.number_input(key="hd_tokens").set_value(96).run()
    at.number_input(key="hd_w").set_value(16).run()
    assert not at.exception and not at.error, texts(at.error)
    grid = charts(at)[0]
    assert "head taxonomy" in str(grid["layout"]["title"]) and len(grid["data"][0]["text"]) == 30
    assert [m.label for m in at.metric] == ["sink heads", "streaming heads", "inactive heads", "induction heads",
                                            "prev-token heads", "duplicate heads", "dormant heads"]
    for metric, name in zip(at.metric[:3], ("sink", "streaming", "inactive")):  # each number is its legend entry's
        assert [t for t in grid["data"] if t.get("name", "").startswith(f"{name}: {metric.value}")], metric.value
    # the repeated random tokens' section: SmolLM2's seven induction heads (docs/methods.md), then another score
    assert at.metric[3].value == "7" and "induction score on repeated random tokens" in str(charts(at)[1]["layout"])
    assert any("18.6 (0.81)" in c.value for c in at.caption)
    at.selectbox(key="hd_rep_score").set_value("prev_token").run()
    assert not at.exception and "prev_token score" in str(charts(at)[1]["layout"]["title"])
    at.slider(key="hd_rep_tau").set_value(0.9).run()  # a threshold re-classifies without a new forward
    assert not at.exception and at.metric[3].value == "0"
    at.button(key="hd_claim_stream").click().run()
    assert not at.exception and not at.error, texts(at.error)
    assert any("streaming heads on sink" in m.label for m in at.metric)
    at.button(key="hd_claim_ablate").click().run()
    assert not at.exception and not at.error, texts(at.error)
    assert any("of heads zeroed" in m.label for m in at.metric)
    inactive = at.metric[2].value
    at.slider(key="hd_tau_inactive").set_value(0.9).run()  # thresholds re-classify without a new forward
    assert not at.exception and at.metric[2].value != inactive


def test_a_text_too_long_to_score_is_refused_with_what_fits(monkeypatch):
    lm = loaded("llama")
    monkeypatch.setattr(heads, "MAX_BYTES", 4 * 4 * 3 * 150 ** 2)  # the fp32 maps of 150 tokens
    assert heads.max_tokens(lm) == 150
    with pytest.raises(InputError, match="this view captures at most 150"):
        heads.taxonomy(lm, ["x" * 160], s=2, w=8)
    assert heads.taxonomy(lm, ["x" * 150], s=2, w=8).samples == 1
