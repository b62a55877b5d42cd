"""The causal scan of every block (docs/methods.md#the-causal-scan): each block's check equal to ``patch`` of that
block alone (the causal check's own forwards), on several families and the default model; the embedding's removal
against a hand-written hook; the necessary writers and their chains; the CLI's contract; the Why page."""

import json

import numpy as np
import pytest
import torch

import tiny
from attnviz.cli import main
from attnviz.effects import causal
from attnviz.effects.causal import NECESSARY, blocks_of, scan

TEXT = "The keeper lit the lamp. The ships passed the rocks, and the keeper slept."
LIGHTHOUSE = ("The old lighthouse keeper climbed the stairs every evening. He lit the lamp, wound the clock, and "
              "wrote the weather in his book.")


def _same(a, b, source):
    np.testing.assert_allclose(a.after.attention, b.after.attention, atol=1e-5, err_msg=source)
    np.testing.assert_allclose(a.before.attention, b.before.attention, atol=1e-5, err_msg=source)
    assert a.after.perplexity == pytest.approx(b.after.perplexity, rel=1e-5), source
    assert a.before.perplexity == pytest.approx(b.before.perplexity, rel=1e-5), source


@pytest.mark.parametrize("value", ["zero", "mean"])
@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "gpt_neox", "granite", "qwen2"])
def test_every_block_s_check_equals_patch_of_that_block_alone(kind, value):
    lm = tiny.loaded(kind)
    found = scan(lm, TEXT, "fwd", value, leaders=False)
    assert [c.source for c in found.checks] == blocks_of(lm.n_layers)
    for check in found.checks[1:]:  # the blocks patch can remove (the embedding is tested below)
        [alone] = causal.check(lm, TEXT, "fwd", [check.source], value)
        _same(check, alone, check.source)


def test_a_scan_without_perplexities_finds_the_same_sink_and_writes_null():
    """``perplexity=False``: every check's sink attention and chain as the full scan's, each removal's perplexity
    not computed (NaN, null in JSON); the unpatched forward's is still there."""
    lm = tiny.loaded("llama")
    full, lean = scan(lm, TEXT, "fwd", leaders=False), scan(lm, TEXT, "fwd", leaders=False, perplexity=False)
    assert full.necessary == lean.necessary and full.chains == lean.chains
    for a, b in zip(full.checks, lean.checks):
        assert a.source == b.source and a.before == b.before and a.after.attention == b.after.attention
        assert np.isfinite(a.after.perplexity) and np.isnan(b.after.perplexity)
        written = b.as_json()
        assert written["perplexity_after"] is None and written["perplexity_before"] == a.as_json()["perplexity_before"]


def test_the_scan_runs_under_the_recipe():
    lm = tiny.loaded("llama")
    found = scan(lm, TEXT, "nosink-fwd", leaders=False)
    assert found.checks[0].before.keys == [1] * lm.n_layers  # NoSink-FWD's sink key
    [alone] = causal.check(lm, TEXT, "nosink-fwd", ["mlp.0"])
    _same(next(c for c in found.checks if c.source == "mlp.0"), alone, "mlp.0")


@torch.no_grad()
def test_the_embedding_s_removal_equals_a_hand_written_hook():
    lm, stock = tiny.loaded("llama"), tiny.build("llama")
    found = scan(lm, TEXT, "fwd", leaders=False)
    embed = found.checks[0]
    assert embed.source == "embed" and embed.layer == -1
    ids = torch.tensor([lm.tokenizer(TEXT)["input_ids"]])

    def zero_first(module, args):
        hidden = args[0].clone()
        hidden[:, 0] = 0
        return (hidden, *args[1:])

    handle = stock.model.layers[0].register_forward_pre_hook(zero_first)
    try:
        out = stock(ids, output_attentions=True)
    finally:
        handle.remove()
    logp = torch.log_softmax(out.logits[0, :-1].double(), -1)
    ppl = float(torch.exp(-logp.gather(-1, ids[0, 1:, None]).mean()))
    assert embed.after.perplexity == pytest.approx(ppl, rel=1e-5)
    for layer, attention in enumerate(out.attentions):  # alpha at key 0, the mean over heads
        alpha = attention[0, :, :, 0].double().mean(-1)
        assert embed.after.attention[layer] == pytest.approx(float(alpha.mean()), abs=1e-5)


