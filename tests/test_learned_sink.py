"""The learned sink as a key (docs/methods.md#the-learned-sink-as-a-key): on a tiny gpt-oss whose layer-0 head 0 sends
about half of every row to its learned sink, the share a capture keeps equals stock eager's own softmax column before
it is dropped, it is a sink of category "learned", `attnviz sinks --json` carries it, a model without one gives the same
document as before, and the Heatmaps and Attention sinks pages draw its column."""

import contextlib
import io
import json
import os
import shutil

import numpy as np
import pytest
import torch
from transformers.models.gpt_oss import modeling_gpt_oss

import tiny
from attnviz.capture import capture
from attnviz.captured import Capture
from attnviz.cli import main, sinks_report
from attnviz.core.record import recorders
from attnviz.plan import Keep
from attnviz.stats import metrics

TEXT = "The keeper lit the lamp. The ships passed, and the keeper slept."
SINKS = (1.5, -30.0, -30.0, -30.0)  # layer 0: head 0's learned sink takes about half of each row, the others none


def sunk(model):
    """Layer 0's learned sink logits set to :data:`SINKS` (the other layers keep tiny.py's random ones)."""
    with torch.no_grad():
        model.model.layers[0].self_attn.sinks.copy_(torch.tensor(SINKS))
    return model


def loaded():
    lm = tiny.loaded("gpt_oss")
    sunk(lm.model)
    return lm


def stock_columns(ids: list[int]) -> list[np.ndarray]:
    """Per layer, (H, n) the learned sink's column of stock eager's softmax, taken before stock drops it: the
    softmax in transformers' gpt-oss eager attention is watched (its last column is the sink's)."""
    model, seen, real = sunk(tiny.build("gpt_oss")), [], modeling_gpt_oss.F

    class Watched:
        def __getattr__(self, name):
            return getattr(real, name)

        def softmax(self, logits, *args, **kwargs):
            probs = real.softmax(logits, *args, **kwargs)
            seen.append(probs[0, :, :, -1].detach().numpy().copy())
            return probs

    modeling_gpt_oss.F = Watched()
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        modeling_gpt_oss.F = real
    assert len(seen) == model.config.num_hidden_layers
    return seen


@pytest.fixture(scope="module")
def captures():
    lm = loaded()
    return {"full maps": capture(lm, TEXT, "fwd", Keep(storage_dtype=torch.float32)),
            "fp16 maps": capture(lm, TEXT, "fwd", Keep()),
            "statistics": capture(lm, TEXT, "fwd", Keep(statistics=True))}


def test_the_share_equals_stock_eager_s_sink_column(captures, tmp_path):
    """Full maps (float32 and float16) and statistics alike keep each row's share from the logits: stock's own
    column within 1e-6 in float32, not 1 − the row's sum of the stored weights (off by float16's rounding)."""
    expected = stock_columns(captures["full maps"].token_ids)
    assert expected[0][0].mean() == pytest.approx(0.5, abs=0.1) and expected[0][1:].max() < 1e-9
    for name, cap in captures.items():
        assert sorted(cap.learned_sink) == cap.layers, name
        for layer in cap.layers:
            share = cap.learned_sink[layer]
            assert share.dtype == np.float32 and share.shape == (cap.n_heads, cap.n_tokens)
            assert np.abs(share - expected[layer]).max() < 1e-6, (name, layer)
    rounded = 1.0 - captures["fp16 maps"].layer_probs(0).sum(-1)  # what the stored weights would say
    assert np.abs(rounded - expected[0]).max() > 1e-5
    loaded_back = Capture.load(captures["statistics"].save(tmp_path / "sink.npz"))
    for layer in loaded_back.layers:
        np.testing.assert_array_equal(loaded_back.learned_sink[layer], captures["statistics"].learned_sink[layer])


