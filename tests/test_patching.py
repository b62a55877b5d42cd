"""Activation patching between two texts (docs/methods.md#activation-patching) against stock transformers with
forward hooks written here by hand for each family: every site, every metric, four tiny families and the default
model, within 1e-4 in float32; a recipe's architecture applied to every run; bad input in one line."""

import json

import numpy as np
import pytest
import torch

import tiny
from attnviz.cli import main
from attnviz.effects.patching import patching
from attnviz.errors import InputError

CLEAN, CORRUPTED = "The cat sat on the mat and", "The dog sat on the hat and"

# per family: the layer list, and the modules whose output is each block's write / whose input is the heads' outputs
LAYOUT = {
    "llama": ("model.layers", "self_attn", "mlp", "self_attn.o_proj"),
    "qwen2": ("model.layers", "self_attn", "mlp", "self_attn.o_proj"),
    "gemma3_text": ("model.layers", "post_attention_layernorm", "post_feedforward_layernorm", "self_attn.o_proj"),
    "gpt_neox": ("gpt_neox.layers", "attention", "mlp", "attention.dense"),
}


def _get(module, path):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def stock_effect(model, kind, ids_c, ids_x, site, layer, index, answer, wrong, n_heads):
    """One cell written out: the clean activation read with a hook, put into the corrupted run with another."""
    layers_path, attn, mlp, o_proj = LAYOUT[kind]
    block = _get(model, layers_path)[layer]
    module = {"resid": block, "attn": _get(block, attn), "mlp": _get(block, mlp), "heads": _get(block, o_proj)}[site]
    pre = site in ("resid", "heads")
    kept = {}

    def read(m, args, *out):
        kept["x"] = (args[0] if pre else _first(out[0])).clone()

    def write(m, args, *out):
        value = (args[0] if pre else _first(out[0])).clone()
        if site == "heads":
            d = value.shape[-1] // n_heads
            value[:, :, index * d:(index + 1) * d] = kept["x"][:, :, index * d:(index + 1) * d]
        else:
            value[:, index] = kept["x"][:, index]
        if pre:
            return (value, *args[1:])
        return (value, *out[0][1:]) if isinstance(out[0], tuple) else value

    def metric(ids, hook=None):
        handle = None
        if hook is not None:
            handle = module.register_forward_pre_hook(hook) if pre else module.register_forward_hook(hook)
        try:
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        finally:
            if handle is not None:
                handle.remove()
        return float(logits[answer] - logits[wrong])

    clean = metric(ids_c, read)
    corrupted = metric(ids_x)
    return (metric(ids_x, write) - corrupted) / (clean - corrupted), clean, corrupted


@pytest.mark.parametrize("site", ["resid", "attn", "mlp", "heads"])
@pytest.mark.parametrize("kind", list(LAYOUT))
def test_every_cell_equals_stock_hooks(kind, site):
    lm, stock = tiny.loaded(kind), tiny.build(kind)
    ids_c, ids_x = lm.tokenizer(CLEAN)["input_ids"], lm.tokenizer(CORRUPTED)["input_ids"]
    answer, wrong = lm.tokenizer("P")["input_ids"][0], lm.tokenizer("R")["input_ids"][0]
    got = patching(lm, CLEAN, CORRUPTED, "P", "R", site=site)
    rows = range(lm.n_heads) if site == "heads" else range(len(ids_c))
    assert got.effect.shape == (lm.n_layers, len(rows))
    for layer in range(lm.n_layers):
        for index in rows:
            expected, clean, corrupted = stock_effect(stock, kind, ids_c, ids_x, site, layer, index, answer, wrong,
                                                      lm.n_heads)
            assert got.effect[layer, index] == pytest.approx(expected, abs=1e-4), (layer, index)
    assert got.clean == pytest.approx(clean, abs=1e-4) and got.corrupted == pytest.approx(corrupted, abs=1e-4)


def test_the_first_layer_s_stream_at_the_changed_tokens_restores_the_clean_run():
    """resid at layer 0 is the embedding: patching every changed position together is the clean run, and a position
    where the texts agree changes nothing."""
    lm = tiny.loaded("llama")
    got = patching(lm, CLEAN, CORRUPTED, "P", "R", site="resid")
    same = [i for i, (a, b) in enumerate(zip(CLEAN, CORRUPTED)) if a == b]
    np.testing.assert_allclose(got.effect[0, same], 0, atol=1e-5)  # a batch rounds apart from one text by 1e-6
    kl = patching(lm, CLEAN, CORRUPTED, site="resid", metric="kl")
    assert kl.clean == 0 and kl.corrupted > 0
    np.testing.assert_allclose(kl.effect[0, same], 0, atol=2e-3)  # a small KL: the batch's rounding, relative