def test_necessary_writers_and_their_chain_on_the_default_model(default_model):
    found = scan(default_model, LIGHTHOUSE, "fwd", leaders=False)
    L = default_model.n_layers
    drops = {c.source: c.drop(list(range(c.layer + 1, L))) for c in found.checks}
    assert found.necessary == [s for s in blocks_of(L) if drops[s] >= NECESSARY]
    assert {"mlp.0", "mlp.11"} <= set(found.necessary)
    chain = {w["block"]: w for w in found.chains["mlp.0"]}
    # removing MLP 0 shrinks MLP 11's write: a chain (path patching finds no path through MLP 11, tests/test_paths.py)
    assert chain["mlp.11"]["norm_after"] < 0.5 * chain["mlp.11"]["norm_before"]
    for source in ("mlp.0", "attn.11"):
        [alone] = causal.check(default_model, LIGHTHOUSE, "fwd", [source])
        _same(next(c for c in found.checks if c.source == source), alone, source)


def test_the_cli_scans_every_block_and_marks_the_leaders(default_model, capsys):
    assert main(["explain", "--text", LIGHTHOUSE, "--test"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["source"] for c in doc["checks"]] == blocks_of(30) and doc["scan"] == "every block"
    assert {"source", "leads", "patch", "sink_drop", "perplexity_before", "perplexity_after", "layers",
            "leader"} <= set(doc["checks"][1])
    assert any(c["leader"] for c in doc["checks"]) and all(c["leader"] == bool(c["leads"]) for c in doc["checks"])
    assert "mlp.0" in doc["necessary"] and set(doc["chains"]) == set(doc["necessary"])


def test_the_why_page_draws_the_scan(default_model, tmp_path):
    from test_app import app_test, charts, on_page, texts

    at = app_test(tmp_path)
    at.run()
    at.query_params.update({"layer": "29", "head": "3", "query": "all", "key": "0"})
    on_page(at, "pages/why.py")
    at.button(key="why_scan").click().run()
    assert not at.exception and not at.error, texts(at.error)
    figure = next(f for f in charts(at) if "causal scan of every block" in str(f["layout"]["title"]["text"]))
    assert len(figure["data"]) == 2
    assert any("is necessary" in m.value for m in at.markdown)


def test_gemma3_s_necessary_writers_include_one_attribution_never_names(gemma3_model):
    """The answer in docs/findings.md on Gemma 3 270M: on the first 256 tokens of the stdlib corpus, MLP 1 is necessary
    although attribution names it in no layer, and removing it shrinks MLP 3's write at the sink token (a chain, a
    correlation: the path goes through MLPs 2 and 3 together, tests/test_paths.py)."""
    from attnviz import corpus
    from attnviz.effects.evaluate import token_ids

    text = corpus.text_of(gemma3_model.tokenizer, token_ids(gemma3_model, corpus.load("stdlib").text, 256))
    found = scan(gemma3_model, text, "fwd", perplexity=False)  # the sink alone: no 262k-token logits a removal
    assert {"embed", "mlp.1", "mlp.3"} <= set(found.necessary)
    mlp1 = next(c for c in found.checks if c.source == "mlp.1")
    assert mlp1.leads == [] and mlp1.drop(list(range(2, gemma3_model.n_layers))) > 0.8
    chain = {w["block"]: w["change"] for w in found.chains["mlp.1"]}
    assert chain["mlp.3"] < -0.8
    assert next(c for c in found.checks if c.source == "mlp.5").drop(list(range(6, 18))) < 0.3  # a leader, not a cause


@pytest.mark.parametrize("kind,arch", [("gemma3_text", "nosink-fwd"), ("gemma3_text", "fwd"), ("qwen2", "nosink-fwd")])
def test_a_removal_changes_nothing_below_it_under_a_model_s_window(kind, arch):
    """A block's removal cannot move the sink in a layer whose attention ran before it (an MLP's own layer and below):
    those layers read as before, a model's sliding window included (the embedding's patch reads a layer's sink key
    before that layer's attention has run: the run knows the model's windows from the anatomy)."""
    lm = tiny.loaded(kind)
    found = scan(lm, TEXT, arch, leaders=False)
    for check in found.checks:
        below = range(0, check.layer + (1 if check.source.startswith("mlp.") else 0))
        np.testing.assert_array_equal([check.after.attention[l] for l in below],
                                      [check.before.attention[l] for l in below], err_msg=check.source)