def test_the_learned_sink_is_a_sink_of_category_learned(captures):
    expected = stock_columns(captures["statistics"].token_ids)[0].mean(-1)  # alpha: the mean over the queries
    for name, cap in captures.items():
        np.testing.assert_allclose(cap.learned_alpha(0), expected, atol=1e-6)
        learned = [s for s in cap.sinks(0, 0.3) if s["category"] == "learned"]
        assert learned == [{"key": metrics.LEARNED_KEY, "token": metrics.LEARNED_TOKEN, "category": "learned",
                            "heads": [0], "share": round(float(expected[0]), 6), "residual_norm": None,
                            "value_norm": None}], name
        assert not [s for s in cap.sinks(0, 0.9) if s["category"] == "learned"]
    # by hand: the learned sink among the keys, strongest first, value norm 0 where value norms are given
    alphas = np.full((2, 4), 0.1)
    alphas[1, 0] = 0.4
    found = metrics.sinks(alphas, ["a", "b", "c", "d"], 0.3, value_norms=np.ones((2, 4)), learned=[0.7, 0.2])
    assert [(s["key"], s["category"], s["heads"], s["value_norm"]) for s in found] == [(-1, "learned", [0], 0.0),
                                                                                   (0, "first", [1], 1.0)]
    assert metrics.sinks(alphas, ["a", "b", "c", "d"], 0.3) == metrics.sinks(alphas, ["a", "b", "c", "d"], 0.3,
                                                                             learned=None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    where = tmp_path_factory.mktemp("tiny-gpt-oss")
    sunk(tiny.build("gpt_oss")).save_pretrained(where)
    tiny.char_tokenizer().save_pretrained(where)
    return where


def sinks_json(model: str) -> tuple[str, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["sinks", "--model", model, "--text", TEXT, "--json"]) == 0
    return out.getvalue(), json.loads(out.getvalue())


def test_the_sinks_json_carries_the_learned_sink(model_cache, model_dir):
    text, doc = sinks_json(str(model_dir))
    assert "NaN" not in text
    ids = tiny.char_tokenizer()(TEXT)["input_ids"]  # the saved model's tokenizer
    assert len(ids) == doc["n_tokens"]
    expected = stock_columns(ids)
    for layer in doc["layers"]:
        alphas = expected[layer["layer"]].mean(-1)
        assert [h["learned_sink"] for h in layer["heads"]] == pytest.approx(alphas.tolist(), abs=1e-6)
        assert layer["learned_sink_rate"] == pytest.approx(metrics.sink_rate(alphas, 0.3))
        assert all(list(h)[:4] == ["head", "kv_group", "sink_key", "alpha"] for h in layer["heads"])
    first = doc["layers"][0]
    assert first["learned_sink_rate"] == 0.25
    assert next(s for s in first["sinks"] if s["key"] == -1)["heads"] == [0]


def test_a_model_without_one_gives_the_same_json_as_before(monkeypatch):
    """No learned sink (Llama): the capture keeps no share and the document is the one made without this feature
    at all (no recorder of the share, no learned alpha), byte for byte."""
    lm = tiny.loaded("llama")

    def document():
        cap = capture(lm, TEXT, "fwd", Keep(statistics=("alpha", "column_mean", "discarded"), value_norms=True))
        return json.dumps(sinks_report(cap, 0.3), allow_nan=False), cap

    now, cap = document()
    assert cap.learned_sink == {} and "learned" not in now
    made = recorders.made
    monkeypatch.setattr(recorders, "made", lambda *a, **k: tuple(r for r in made(*a, **k)
                                                                   if not isinstance(r, recorders.LearnedSink)))
    monkeypatch.setattr(Capture, "learned_alpha", lambda self, layer: None)
    before, _ = document()
    assert now == before


def test_the_pages_draw_the_sink_column(model_cache, model_dir, tmp_path):
    from test_app import app_test, charts, on_page, texts

    at = app_test(tmp_path, instant=True)  # the viewer draws keys only: a learned sink takes the server's map
    at.session_state["model"] = str(model_dir)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    on_page(at, "pages/heatmaps.py")
    assert not at.error, texts(at.error)
    heatmap = charts(at)[0]
    sink = next(t for t in heatmap["data"] if t.get("name") == "learned sink")
    labels = heatmap["layout"]["xaxis"].get("ticktext") or [a["text"] for a in heatmap["layout"]["annotations"]]
    assert sink["x0"] == -1 and labels[0] == "sink"  # a tick label, or a label above the column past 64 tokens
    assert any('"sink"' in c.value for c in at.caption)
    on_page(at, "pages/sinks.py")
    assert not at.error, texts(at.error)
    where = next(c for c in charts(at) if "where the sinks are" in c["layout"]["title"]["text"])
    assert where["data"][0]["x"][0] == "sink"
    ring = next(t for t in where["data"] if t.get("name") == "learned sink")
    assert ring["x"] and set(ring["x"]) == {"sink"} and 0 in ring["y"]
    assert any("alpha of the learned sink" in c["layout"]["title"]["text"] for c in charts(at))
    at.radio(key="sk_view").set_value("a dataset").run()  # the dataset mode says it too
    at.number_input(key="sk_maxlen").set_value(16).run()
    at.number_input(key="sk_samples").set_value(3).run()
    at.button(key="sk_ds_run").click().run()
    assert not at.exception and not at.error, texts(at.error)
    assert any("learned sink" in c.value and "layer 0: 25%" in c.value for c in at.caption)


@pytest.mark.browser
@pytest.mark.skipif(not shutil.which("chromium") and not os.environ.get("ATTNVIZ_REQUIRE_BROWSER"),
                    reason="needs chromium (bash scripts/setup.sh dev)")
def test_chromium_draws_the_sink_column_left_of_key_0(captures, tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from appserver import browser_page

    from attnviz.figures import heatmap

    page_file = tmp_path / "map.html"
    heatmap(captures["full maps"], 0, 0).write_html(page_file, include_plotlyjs=True)
    with browser_page() as page:
        page.goto(page_file.as_uri())
        page.wait_for_selector(".xtick text", timeout=60_000)
        ticks = page.eval_on_selector_all(".xtick text", "els => els.map(e => [e.textContent, "
                                                         "e.getBoundingClientRect().x])")
        drawn = page.eval_on_selector_all(".heatmaplayer .hm", "els => els.length")
    assert ticks[0][0] == "sink" and ticks[0][1] < min(x for _, x in ticks[1:])
    assert drawn == 2  # the keys' map and the sink's column


def test_the_dataset_mode_reports_the_learned_sink():
    """Sinks over many samples: each sample's learned-sink alpha per layer and head equals stock eager's dropped
    column (the mean over the rows), and each layer's learned_sink_rate is the share of heads above eps; a model
    without one gives no such field."""
    from attnviz.effects import dataset

    documents = [TEXT, "A second document about the sea and the light on the rocks, written to be long enough."]
    lm = loaded()
    found = dataset.sinks(lm, documents, "fwd", max_len=24, n_samples=None)
    ids, _ = dataset.samples(lm, documents, "doc", 24, None)
    for i, sample in enumerate(ids):
        expected = np.stack([column.mean(-1) for column in stock_columns(sample)])  # (L, H)
        np.testing.assert_allclose(found.learned[i], expected, atol=1e-6)
    doc = found.as_json()
    rates = [layer["learned_sink_rate"]["mean"] for layer in doc["layers"]]
    assert rates[0] == pytest.approx(0.25)  # head 0 of 4 in layer 0
    assert rates == pytest.approx(np.mean(found.learned > 0.3, axis=-1).mean(0).tolist(), abs=1e-6)
    plain = dataset.sinks(tiny.loaded("llama"), documents, "fwd", max_len=24, n_samples=None)
    assert plain.learned is None and "learned" not in json.dumps(plain.as_json())
