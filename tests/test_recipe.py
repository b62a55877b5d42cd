"""The recipe (attnviz.recipe): one value for what a forward computes, carried by every capture, with a
stable key, a one-line description and a dict round trip; every entry point takes it."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from attnviz.figures import export
from attnviz import regions
from attnviz.core import engine
from attnviz.capture import Capture, capture
from attnviz.errors import InputError
from attnviz.effects.evaluate import evaluate
from attnviz.recipe import Recipe, build

from tiny import loaded

TEXT = "The keeper lit the lamp and watched the ships pass the rocks."


def test_of_is_canonical_and_the_key_is_stable():
    lm = loaded("llama")
    a = Recipe.of(lm, "NOSINK-FWD( m=1 )", " SinkScale(beta=.5)@1-2 ", "bos")  # the recipe itself needs no BOS token
    b = Recipe.of(lm, "nosink-fwd", "sinkscale(key=0, beta=0.5)@1-2", "bos")
    assert a == b and a.key == b.key and len(a.key) == 16
    assert (a.arch, a.intervene, a.prepend, a.residual) == ("nosink-fwd", "sinkscale(key=0, beta=0.5)@1-2", "bos", None)
    assert a.key != Recipe.of(lm, "nosink-fwd", "sinkscale(key=0, beta=0.5)@1-2").key  # the BOS control counts
    assert a.describe().endswith("· nosink-fwd · sinkscale(key=0, beta=0.5)@1-2 · BOS · float32")
    assert Recipe.from_dict(json.loads(json.dumps(a.to_dict()))) == a
    with pytest.raises(InputError, match="unknown field"):
        Recipe.from_dict({"model": "m", "colour": "red"})


def test_a_capture_carries_its_recipe_through_save_and_load(tmp_path):
    lm = loaded("llama")
    recipe = Recipe.of(lm, "mask0-bidir(k=1)", "temperature(t=2)@2", "T")
    cap = capture(lm, TEXT, recipe)
    assert cap.recipe == recipe and cap.arch == recipe.arch and cap.meta["intervene"] == recipe.intervene
    assert cap.token_ids[0] == lm.tokenizer("T", add_special_tokens=False)["input_ids"][0]
    back = Capture.load(cap.save(tmp_path / "c.npz"))
    assert back.recipe == recipe
    meta = export.describe(back, 1, 0)
    assert meta["recipe"] == recipe.key and meta["provenance"] == recipe.describe() and meta["intervene"] == "temperature(t=2)@2"
    # the same settings given one by one make the same capture
    same = capture(lm, TEXT, Recipe.of(lm, "mask0-bidir(k=1)", intervene="temperature(t=2)@2", prepend="T"))
    assert same.recipe == recipe
    np.testing.assert_array_equal(same.probs[2], cap.probs[2])


def test_naming_a_setting_twice_is_refused():
    lm = loaded("llama")
    recipe = Recipe.of(lm, "fwd", "temperature(t=2)")
    with pytest.raises(InputError, match="the recipe already says intervene"):
        capture(lm, TEXT, Recipe.of(lm, recipe, intervene="temperature(t=3)"))
    with pytest.raises(InputError, match="the recipe is for"):
        capture(lm, TEXT, dataclasses.replace(recipe, model="someone/else"))


def test_entry_points_take_a_recipe_and_give_its_numbers():
    lm = loaded("llama")
    recipe = Recipe.of(lm, "nosink-fwd", "temperature(t=2)@1")
    ev = evaluate(lm, TEXT, recipe, window=8)
    # the recipe's intervention is applied (the plain architecture scores otherwise), and a recipe read back
    # from its dictionary (a Parquet row, a file's metadata) gives the same numbers
    assert ev.as_json() == evaluate(lm, TEXT, Recipe.from_dict(recipe.to_dict()), window=8).as_json()
    assert ev.nll != evaluate(lm, TEXT, "nosink-fwd", window=8).nll
    cap = capture(lm, TEXT, recipe)
    region = regions.of_capture(lm, cap, 2, (3, 9), (0, 6))
    np.testing.assert_allclose(region.values, cap.layer_probs(2)[:, 3:9, 0:6], atol=1e-3)
    direct = regions.region(lm, TEXT, recipe, 2, (3, 9), (0, 6))
    np.testing.assert_allclose(direct.values, region.values, atol=1e-3)  # recomputed in fp32, cut from fp16 maps


def test_the_forward_choice_is_made_once():
    """Engine or residual variant: the same function, and the engine's logits are stock's under FWD."""
    lm = loaded("llama")
    ids = torch.tensor([lm.tokenizer(TEXT)["input_ids"]])
    built = build(lm, "fwd")
    logits, hidden, _ = built.forward(lm, ids, None, engine.Feed(hidden_states=True))
    with torch.no_grad():
        stock = lm.model(input_ids=ids)
    torch.testing.assert_close(logits, stock.logits, atol=1e-5, rtol=1e-5)
    assert len(hidden) == lm.n_layers + 1
    variant = build(lm, "fwd", residual="method1")
    assert variant.recipe.residual == "method1" and variant.recipe.key != built.recipe.key
    with pytest.raises(InputError, match="hidden states are not recorded"):
        variant.forward(lm, ids, None, engine.Feed(hidden_states=True))
    assert variant.forward(lm, ids)[0].shape == logits.shape


def test_every_entry_point_takes_a_recipe_and_refuses_what_it_does_not_apply():
    from attnviz.effects import embedding, heads
    from attnviz.effects.generate import generate
    from attnviz.kv import compress
    from attnviz.effects.streaming import stream

    lm = loaded("llama")
    plain, acted = Recipe.of(lm, "nosink-fwd"), Recipe.of(lm, "nosink-fwd", "temperature(t=2)")
    ids = lm.tokenizer(TEXT * 2)["input_ids"]
    again = Recipe.from_dict(acted.to_dict())
    streamed = stream(lm, ids, "window(w=8)", acted)
    assert streamed.as_json() == stream(lm, ids, "window(w=8)", again).as_json()
    assert streamed.as_json()["perplexity"] != stream(lm, ids, "window(w=8)", plain).as_json()["perplexity"]
    assert generate(lm, TEXT, acted, max_new_tokens=3).new_ids == generate(lm, TEXT, again, max_new_tokens=3).new_ids
    docs = [TEXT * 3, TEXT[::-1] * 3, TEXT.upper() * 3]
    assert embedding.probe(lm, docs, plain, m=8).as_json() == embedding.probe(lm, docs, "nosink-fwd", m=8).as_json()
    assert compress.compress(lm, ids, 20, ["knorm"], [0.5], plain).as_json() == \
        compress.compress(lm, ids, 20, ["knorm"], [0.5], "nosink-fwd").as_json()
    for run, purpose in [(lambda r: embedding.probe(lm, docs, r, m=8), "the embedding probe"),
                         (lambda r: compress.compress(lm, ids, 20, ["knorm"], [0.5], r), "KV-cache compression"),
                         (lambda r: heads.taxonomy(lm, [TEXT * 8], r, s=1, w=4), "head classes")]:
        with pytest.raises(InputError, match=f"{purpose} does not apply the intervention temperature"):
            run(acted)


def test_a_bos_control_goes_to_generation_s_prompt_and_is_refused_where_no_text_is_tokenized():
    from attnviz.effects.generate import generate
    from attnviz.effects.streaming import stream

    lm = loaded("llama")
    marked = Recipe.of(lm, "fwd", prepend="T")
    assert generate(lm, TEXT, marked, max_new_tokens=2).new_ids == \
        generate(lm, "T" + TEXT, "fwd", max_new_tokens=2).new_ids  # "T" is one token, prepended once
    with pytest.raises(InputError, match="decoding with a KV cache does not apply a BOS control"):
        stream(lm, lm.tokenizer(TEXT)["input_ids"], "dense", marked)
    with pytest.raises(InputError, match="a perplexity .* does not apply a BOS control"):
        evaluate(lm, TEXT, marked, window=8)


def test_dataset_sinks_and_the_streaming_heads_perplexity_take_a_recipe():
    """Both took only an architecture string (arch.resolve refused a Recipe); now a recipe gives its numbers."""
    from attnviz.effects import dataset, heads

    lm = loaded("llama")
    docs = [TEXT * 3, TEXT[::-1] * 3, TEXT.upper() * 3]
    acted = Recipe.of(lm, "nosink-fwd", "temperature(t=2)")
    by_recipe = dataset.sinks(lm, docs, acted, max_len=16, n_samples=3)
    by_dict = dataset.sinks(lm, docs, Recipe.from_dict(acted.to_dict()), max_len=16, n_samples=3)
    np.testing.assert_array_equal(by_recipe.alpha, by_dict.alpha)
    assert not np.allclose(by_recipe.alpha, dataset.sinks(lm, docs, "nosink-fwd", max_len=16, n_samples=3).alpha,
                           equal_nan=True)
    tax = heads.taxonomy(lm, [TEXT * 8], "fwd", s=1, w=4)
    dense, streaming = heads.streaming_only_perplexity(lm, TEXT * 4, tax, Recipe.of(lm, "fwd"))
    assert (dense.as_json(), streaming.as_json()) == tuple(e.as_json() for e in
                                                           heads.streaming_only_perplexity(lm, TEXT * 4, tax, "fwd"))
    with pytest.raises(InputError, match="does not apply the intervention"):
        heads.streaming_only_perplexity(lm, TEXT * 4, tax, acted)


@pytest.mark.parametrize("kind", ["", "  "])
def test_an_empty_kind_names_none_and_is_refused(kind):
    """kind='' silently meant the model's own; None says that. A recipe's own "" (the model's kind, saved so) is
    read as before."""
    lm = loaded("llama")
    for make in (lambda: build(lm, "fwd", kind=kind), lambda: Recipe.of(lm, "fwd", kind=kind),
                 lambda: build(lm, Recipe.of(lm, "fwd"), kind=kind)):
        with pytest.raises(InputError, match=f"kind={kind!r} names no attention kind: leave it out .None. for the "
                                             "model's own, or name one of softmax, sink, "):
            make()
    own = Recipe.of(lm, "fwd")
    assert own.kind == "" and build(lm, own).recipe == own and build(lm, "fwd", kind=None).recipe == own
