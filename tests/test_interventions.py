"""Interventions beyond masks (docs/methods.md#interventions) on tiny random models, each against a direct computation."""

import numpy as np
import pytest
import torch

from attnviz.core import engine
from attnviz.core.spec import interventions as I
from attnviz.core.spec.arch import parse
from attnviz.capture import capture
from attnviz.recipe import Recipe
from attnviz.plan import Keep
from attnviz.errors import InputError

from tiny import build, loaded, pair

N = 14
TEXT = "The quick brown fox jumps over the lazy dog, again and again. " * 3


def _ids(n=N):
    return torch.randint(3, 90, (1, n), generator=torch.Generator().manual_seed(2))


def _ours(model, spec, arch="fwd"):
    acts = I.parse(spec, 3, 4)
    return engine.forward(model, _ids(), engine.Computes(tuple(parse(arch, 3).layers), acts),
                          engine.Record(storage_dtype=torch.float32))


def test_temperature_equals_stock_eager_with_the_scaling_divided_by_t():
    stock, ours = pair("llama")
    for layer in stock.model.layers:
        layer.self_attn.scaling /= 2.5
    with torch.no_grad():
        ref = stock(input_ids=_ids(), output_attentions=True)
    out, run = _ours(ours, "temperature(t=2.5)")
    assert (out.logits - ref.logits).abs().max() < 1e-5
    for layer, probs in enumerate(ref.attentions):
        assert (run.probs[layer] - probs).abs().max() < 1e-5


@pytest.mark.parametrize("how", ["zero", "mean"])
def test_ablate_equals_a_pre_hook_on_o_proj(how):
    stock, ours = pair("llama")
    stock.set_attn_implementation("sdpa")
    d = stock.config.hidden_size // stock.config.num_attention_heads

    def hook(module, args):
        (x,) = args
        x = x.clone()
        for h in (0, 3):
            part = x[..., h * d:(h + 1) * d]
            x[..., h * d:(h + 1) * d] = 0 if how == "zero" else part.mean(dim=1, keepdim=True)
        return (x,)

    stock.model.layers[1].self_attn.o_proj.register_forward_pre_hook(hook)
    with torch.no_grad():
        ref = stock(input_ids=_ids()).logits
    out, _ = _ours(ours, f"ablate(heads=0,3, how={how})@1")
    assert (out.logits - ref).abs().max() < 1e-5
    plain, _ = _ours(ours, "")
    assert (plain.logits - ref).abs().max() > 1e-4  # the ablation changed something


