"""Sinks at any key (docs/methods.md#sinks-at-any-key): against hand-written expectations, stock eager attention,
both capture routes, Gemma 3 270M moving its sink to the first "." under NoSink-FWD, the CLI and both pages."""

import json

import numpy as np
import pytest
import torch

import tiny
from attnviz.capture import capture
from attnviz.cli import main
from attnviz.effects import compare
from attnviz.plan import Keep
from attnviz.stats import metrics

LIGHTHOUSE = ("The old lighthouse keeper climbed the stairs every evening. He lit the lamp, wound the clock, and "
              "wrote the weather in his book.")


def test_sinks_of_a_hand_written_layer():
    tokens = ["<s>", "The", ".", "cat", "sat", ",", "on", "it"]
    alphas = np.full((3, 8), 0.05)
    alphas[0, 0], alphas[1, 0] = 0.9, 0.35  # key 0: heads 0 and 1
    alphas[2, 2] = 0.6  # key 2 ("."): head 2
    alphas[1, 3] = 0.31  # key 3 ("cat"): head 1
    alphas[0, 5] = 0.99  # key 5 is past the first half (8 tokens: keys 0..3): never a candidate
    alphas[2, 1] = np.nan  # undefined alpha is no sink
    found = metrics.sinks(alphas, tokens, 0.3, residual_norms=np.arange(8.0), value_norms=np.ones((3, 8)))
    assert [s["key"] for s in found] == [0, 2, 3]  # strongest first: 1.25, 0.6, 0.31 summed over heads
    assert found[0] == {"key": 0, "token": "<s>", "category": "first", "heads": [0, 1], "share": 0.625,
                        "residual_norm": 0.0, "value_norm": 1.0}
    assert found[1]["category"] == "delimiter" and found[1]["heads"] == [2] and found[1]["residual_norm"] == 2.0
    assert found[2]["category"] == "other" and found[2]["share"] == 0.31
    assert metrics.sinks(alphas, tokens, 0.95) == []
    assert metrics.sink_candidates(8) == 4 and metrics.sink_candidates(9) == 5 and metrics.sink_candidates(1) == 1


@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "gpt_neox"])
def test_sinks_equal_a_direct_computation_from_stock_eager(kind):
    lm = tiny.loaded(kind)
    text = "The cat sat. On the mat, it slept; the dog watched the door."
    cap = capture(lm, text, "fwd", Keep(statistics=True, activations=True, value_norms=True))
    stock = tiny.build(kind)
    with torch.no_grad():
        out = stock(torch.tensor([cap.token_ids]), output_attentions=True, output_hidden_states=True)
    eps = 0.2
    for layer in range(lm.n_layers):
        probs = out.attentions[layer][0].double().numpy()
        allowed = probs > 0
        counts = allowed.sum(-2)  # (H, n): the queries that see each key
        others = counts - np.diagonal(allowed, axis1=-2, axis2=-1)
        alphas = np.where(others > 0, probs.sum(-2) / np.maximum(counts, 1), np.nan)  # alpha written out
        expected = [k for k in range(metrics.sink_candidates(cap.n_tokens))
                    if (np.nan_to_num(alphas[:, k], nan=0) > eps).any()]
        found = cap.sinks(layer, eps)
        assert sorted(s["key"] for s in found) == expected, f"layer {layer}"
        for s in found:
            assert s["heads"] == [h for h in range(lm.n_heads) if np.nan_to_num(alphas[h, s["key"]]) > eps]
            assert s["share"] == pytest.approx(alphas[s["heads"], s["key"]].mean(), abs=1e-5)
            norm = float(out.hidden_states[layer][0, s["key"]].norm())
            assert s["residual_norm"] == pytest.approx(norm, rel=1e-4)


def test_the_statistics_route_finds_the_sinks_the_full_maps_do():
    lm = tiny.loaded("qwen2")
    text = "The keeper lit the lamp. The ships passed, and the keeper slept."
    full = capture(lm, text, "nosink-fwd", Keep(storage_dtype=torch.float32))
    stats = capture(lm, text, "nosink-fwd", Keep(statistics=("alpha",)))
    for layer in range(lm.n_layers):
        a, b = full.sinks(layer, 0.15), stats.sinks(layer, 0.15)
        assert [(s["key"], s["heads"]) for s in a] == [(s["key"], s["heads"]) for s in b]
        for x, y in zip(a, b):
            assert x["share"] == pytest.approx(y["share"], abs=1e-5)


