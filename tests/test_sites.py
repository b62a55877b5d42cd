"""The named sites (docs/methods.md#sites): each site reads what stock transformers computes (its hidden states, a
hand-written hook) on several families; a replacement at chosen rows and positions changes those alone; a site acts
in the thread that entered it only; every hook of the library goes through the sites; one resumed forward (its
head checked once per model); ``patch`` per batch row; activation patching with a metric of one's own."""

import dataclasses
import importlib
import re
import threading
from pathlib import Path

import pytest
import torch

import tiny
from attnviz.core.model import anatomy
from attnviz.core import engine
from attnviz.core.engine import sites
from attnviz.core.spec.interventions import Patch
from attnviz.effects.patching import patching
from attnviz.errors import InputError
from attnviz.recipe import build

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ["llama", "gemma3_text", "gpt_neox", "granite", "qwen2"]


def _ids(n=12, batch=1, seed=0):
    return torch.randint(3, 90, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", FAMILIES)
@torch.no_grad()
def test_each_site_reads_what_the_model_computes(kind):
    """resid_pre is stock's hidden state entering the layer; resid_post the next one; the layer's output is its input
    plus attn_out plus mlp_out (post-norms and Granite's multiplier included); resid_mid is the input plus
    attn_out; head_z is the output projection's input (a hand-written pre-hook), split by head."""
    model = tiny.build(kind)
    found = anatomy.of(model)
    ids = _ids()
    seen = {}
    pairs = [(sites.Site(name, l), sites.save(seen, (name, l))) for l in range(len(found.layers))
             for name in ("resid_pre", "resid_post", "attn_out", "mlp_out", "head_z")
             + (() if found[l].parallel else ("resid_mid",))]
    hand = {}
    handles = [engine.output_linear(L.attn).register_forward_pre_hook(
        lambda m, args, l=L.index: hand.__setitem__(l, args[0].clone())) for L in found.layers]
    try:
        with sites.hooks(model, pairs):
            out = model(ids, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    heads = model.config.num_attention_heads
    for l in range(len(found.layers)):
        torch.testing.assert_close(seen["resid_pre", l], out.hidden_states[l], atol=0, rtol=0)
        total = seen["resid_pre", l] + seen["attn_out", l] + seen["mlp_out", l]
        torch.testing.assert_close(seen["resid_post", l], total, atol=1e-5, rtol=1e-5)
        if not found[l].parallel:
            torch.testing.assert_close(seen["resid_mid", l], seen["resid_pre", l] + seen["attn_out", l],
                                       atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(seen["head_z", l], hand[l].unflatten(-1, (heads, -1)), atol=0, rtol=0)
    for l in range(len(found.layers) - 1):  # the last hidden state is after the final norm
        torch.testing.assert_close(seen["resid_post", l], out.hidden_states[l + 1], atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "granite", "gemma3_text"])
@torch.no_grad()
def test_a_replacement_changes_the_chosen_rows_and_positions_alone(kind):
    """Row 1 gets row 0's MLP write at positions 3 and 5: the same as a hand-written hook on the write module
    (divided by Granite's multiplier, which the site includes); row 0 and the other positions as stock."""
    model = tiny.build(kind)
    L = anatomy.of(model)[1]
    ids = _ids(batch=2)
    source = {}
    with sites.hooks(model, [(sites.Site("mlp_out", 1), sites.save(source, "w"))]):
        model(ids)
    put = sites.put(source["w"], rows=[1], positions=[[3, 5]])
    with sites.hooks(model, [(sites.Site("mlp_out", 1), put)]):
        ours = model(ids).logits

    def hand(m, args, out):
        value = (out[0] if isinstance(out, tuple) else out).clone()
        value[1, [3, 5]] = source["w"][0, [3, 5]] / L.scale
        return (value, *out[1:]) if isinstance(out, tuple) else value

    handle = L.mlp_write.register_forward_hook(hand)
    try:
        theirs = model(ids).logits
    finally:
        handle.remove()
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    plain = model(ids).logits
    torch.testing.assert_close(ours[0], plain[0], atol=0, rtol=0)
    torch.testing.assert_close(ours[1, :3], plain[1, :3], atol=0, rtol=0)
    assert not torch.allclose(ours[1, 5:], plain[1, 5:])


@torch.no_grad()
def test_a_site_acts_in_the_thread_that_entered_it_only():
    """A zeroing function held by one thread leaves another thread's forwards on the same model as stock."""
    model = tiny.build("llama")
    ids = _ids()
    plain = model(ids).logits
    entered, done = threading.Event(), threading.Event()
    zero = [(sites.Site("mlp_out", l), torch.zeros_like) for l in range(model.config.num_hidden_layers)]

    def holder():
        with sites.hooks(model, zero):
            entered.set()
            done.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    entered.wait(30)
    try:
        torch.testing.assert_close(model(ids).logits, plain, atol=0, rtol=0)
        with sites.hooks(model, zero):
            assert not torch.allclose(model(ids).logits, plain)
    finally:
        done.set()
        thread.join()
    torch.testing.assert_close(model(ids).logits, plain, atol=0, rtol=0)  # every hook removed


def test_bad_sites_are_refused_in_one_line():
    model = tiny.build("gpt_neox")
    with pytest.raises(InputError, match="unknown site 'resid'"):
        sites.Site("resid", 0)
    with pytest.raises(InputError, match="layer 0 only"):
        sites.Site("embed", 2)
    with pytest.raises(InputError, match="parallel"):
        with sites.hooks(model, [(sites.Site("resid_mid", 0), lambda v: None)]):
            pass
    with pytest.raises(InputError, match="does not exist"):
        with sites.hooks(model, [(sites.Site("mlp_out", 40), lambda v: None)]):
            pass


def test_every_hook_of_the_library_goes_through_the_sites():
    """``register_forward*`` is written in the sites module alone (and the model anatomy's probe, which finds the
    modules the sites are on)."""
    found = {str(p.relative_to(ROOT)) for folder in ("attnviz", "pages", "ui") for p in (ROOT / folder).rglob("*.py")
             if re.search(r"register_forward", p.read_text())}
    assert {Path(p).name for p in found} <= {"sites.py", "probe.py"}, found


@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "granite"])
@torch.no_grad()
def test_patch_of_one_batch_row_equals_that_patch_on_its_own(kind):
    """A batch of three rows, each with its own ``patch`` (the embedding, attention 1, MLP 1 at token 2): each row
    equals the same patch run alone, resumed from layer 1's kept input where the patch is at layer 1."""
    lm = tiny.loaded(kind)
    ids = _ids(n=10)
    computes = build(lm, "fwd").computes
    patches = [Patch(block="embed", tokens="2", rows=(0,), layers=(0,)),
               Patch(block="attn", tokens="2", rows=(1,), layers=(1,)),
               Patch(block="mlp", tokens="2", rows=(2,), layers=(1,))]
    every = dataclasses.replace(computes, interventions=computes.interventions.plus(*patches))
    batched = engine.forward(lm.model, ids.expand(3, -1), every, engine.Record.nothing())[0].logits
    plain = engine.forward(lm.model, ids, computes, engine.Record.nothing())[0].logits
    for row, patch in enumerate(patches):
        alone = dataclasses.replace(computes, interventions=computes.interventions.plus(
            dataclasses.replace(patch, rows=None)))
        logits = engine.forward(lm.model, ids, alone, engine.Record.nothing())[0].logits
        torch.testing.assert_close(batched[row], logits[0], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(logits, plain)


@torch.no_grad()
def test_a_resumed_forward_returns_what_it_made_and_its_head_is_checked_once():
    lm = tiny.loaded("llama")
    model, L = lm.model, lm.n_layers
    built = build(lm, "fwd")
    ids = _ids(n=9)
    out, _, run = built.forward(lm, ids, engine.Record.nothing(checkpoints=frozenset(range(L))))
    resumed = engine.resume(model, run.checkpoints[1], 1, ids, built.computes)
    torch.testing.assert_close(resumed.logits(model, last_only=False), out, atol=1e-5, rtol=1e-5)
    model.__dict__.pop("_attnviz_head_checked", None)
    calls = []
    real = engine.head_logits
    forward_mod = importlib.import_module("attnviz.core.engine.forward")  # the package's forward is the function

    forward_mod.head_logits, saved = (lambda *a, **k: calls.append(1) or real(*a, **k)), forward_mod.head_logits
    try:
        for _ in range(3):
            engine.checked_head(model, ids, run.checkpoints[L - 1], out[:, -1], built.computes, "a test")
    finally:
        forward_mod.head_logits = saved
    assert len(calls) == 1


def test_patching_takes_a_metric_of_one_s_own():
    """A function that computes the logit difference gives the grid ``logit_diff`` gives; one that reads the sink's
    attention gives the grid ``sink`` gives."""
    lm = tiny.loaded("llama")
    clean, corrupted = "The cat sat on the mat and", "The dog sat on the hat and"
    answer, wrong = "P", "R"
    a = lm.tokenizer(answer, add_special_tokens=False)["input_ids"][0]
    w = lm.tokenizer(wrong, add_special_tokens=False)["input_ids"][0]
    named = patching(lm, clean, corrupted, answer, wrong, "resid", "logit_diff")

    def difference(logits):
        return logits[:, a] - logits[:, w]

    own = patching(lm, clean, corrupted, site="resid", metric=difference)
    assert own.metric == "difference"
    torch.testing.assert_close(torch.tensor(own.effect), torch.tensor(named.effect), atol=1e-6, rtol=0)
    sink = patching(lm, clean, corrupted, site="attn", metric="sink")

    def mean_sink(logits, attention):
        return torch.stack(list(attention.values())).mean(0)

    own_sink = patching(lm, clean, corrupted, site="attn", metric=mean_sink)
    torch.testing.assert_close(torch.tensor(own_sink.effect), torch.tensor(sink.effect), atol=1e-6, rtol=0)
    with pytest.raises(InputError, match="reads no answer"):
        patching(lm, clean, corrupted, answer, wrong, "resid", "kl")
    with pytest.raises(InputError, match="a metric is a function"):
        patching(lm, clean, corrupted, site="resid", metric=lambda: 0)
