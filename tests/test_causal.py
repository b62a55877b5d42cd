"""The causal check (docs/methods.md#the-causal-check): a leading source patched at the sink token, and the sink's
attention and the perplexity before and after, each checked against the patched recipe computed directly."""

import json

import numpy as np
import pytest

from attnviz.capture import capture
from attnviz.effects import causal
from attnviz.effects.evaluate import evaluate
from attnviz.effects.explain import KeptForward, diagnose
from attnviz.errors import InputError
from attnviz.plan import Keep
from attnviz.recipe import Recipe
from attnviz.stats import metrics

from tiny import loaded

TEXT = "The keeper lit the lamp at dusk and watched the ships pass the rocks. " * 2


def _sink_attention(cap, layer):
    """The mean over heads of A[:, key] over the queries that see it, from full maps, by the definition."""
    key = metrics.auto_key(cap.allowed[layer])
    return float(np.nanmean(metrics.alpha(cap.layer_probs(layer), cap.allowed[layer])[:, key]))


def test_the_check_is_the_patched_recipe_s_own_numbers():
    lm = loaded("llama")
    recipe = Recipe.of(lm, "nosink-fwd", "temperature(t=2)@2")  # its own intervention stays, the patch joins it
    [check] = causal.check(lm, TEXT, recipe, ["mlp.0"], value="mean")
    assert check.patch == "patch(block=mlp, tokens=sink, value=mean)@0"
    patched = Recipe.of(lm, "nosink-fwd", "temperature(t=2)@2; patch(block=mlp, tokens=sink, value=mean)@0")
    for made, profile in ((recipe, check.before), (patched, check.after)):
        cap = capture(lm, TEXT, made)
        assert profile.keys == [1, 1, 1]  # NoSink-FWD: the sink key is 1
        np.testing.assert_allclose(profile.attention, [_sink_attention(cap, l) for l in range(3)], atol=1e-5)
        assert profile.perplexity == pytest.approx(evaluate(lm, TEXT, made, window=cap.n_tokens).perplexity)
    assert check.after.attention[0] == pytest.approx(check.before.attention[0], abs=1e-6)  # below the patch: the same
    assert check.after.perplexity != pytest.approx(check.before.perplexity)
    above = [1, 2]
    drop = (np.mean([check.before.attention[l] for l in above]) - np.mean([check.after.attention[l] for l in above])) \
        / np.mean([check.before.attention[l] for l in above])
    assert check.drop(above) == pytest.approx(drop)
    assert [row["layer"] for row in check.as_json()["layers"]] == above


def test_by_default_every_block_is_checked_and_the_leaders_are_marked():
    from attnviz.effects.causal import blocks_of

    lm = loaded("llama")
    checks = causal.check(lm, TEXT, "fwd")
    run = KeptForward(lm, TEXT, "fwd")
    led: dict = {}
    for layer in range(3):
        led.setdefault(diagnose(run, layer).leading()[0], []).append(layer)
    assert [c.source for c in checks] == blocks_of(3)  # the embedding, then every block below the top layer
    assert {c.source: c.leads for c in checks} == {s: led.get(s, []) for s in blocks_of(3)}


def test_bad_sources_are_refused_before_any_forward():
    with pytest.raises(InputError, match="only a block's output can be patched"):
        causal.check(loaded("llama"), TEXT, "fwd", ["embed"])
    with pytest.raises(InputError, match="only a block's output"):
        causal.patch_spec("mlp")


def test_the_sweep_measure_is_the_check(tmp_path):
    from attnviz.effects.evaluate import token_ids
    from attnviz.sweep import measures
    from attnviz.sweep.spec import Cell

    lm = loaded("llama")
    cell = Cell("causal", "tiny", "fwd", "", "stdlib:compound", {"max_tokens": 40, "value": "zero"})
    rows = measures.causal(lm, cell)
    assert rows and all(set(r) == set(measures.COLUMNS["causal"]) for r in rows)
    text = lm.tokenizer.decode(token_ids(lm, measures.documents(cell.corpus).text, 40))
    checks = causal.check(lm, text, "fwd")
    assert [(r["source"], r["layer"], r["sink_after"]) for r in rows] == \
        [(c.source, row["layer"], row["after"]) for c in checks for row in c.as_json()["layers"]]


def test_cli_explain_test(default_model):
    from test_cli import run

    out = run("explain", "--test", "--sources", "mlp.11", "--text", "The cat sat on the mat, and the dog sat too.")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    [check] = doc["checks"]
    assert check["source"] == "mlp.11" and check["patch"] == "patch(block=mlp, tokens=sink, value=zero)@11"
    assert [row["layer"] for row in check["layers"]] == list(range(12, 30)) and doc["tokens"] > 5
    bad = run("explain", "--test", "--sources", "embed", "--text", "x")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "block's output" in bad.stderr
    missing = run("explain", "--text", "x")
    assert missing.returncode == 2 and "--layer" in missing.stderr and "--test" in missing.stderr
