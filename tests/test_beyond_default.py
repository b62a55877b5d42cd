"""Right beyond the default setting: per-head masks, the model's own sliding window, left-padded batches, residual
variants with a patch, the model after a capture, a model shared by sessions, half precision and a shrunk plan.
Each test failed before its fix (what it failed with is in its docstring)."""

import threading
import time

import numpy as np
import pytest
import torch

from attnviz import plan as plan_mod
from attnviz import recipe as recipe_mod
from attnviz.capture import capture
from attnviz.core.spec import arch
from attnviz.core import engine
from attnviz.core.engine import sites
from attnviz.core.spec import interventions as I
from attnviz.effects import causal
from attnviz.errors import InputError
from attnviz.figures.heatmaps import layer_matrix
from attnviz.figures.sinks import key_profile
from attnviz.plan import Keep
from attnviz.recipe import Recipe
from attnviz.stats import metrics

from tiny import build, loaded

TEXT = "The keeper lit the lamp at dusk and watched the ships come in."
FULL = Keep(storage_dtype=torch.float32)


def test_each_head_is_read_through_its_own_mask():
    """headwindow on head 1 of layer 1: its alpha (statistics and full maps) is the definition on head 1's own
    allow-set, and its masked cells are grey. Before: head 0's allow-set was read for every head (alpha 0.021
    where 0.360 was right) and the map showed the causal mask."""
    lm = loaded("llama")
    recipe = Recipe.of(lm, "fwd", "headwindow(heads=1, s=1, w=3)@1")
    full = capture(lm, TEXT, recipe, FULL)
    stats = capture(lm, TEXT, recipe, Keep(statistics=True))
    n = full.n_tokens
    i, j = np.indices((n, n))
    windowed = (j < 1) | ((j <= i) & (j > i - 3))  # written out: the first key and the last three
    causal_mask = j <= i
    assert (full.head_allowed[1][1] == windowed).all() and (full.head_allowed[1][0] == causal_mask).all()
    assert (full.allowed[1] == causal_mask).all() and 0 not in full.head_allowed  # other layers: one mask
    probs = full.layer_probs(1)
    expected = np.stack([metrics.alpha(probs[h:h + 1], windowed if h == 1 else causal_mask)[0] for h in range(4)])
    np.testing.assert_allclose(full.stat(1, "alpha"), expected, atol=1e-5)
    np.testing.assert_allclose(stats.stat(1, "alpha"), expected, atol=1e-3)
    assert abs(expected[1, 1] - metrics.alpha(probs[1:2], causal_mask)[0, 1]) > 0.05  # the two readings differ
    np.testing.assert_allclose(stats.stat(1, "entropy")[1], metrics.entropy(probs[1:2], windowed, True)[0],
                               atol=1e-3)
    shown = layer_matrix(full, 1, head=1)
    assert np.isnan(shown[~windowed]).all() and np.isfinite(shown[windowed]).all()
    assert np.isfinite(layer_matrix(full, 1, head=0)[causal_mask]).all()


def test_the_sink_key_is_one_definition_under_the_model_s_own_window():
    """A tiny Mistral (sliding window 5) on 60 tokens: the key a patch at the sink replaces is the key the causal
    check measures, in every layer, under FWD and NoSink-FWD (and a Llama without a window). Before: the engine ignored the window and looked at
    64 keys (key 0), the metric counted the window and found a key near the end (key 54)."""
    text = TEXT[:60]
    # under the window no key is open to every later query (0, by definition); without one NoSink's is key 1
    for kind, spec, expected in (("mistral", "fwd", 0), ("mistral", "nosink-fwd", 0), ("llama", "nosink-fwd", 1)):
        lm = loaded(kind)
        recipe = Recipe.of(lm, spec, "patch(block=mlp, tokens=sink)")
        profile = causal.profile(lm, text, recipe)
        ids = torch.tensor([lm.tokenizer(text)["input_ids"]])
        built = recipe_mod.build(lm, recipe)
        _, run = engine.forward(lm.model, ids, built.computes, engine.NOTHING)
        patched = [run.sink_key(layer) for layer in range(lm.n_layers)]
        assert patched == profile.keys == [expected] * lm.n_layers, (kind, spec, patched, profile.keys)
    # the definition, written out: under a window shorter than the text no key is open to every later query
    n = 60
    i, j = np.indices((n, n))
    assert metrics.auto_key((j <= i) & (i - j < 5)) == 0
    assert engine.auto_key(next(iter(arch.parse("fwd", 1).layers)), n, window=5) == 0
    assert engine.auto_key(next(iter(arch.parse("nosink-fwd(m=2)", 1).layers)), n, window=None) == 2