@pytest.mark.parametrize("site", ["resid", "attn", "mlp", "heads"])
def test_the_default_model_equals_stock_hooks(default_model, site):
    """The real model, a sample of cells of every site (every layer's would take minutes of stock forwards)."""
    import copy

    stock = copy.deepcopy(default_model.model)
    stock.set_attn_implementation("eager")  # transformers' own eager attention, no attnviz run around it
    clean, corrupted = "The capital of France is Paris. The capital of France is", \
        "The capital of Italy is Rome. The capital of France is"
    got = patching(default_model, clean, corrupted, " Paris", " Rome", site=site)
    tok = default_model.tokenizer
    ids_c, ids_x = tok(clean)["input_ids"], tok(corrupted)["input_ids"]
    answer, wrong = tok(" Paris", add_special_tokens=False)["input_ids"][0], tok(" Rome", add_special_tokens=False)[
        "input_ids"][0]
    cells = [(0, 3), (9, 3), (17, 5), (29, 8), (14, 2)] if site == "heads" else \
        [(0, 3), (9, 3), (17, 5), (29, len(ids_c) - 1), (14, 6)]
    for layer, index in cells:
        expected, _, _ = stock_effect(stock, "llama", ids_c, ids_x, site, layer, index, answer, wrong,
                                      default_model.n_heads)
        assert got.effect[layer, index] == pytest.approx(expected, abs=1e-4), (layer, index)


def test_the_recipe_applies_to_every_run():
    """Under NoSink-FWD the stock model's own mask is not the run's: the effects differ from FWD's, and the sink
    metric reads each layer's sink key (key 1 there)."""
    lm = tiny.loaded("llama")
    fwd = patching(lm, CLEAN, CORRUPTED, "P", "R", site="resid")
    nosink = patching(lm, CLEAN, CORRUPTED, "P", "R", site="resid", recipe="nosink-fwd")
    assert not np.allclose(fwd.effect, nosink.effect) and nosink.recipe["arch"] == "nosink-fwd"
    sink = patching(lm, CLEAN, CORRUPTED, site="heads", metric="sink", recipe="nosink-fwd")
    assert sink.effect.shape == (lm.n_layers, lm.n_heads) and np.isfinite(sink.effect).all()


def test_the_sink_metric_resumed_equals_the_full_forward(monkeypatch):
    from attnviz.core.model import anatomy

    lm = tiny.loaded("qwen2")
    resumed = patching(lm, CLEAN, CORRUPTED, site="mlp", metric="sink")
    found = anatomy.of(lm.model)
    monkeypatch.setattr(anatomy, "of", lambda model: __import__("dataclasses").replace(found, resumable=False, why_not_resumable="no"))
    full = patching(lm, CLEAN, CORRUPTED, site="mlp", metric="sink")
    np.testing.assert_allclose(resumed.effect, full.effect, atol=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["--clean", "The cat", "--corrupted", "The cats", "--answer", "P", "--wrong", "R"], "the same number of tokens"),
    (["--clean", "The cat", "--corrupted", "The dog", "--answer", "PQ", "--wrong", "R"], "is 2 tokens"),
    (["--clean", "The cat", "--corrupted", "The dog", "--answer", "P", "--wrong", "R", "--site", "neurons"],
     "unknown site 'neurons'"),
    (["--clean", "The cat", "--corrupted", "The dog"], "needs --answer and --wrong"),
    (["--clean", "The cat", "--corrupted", "The cat", "--answer", "P", "--wrong", "R"], "nothing for a patch"),
])
def test_bad_input_is_refused_in_one_line(argv, message, capsys, monkeypatch):
    from attnviz.cli import common

    monkeypatch.setattr(common, "load", lambda args: tiny.loaded("llama"))
    assert main(["patching"] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_json_contract(capsys, monkeypatch):
    from attnviz.cli import common

    monkeypatch.setattr(common, "load", lambda args: tiny.loaded("llama"))
    assert main(["patching", "--clean", CLEAN, "--corrupted", CORRUPTED, "--answer", "P", "--wrong", "R",
                 "--site", "heads", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"site", "metric", "clean", "corrupted", "layers", "positions", "effect"} <= set(doc)
    assert doc["site"] == "heads" and len(doc["effect"]) == 3 and len(doc["effect"][0]) == doc["heads"][-1] + 1


def test_refusals_in_the_library():
    lm = tiny.loaded("llama")
    with pytest.raises(InputError, match="unknown metric"):
        patching(lm, CLEAN, CORRUPTED, site="resid", metric="accuracy")
    with pytest.raises(InputError, match="takes a loaded model"):
        patching("default", CLEAN, CORRUPTED, "P", "R")


def test_the_patching_page_draws_the_librarys_grid(default_model, tmp_path):
    from test_app import app_test, charts, on_page, texts

    at = app_test(tmp_path)
    at.run()
    on_page(at, "pages/patching.py")
    assert not at.exception and not at.error, texts(at.error)
    at.selectbox(key="pt_site").set_value("heads").run()
    at.button(key="pt_run").click().run()
    assert not at.exception and not at.error, texts(at.error)
    grid = next(c for c in charts(at) if "activation patching of heads" in c["layout"]["title"]["text"])
    expected = patching(default_model, at.text_input(key="pt_clean").value, at.text_input(key="pt_corrupted").value,
                        " Paris", " Rome", "heads")
    from test_app import arr

    np.testing.assert_allclose(arr(grid["data"][0]["z"]), expected.effect, atol=1e-5)
    at.text_input(key="pt_corrupted").input("The capital of Italy is").run()
    at.button(key="pt_run").click().run()
    assert any("the same number of tokens" in e.value for e in at.error)