def test_sinkscale_beta_1_is_the_identity_and_beta_moves_mass_as_defined():
    model = build("llama")
    _, plain = _ours(model, "")
    _, same = _ours(model, "sinkscale(beta=1)")
    for layer in range(3):
        torch.testing.assert_close(same.probs[layer], plain.probs[layer])
    beta = 0.3
    _, scaled = _ours(model, f"sinkscale(key=0, beta={beta})@2")
    a = plain.probs[2][0].double()  # layer 2 takes layer 1's output, which the intervention did not change
    rest = a.sum(-1, keepdim=True) - a[..., :1]
    expected = torch.where(rest > 0, a + (1 - beta) * a[..., :1] * a / torch.where(rest > 0, rest, 1), a)
    expected[..., 0] = torch.where(rest[..., 0] > 0, beta * a[..., 0], a[..., 0])
    torch.testing.assert_close(scaled.probs[2][0].double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(scaled.probs[2][0].sum(-1), plain.probs[2][0].sum(-1))
    assert torch.equal(scaled.probs[2][0][:, 0, 0], plain.probs[2][0][:, 0, 0])  # row 0 sees only key 0: kept


@pytest.mark.parametrize("b", [0.0, 2.0])
def test_sinklogit_rows_sum_to_one_minus_the_discarded_mass(b):
    model = build("llama")
    _, plain = engine.forward(model, _ids(), list(parse("fwd", 3).layers), engine.Record(storage_dtype=torch.float32, scores=True))
    _, sunk = _ours(model, f"sinklogit(b={b})@0")
    s = plain.scores[0][0].double()  # layer 0's scaled scores: the same input with or without it
    allowed = torch.ones(N, N, dtype=torch.bool).tril()
    e = torch.where(allowed, s.exp(), 0.0)
    expected = e / (np.exp(b) + e.sum(-1, keepdim=True))  # one more logit b, dropped after the softmax
    torch.testing.assert_close(sunk.probs[0][0].double(), expected, atol=1e-6, rtol=1e-5)
    assert (sunk.probs[0][0].sum(-1) < 1).all()


def test_every_intervention_composes_with_masks_and_the_long_mode():
    lm = loaded("llama")
    spec = "sinkscale(beta=0.2)@1-2; temperature(t=1.5)@0; sinklogit(b=0)@2; ablate(heads=1)@1"
    for arch in ("mask0-bidir(k=2)", "sliding(w=7)*3"):
        full = capture(lm, TEXT, Recipe.of(lm, arch, intervene=spec), Keep(storage_dtype=torch.float32))
        long = capture(lm, TEXT, Recipe.of(lm, arch, intervene=spec),
                       Keep(statistics=True, pool=24, block_bytes=4 * 4 * len(TEXT) * 5))
        plain = capture(lm, TEXT, arch, Keep(storage_dtype=torch.float32))
        assert full.meta["intervene"] == long.meta["intervene"] == I.parse(spec, 3, 4).spec
        for layer in range(3):
            np.testing.assert_allclose(long.stats[layer]["discarded"], full.stat(layer, "discarded"), atol=1e-6)
            np.testing.assert_allclose(long.stats[layer]["alpha"], full.stat(layer, "alpha"), atol=2e-6, equal_nan=True)
        assert full.stat(2, "discarded").min() > 0  # the sink logit took mass in layer 2 only
        assert np.allclose(full.stat(0, "discarded"), 0, atol=1e-6)
        assert not np.allclose(full.layer_probs(1), plain.layer_probs(1))


def test_headwindow_is_the_global_mask_on_the_heads_it_names():
    """headwindow on every head is global(w=W, g=S) under FWD, and the heads it does not name keep FWD: maps and
    the layer's output both (the per-head mask enters the softmax, not only what is recorded)."""
    lm = loaded("llama")
    keep = Keep(storage_dtype=torch.float32)
    every = capture(lm, TEXT, Recipe.of(lm, "fwd", "headwindow(heads=0,1,2,3, s=2, w=5)"), keep)
    glob = capture(lm, TEXT, "global(w=5, g=2)*3", keep)
    for layer in range(3):
        np.testing.assert_allclose(every.layer_probs(layer), glob.layer_probs(layer), atol=1e-6)
    np.testing.assert_allclose(every.next_logprobs, glob.next_logprobs, atol=1e-5)
    some = capture(lm, TEXT, Recipe.of(lm, "fwd", "headwindow(heads=1,3, s=2, w=5)@0"), keep)
    plain = capture(lm, TEXT, "fwd", keep)
    np.testing.assert_allclose(some.layer_probs(0)[[0, 2]], plain.layer_probs(0)[[0, 2]], atol=1e-6)
    np.testing.assert_allclose(some.layer_probs(0)[[1, 3]], glob.layer_probs(0)[[1, 3]], atol=1e-6)
    assert not np.allclose(some.layer_probs(1), plain.layer_probs(1), atol=1e-4)  # layer 1 sees layer 0's change


def test_spec_is_canonical_and_round_trips():
    acts = I.parse(" SinkScale(beta=.3)@20-29 ;ablate(heads=3,0)@5, 7,6", 30, 9)
    assert acts.spec == "sinkscale(key=0, beta=0.3)@20-29; ablate(heads=0,3, how=zero)@5-7"
    assert I.parse(acts.spec, 30, 9) == acts
    assert [a.name for a in acts.at(5)] == ["ablate"] and acts.at(25)[0].beta == 0.3 and not acts.at(10)
    assert I.parse("temperature(t=2)", 30, 9).at(0)[0].layers is None
    assert not I.parse("none", 30, 9) and not I.parse("", 30, 9)


@pytest.mark.parametrize("spec,message", [
    ("sinkshift(beta=0.3)", "unknown intervention 'sinkshift'"),
    ("sinkscale(beta=0.3)@20-30", "layer 30 does not exist"),
    ("ablate(heads=0,9)", "head 9 does not exist"),
    ("sinkscale(beta=1.5)", "beta must be between 0 and 1"),
    ("temperature(t=0)", "t must be > 0"),
    ("temperature(tau=2)", "temperature takes t, not tau"),
    ("ablate(how=zero)", "ablate needs heads"),
    ("headwindow(heads=9)", "head 9 does not exist"),
    ("headwindow(heads=1, w=0)", "s >= 0 and w >= 1"),
    ("patch(block=ffn)", "block must be mlp, attn or embed"),
    ("patch(value=one)", "value must be zero or mean"),
    ("patch(tokens=first)", "tokens must be positions"),
    ("sinkscale(beta=x)", "beta must be a number"),
])
def test_bad_interventions_are_refused_clearly(spec, message):
    with pytest.raises(InputError, match=message):
        I.parse(spec, 30, 9)


def test_cli_intervene_and_bos(default_model, capsys):
    import json

    from test_cli import run, run_here

    from conftest import ENGLISH

    plain = json.loads(run_here(capsys, "sinks", "--text", ENGLISH, "--json").stdout)
    calm = run_here(capsys, "sinks", "--text", ENGLISH, "--intervene", "sinkscale(beta=0)@20-29", "--json")
    assert calm.returncode == 0, calm.stderr
    doc = json.loads(calm.stdout)
    assert doc["intervene"] == "sinkscale(key=0, beta=0)@20-29"
    top = [layer["sink_rate"]["0"] for layer in doc["layers"][20:]]
    assert max(top) == 0 and max(layer["sink_rate"]["0"] for layer in plain["layers"][20:]) > 0.5
    assert doc["layers"][5] == plain["layers"][5]  # untouched below layer 20
    bos = json.loads(run_here(capsys, "sinks", "--text", ENGLISH, "--bos", "--json").stdout)
    assert bos["prepend"] == "bos" and bos["n_tokens"] == plain["n_tokens"] + 1
    assert bos["tokens"][0] == default_model.tokenizer.bos_token
    ev = run_here(capsys, "eval", "--corpus", "stdlib:specialnames", "--max-tokens", "200", "--intervene",
                  "sinklogit(b=0)")
    assert ev.returncode == 0, ev.stderr
    assert json.loads(ev.stdout)["intervene"] == "sinklogit(b=0)"
    for args, message in [(["--intervene", "sinkshift(beta=1)"], "unknown intervention 'sinkshift'"),
                          (["--intervene", "ablate(heads=9)"], "head 9 does not exist"),
                          (["--intervene", "sinkscale(beta=2)@3"], "beta must be between 0 and 1"),
                          (["--intervene", "temperature(t=-1)"], "t must be > 0"),
                          (["--intervene", "sinkscale(beta=0.5)@40"], "layer 40 does not exist")]:
        bad = run("sinks", "--text", ENGLISH, *args)
        assert bad.returncode == 2 and message in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_perplexity_of_a_text_file_is_the_file_as_written(default_model, tmp_path):
    """`eval --text-file` scores the file verbatim, not its documents stripped and rejoined."""
    import json

    from attnviz.corpus import stdlib
    from attnviz.effects.evaluate import evaluate, token_ids
    from test_cli import run

    raw = "  " + stdlib("compound").text[:2500].replace("\n\n", "\n\n\n   ") + "\n\n"
    path = tmp_path / "compound.txt"
    path.write_text(raw, encoding="utf-8")
    out = run("eval", "--text-file", str(path), "--window", "128", "--stride", "128", "--max-tokens", "4096")
    assert out.returncode == 0, out.stderr
    verbatim = evaluate(default_model, token_ids(default_model, raw, 4096), "fwd", window=128, stride=128)
    doc = json.loads(out.stdout)
    assert doc["tokens"] == verbatim.tokens and abs(doc["perplexity"] - verbatim.perplexity) < 1e-4
    joined = "\n\n".join(d.strip() for d in raw.split("\n\n") if d.strip())
    assert token_ids(default_model, joined, 4096) != token_ids(default_model, raw, 4096)  # the old reading differs


def test_cli_intervene_on_capture_stream_and_generate(default_model, tmp_path):
    import json

    from attnviz.figures import export
    from attnviz.capture import Capture
    from attnviz.recipe import Recipe
    from attnviz.plan import Keep
    from test_cli import run

    spec = "sinkscale(beta=0.5)@25-29; ablate(heads=1)@3"
    canonical = "sinkscale(key=0, beta=0.5)@25-29; ablate(heads=1, how=zero)@3"
    cap = run("capture", "--text", "The cat sat on the mat.", "--intervene", spec, "--out", str(tmp_path / "c.npz"))
    assert cap.returncode == 0, cap.stderr
    assert json.loads(cap.stdout)["intervene"] == canonical
    saved = Capture.load(tmp_path / "c.npz")
    assert saved.meta["intervene"] == canonical
    meta = export.describe(saved, 29, 0)
    assert meta["intervene"] == canonical and "sinkscale" in export.filename(meta, "pdf")
    stream = run("stream", "--corpus", "stdlib:specialnames", "--max-tokens", "40", "--intervene", spec)
    assert stream.returncode == 0, stream.stderr
    assert json.loads(stream.stdout)["intervene"] == canonical
    gen = run("generate", "--text", "The lighthouse keeper", "--max-new-tokens", "3", "--intervene", spec)
    assert gen.returncode == 0, gen.stderr
    assert json.loads(gen.stdout)["intervene"] == canonical