def test_a_left_padded_batch_patches_the_same_token_of_every_row():
    """NoSink-FWD's sink is the second real token: in a batch whose first row is left-padded by three, the patch
    replaces index 4 of that row and index 1 of the other. Before: index 4 of both (an index compared with
    positions)."""
    model = build("llama")
    engine.prepare(model)
    masks = tuple(arch.parse("nosink-fwd", 3).layers)
    acts = I.parse("patch(block=mlp, tokens=sink)@0", 3, 4)
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0
    engine.forward(model, ids, engine.Computes(masks, acts), engine.NOTHING, engine.Feed(attention_mask=mask))
    seen = {}
    handle = model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: seen.update(out=out.detach()))
    try:
        engine.forward(model, ids, engine.Computes(masks, acts), engine.NOTHING, engine.Feed(attention_mask=mask))
    finally:
        handle.remove()
    zeroed = (seen["out"] == 0).all(-1)
    assert zeroed[0].nonzero().flatten().tolist() == [4] and zeroed[1].nonzero().flatten().tolist() == [1]


def test_a_patch_under_a_residual_variant_is_refused_in_one_line():
    """A residual variant recomputes every block's write: a patch there was applied twice (method 1) or never
    (method 2). Now the recipe is refused, naming both."""
    lm = loaded("llama")
    for method in ("method1", "method2"):
        with pytest.raises(InputError, match=f"patch is not defined under the residual variant {method}") as err:
            Recipe.of(lm, "fwd", "patch(block=mlp, tokens=0)@1", residual=method)
        assert "\n" not in str(err.value)
    assert Recipe.of(lm, "fwd", "temperature(t=2)@1", residual="method1").residual == "method1"


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt_oss"])
def test_after_a_capture_the_model_is_stock(kind):
    """``output_attentions=True`` after a capture gives stock eager's attentions (softcap and learned sinks
    included). Before: an empty tuple."""
    lm = loaded(kind)
    stock = build(kind, "eager")
    capture(lm, TEXT[:20], "nosink-fwd")
    ids = torch.randint(3, 90, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = lm.model(ids, output_attentions=True), stock(ids, output_attentions=True)
    assert len(ours.attentions) == len(theirs.attentions) == 3
    for a, b in zip(ours.attentions, theirs.attentions):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-5, rtol=0)


def test_sessions_sharing_a_model_hook_its_blocks_once(monkeypatch):
    """Eight sessions patching a fresh shared model at the same moment register each block's hook once. Before:
    check-then-set without a lock, and a slow mapping of the blocks let every session through (8 hooks a block)."""
    model = build("llama")
    slow = sites._where

    def where(model, site):
        time.sleep(0.01)
        return slow(model, site)

    monkeypatch.setattr(sites, "_where", where)
    start = threading.Barrier(8)

    def session():
        start.wait()
        engine.hook_blocks(model)

    threads = [threading.Thread(target=session) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for layer in model.model.layers:
        assert len(layer.self_attn._forward_hooks) == 1 and len(layer.mlp._forward_hooks) == 1


def test_a_mean_patch_counts_in_float32():
    """patch(value=mean) on a bfloat16 block output of 3,001 positions: the mean of the other 3,000, rounded once
    to bfloat16 (within half a step). Before: the count was summed in bfloat16 (3,000 reads 3,008) and so was the
    sum: 0.0159 off, two half steps."""
    n = 3001
    out = (torch.rand(1, n, 4, generator=torch.Generator().manual_seed(0)) + 2.0).to(torch.bfloat16)
    positions = torch.arange(n)[None]
    patch = I.Patch(block="mlp", tokens="0", value="mean")
    got = patch.block_output(out, positions, torch.ones(1, n, dtype=torch.bool), sink_key=0)
    exact = out[:, 1:].double().mean(1)
    half_step = 2.0 ** -7  # between 2 and 4 a bfloat16 step is 2^-6
    assert (got[0, 0].double() - exact[0]).abs().max() <= half_step
    assert torch.equal(got[:, 1:], out[:, 1:])


def test_a_shrunk_plan_keeps_the_statistics_the_caller_chose(default_model):
    """A keep of alpha alone that does not fit as full maps stays alpha alone as statistics. Before: every
    statistic (entropy and allocation cost a pass over every block)."""
    plan = plan_mod.plan(default_model, 2048, per_capture=1, left=10 * 2**30, keep=Keep(statistics=("alpha",)))
    assert plan.keep.statistics == ("alpha",) and plan.keep.pool
    plan = plan_mod.plan(default_model, 2048, per_capture=1, left=10 * 2**30, keep=Keep())
    assert plan.keep.statistics is True


def test_the_key_profile_names_its_key():
    """The Sinks page's profile of key 2: its axis reads A[i, 2]. Before: "A[i, {key}]" literally."""
    lm = loaded("llama")
    fig = key_profile(capture(lm, TEXT[:20], "fwd"), key=2)
    assert fig.layout.yaxis.title.text == "A[i, 2] (mean over heads)"