def test_gemma3_moves_its_sink_to_the_first_full_stop(gemma3_model):
    """Under NoSink-FWD Gemma 3 270M does not send the attention to key 1: key 10, the first ".", is a sink in the
    layers where its alpha passes 0.3."""
    cap = capture(gemma3_model, LIGHTHOUSE, "nosink-fwd", Keep(statistics=("alpha",)))
    assert cap.tokens[10] == "."
    layers = [l for l in cap.layers if any(s["key"] == 10 for s in cap.sinks(l))]
    assert {1, 6, 9, 12, 13, 14, 15, 16} <= set(layers)
    strongest = compare.where_sinks_are(cap)
    assert all(s is None or s["key"] == 10 for s in strongest)
    peak = max(max(cap.stat(l, "alpha")[:, 10]) for l in cap.layers)
    assert 0.7 < peak < 0.85  # up to 0.78 in one head of layer 14
    assert "the first '.' (key 10) in layers 1, 6" in compare.describe_sinks(cap)
    fwd = capture(gemma3_model, LIGHTHOUSE, "fwd", Keep(statistics=("alpha",)))
    assert compare.describe_sinks(fwd).startswith("the first token (key 0)")


def test_the_sinks_json_lists_every_sink_key(gemma3_model, capsys):
    assert main(["sinks", "--model", "gemma3-270m", "--arch", "nosink-fwd", "--text", LIGHTHOUSE, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    by_layer = {l["layer"]: l["sinks"] for l in doc["layers"]}
    first = by_layer[14][0]
    assert set(first) == {"key", "token", "category", "heads", "share", "residual_norm", "value_norm"}
    assert first["key"] == 10 and first["token"] == "." and first["category"] == "delimiter" and len(first["heads"]) == 4
    assert first["residual_norm"] > 1000 and first["value_norm"] > 0
    assert by_layer[0] == [] and all(by_layer[l] for l in (1, 6, 9, 12, 13, 14, 15, 16))


def test_where_the_sinks_are_says_it_shows_the_first_half_of_the_keys():
    """48 tokens: the map shows keys 0..23, the keys that may be sinks, and its title and key axis say so."""
    from attnviz.figures import sink_map

    cap = capture(tiny.loaded("llama"), "x" * 48, "fwd")  # one token a character
    assert cap.n_tokens == 48
    fig = sink_map(cap)
    assert len(fig.data[0].x) == 24
    assert "keys 0–23 of 48" in fig.layout.title.text and "first half" in fig.layout.title.text
    assert "keys 0–23 of 48" in fig.layout.xaxis.title.text
    assert "key 0 of 2" in sink_map(capture(tiny.loaded("llama"), "xy", "fwd")).layout.title.text
    assert "every key" in sink_map(capture(tiny.loaded("llama"), "x", "fwd")).layout.title.text


def test_the_pages_show_where_the_sinks_are_and_where_they_went(model_cache, tmp_path):
    from test_app import app_test, charts, on_page, texts

    at = app_test(tmp_path)
    at.run()
    on_page(at, "pages/sinks.py")
    assert not at.exception and not at.error, texts(at.error)
    where = next(c for c in charts(at) if "where the sinks are" in c["layout"]["title"]["text"])
    rings = {t["name"]: t for t in where["data"] if t.get("type") == "scatter"}
    assert set(rings) == {"first-token sink", "secondary sink"} and rings["first-token sink"]["x"]
    assert any("Sinks (alpha > 0.3" in c.value and "the first token (key 0)" in c.value for c in at.caption)
    on_page(at, "pages/shifting.py")
    assert not at.exception and not at.error, texts(at.error)
    went = next(c for c in charts(at) if "where the sink went" in c["layout"]["title"]["text"])
    assert [t["name"] for t in went["data"]][:2] == ["fwd", "nosink-fwd"]
    ys = went["data"][0]["y"]
    assert ys.count(0) > len(ys) / 2  # FWD: the first token in most layers (SmolLM2 has a secondary sink or two)
    assert any("**nosink-fwd**" in m.value for m in at.markdown)


def test_the_cli_reads_residual_norms_without_keeping_a_hidden_state():
    """``attnviz sinks`` measures the stream's norm entering each layer with a hook (n floats a layer), the same
    numbers a capture's activations give, and no hidden state is kept."""
    from attnviz.cli import sinks_report
    from attnviz.core.engine.hooks import layer_input_norms

    lm = tiny.loaded("gemma3_text")
    text = "The cat sat. On the mat, it slept; the dog watched the door."
    with layer_input_norms(lm.model) as norms:
        light = capture(lm, text, "fwd", Keep(statistics=("alpha",), value_norms=True))
    full = capture(lm, text, "fwd", Keep(statistics=("alpha",), value_norms=True, activations=True))
    assert light.activations is None and light.hidden is None and sorted(norms) == list(range(lm.n_layers))
    for layer in range(lm.n_layers):
        np.testing.assert_allclose(norms[layer], full.activations.norms[layer], rtol=1e-5)
    doc = sinks_report(light, 0.2, norms)
    assert doc["layers"] and all(s["residual_norm"] is not None for l in doc["layers"] for s in l["sinks"])
    assert [l["sinks"] for l in doc["layers"]] == [full.sinks(l, 0.2) for l in range(lm.n_layers)]
