"""KV-cache compression what-if (docs/methods.md#kv-cache-compression): each press's scores against the formula on hand-made
attention, and the protocol against eval and a really compressed DynamicCache."""


import numpy as np
import pytest
import torch

from attnviz.errors import ArchitectureError, InputError
from attnviz.effects.evaluate import evaluate
from attnviz.kv import compress as C
from attnviz.kv import presses as P

from tiny import loaded

H, H_KV, N = 4, 2, 8


def _context(seed=0):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.ones(N, N, dtype=torch.bool).tril()
    scores = torch.randn(H, N, N, generator=g).masked_fill(~allowed, float("-inf"))
    return P.Context(3, torch.softmax(scores, -1), allowed, torch.randn(H_KV, N, 5, generator=g))


def test_observed_is_alpha_averaged_over_the_kv_group():
    c = _context()
    a = c.attention.numpy()
    alpha = np.stack([[a[h, k:, k].sum() / (N - k) for k in range(N)] for h in range(H)])  # FWD: sum_{i>=k} / (n-k)
    np.testing.assert_allclose(P.Observed().score(c).numpy(), alpha.reshape(H_KV, 2, N).mean(1), rtol=1e-6)


def _kvpress_pool(scores, kernel):
    """avg_pool1d(kernel, stride 1, padding kernel // 2) with zero padding counted, written out."""
    padded = np.pad(scores, ((0, 0), (kernel // 2, kernel // 2)))
    return np.stack([padded[:, j:j + kernel].mean(1) for j in range(scores.shape[1])], axis=1)


def test_snapkv_is_kvpress_snapkv():
    """kvpress presses/snapkv_press.py: attentions[..., -w:, :-w] (the window's keys cut off first), mean
    over the window's queries, pooled with zero padding, mean over the KV group, window keys = max + 1."""
    c = _context()
    window, kernel = 3, 3
    a = c.attention.numpy()
    observed = a[:, N - window:, :N - window].mean(1)  # (H, N - w)
    expected = _kvpress_pool(observed, kernel).reshape(H_KV, 2, N - window).mean(1)
    got = P.SnapKV(window=window, kernel=kernel).score(c).numpy()
    np.testing.assert_allclose(got[:, :N - window], expected, rtol=1e-6)
    np.testing.assert_allclose(got[:, N - window:], expected.max() + 1, rtol=1e-6)
    # the key just before the window averages in zero padding, not the window's own large attention
    all_keys = _kvpress_pool(a[:, N - window:, :].mean(1), kernel).reshape(H_KV, 2, N).mean(1)
    assert not np.allclose(got[:, N - window - 1], all_keys[:, N - window - 1])
    with pytest.raises(InputError, match="must be shorter than the context"):
        P.SnapKV(window=N, kernel=3).score(c)


def test_tova_is_kvpress_tova():
    """kvpress presses/tova_press.py: the last query's attention to the keys before it, mean over all
    heads; the last key scores max + 1, so it is always kept, even where its own weight is the smallest."""
    c = _context()
    last = c.attention[:, -1, :-1].mean(0).numpy()
    expected = np.concatenate([last, [last.max() + 1]])
    np.testing.assert_allclose(P.TOVA().score(c).numpy(), np.broadcast_to(expected, (H_KV, N)), rtol=1e-6)
    attention = c.attention.clone()
    attention[:, -1] = torch.tensor([0.3, 0.2, 0.2, 0.1, 0.1, 0.05, 0.05, 0.0])  # the last key gets nothing
    kept = P.TOVA().keep(P.Context(3, attention, c.allowed, c.keys), 0.5)
    assert kept[:, -1].all() and kept[0].tolist() == [True, True, True, False, False, False, False, True]


def test_tova_knorm_streaming_and_random():
    c = _context()
    np.testing.assert_allclose(P.KNorm().score(c).numpy(), -np.linalg.norm(c.keys.numpy(), axis=-1), rtol=1e-6)
    kept = P.Streaming(s=2).keep(c, 0.5)  # 4 of 8: the first 2 and the last 2
    assert kept[0].tolist() == [True, True, False, False, False, False, True, True]
    assert torch.equal(P.Random(seed=1).score(c), P.Random(seed=1).score(c))
    assert not torch.equal(P.Random(seed=1).score(c), P.Random(seed=2).score(c))


def test_keep_counts_as_kvpress_and_breaks_ties_to_the_lower_position():
    class Flat(P.Press):
        def score(self, context):
            return torch.zeros(H_KV, N)

    for ratio in (0.0, 0.25, 0.5, 0.9):
        kept = Flat().keep(_context(), ratio)
        count = int(N * (1 - ratio))  # kvpress ScorerPress.compress: n_kept = int(k_len * (1 - ratio))
        assert kept.sum(-1).tolist() == [count] * H_KV
        assert kept[0, :count].all()  # all tied: the first positions win
    assert P.kept_count(256, 0.9) == 25 and P.kept_count(256, 0.25) == 192 and P.kept_count(10, 0.0) == 10


def test_presses_are_registered_dataclasses_with_one_syntax():
    assert P.DEFAULTS == ["streaming(s=4)", "observed", "snapkv(window=64, kernel=5)", "tova", "knorm", "random(seed=0)"]
    assert P.parse("SnapKV( window=32 )").spec == "snapkv(window=32, kernel=5)"
    for text, message in [("snapkv(win=3)", "snapkv takes window, kernel, not win"), ("knorm(x=1)", "takes no parameters"),
                          ("streaming(s=0)", "must be positive"), ("random(seed=x)", "not a number"),
                          ("tova@3", "acts on every layer")]:
        with pytest.raises(InputError, match=message):
            P.parse(text)


TEXT = "The keeper climbed the stairs, lit the lamp, and watched the ships pass the rocks all night long."


def test_ratio_zero_equals_eval_of_the_same_continuation():
    lm = loaded("llama")
    ids = lm.tokenizer(TEXT)["input_ids"]
    context = 40
    result = C.compress(lm, ids, context, ["snapkv(window=8, kernel=3)", "streaming(s=2)"], ratios=[0.0, 0.5])
    ev = evaluate(lm, ids, "fwd", window=len(ids))
    scored = ev.token_nll[ev.positions >= context + 1]
    assert result.continuation == len(scored)
    assert abs(result.dense.nll - scored.mean()) < 1e-6
    for row in result.rows:
        if row.ratio == 0.0:
            assert abs(row.nll - result.dense.nll) < 1e-9 and row.kl == 0.0 and row.kept_key0 == 1.0
    streaming = [r for r in result.rows if r.press == "streaming(s=2)" and r.ratio == 0.5][0]
    assert streaming.kept_key0 == 1.0 and streaming.kl > 0


@pytest.mark.parametrize("press", ["snapkv(window=8, kernel=3)", "knorm", "observed"])
def test_a_really_compressed_cache_equals_the_masked_forward(press):
    lm = loaded("llama")  # 4 heads, 2 KV heads: the kept keys differ per KV head
    ids = lm.tokenizer(TEXT)["input_ids"]
    context = 40
    pre = C.prefill(lm, ids, context, "fwd")
    kept = {c.layer: P.parse(press).keep(c, 0.5) for c in pre.layers}
    masked = C._continuation(lm, ids, context, C.arch_mod.resolve("fwd", 3), kept)
    decoded = C.decode_compressed(lm, ids, context, kept)
    torch.testing.assert_close(decoded, masked, atol=1e-5, rtol=1e-5)
    dense = C._continuation(lm, ids, context, C.arch_mod.resolve("fwd", 3))
    assert (dense - masked).abs().max() > 1e-4  # compression changed something


@pytest.mark.parametrize("args,error,message", [
    (dict(ratios=[1.0]), InputError, "must be in \\[0, 1\\)"),
    (dict(ratios=[-0.1]), InputError, "must be in \\[0, 1\\)"),
    (dict(context=200), InputError, "must be shorter than the text"),
    (dict(context=20, presses=["snapkv(window=32)"]), InputError, "shorter than snapkv's window"),
    (dict(recipe="bidir"), ArchitectureError, "cannot compress a KV cache"),
    (dict(presses=["h2o"]), InputError, "unknown press 'h2o'"),
])
def test_bad_input(args, error, message):
    lm = loaded("llama")
    ids = lm.tokenizer(TEXT)["input_ids"]
    options = dict(context=40, presses=["observed"], ratios=[0.5]) | args
    with pytest.raises(error, match=message):
        C.compress(lm, ids, **options)


def test_cli_compress(default_model):
    import json

    from test_cli import run

    out = run("compress", "--corpus", "stdlib:specialnames", "--context", "96", "--max-tokens", "160",
              "--press", "streaming(s=4)", "--press", "snapkv(window=32, kernel=5)", "--ratios", "0,0.5", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert set(doc) == {"model", "arch", "context", "continuation", "dense", "presses"}
    assert doc["context"] == 96 and doc["continuation"] == 160 - 96 - 1
    assert [(p["press"], p["ratio"]) for p in doc["presses"]] == [
        ("streaming(s=4)", 0.0), ("streaming(s=4)", 0.5), ("snapkv(window=32, kernel=5)", 0.0),
        ("snapkv(window=32, kernel=5)", 0.5)]
    assert doc["presses"][0]["perplexity"] == doc["dense"]["perplexity"] and doc["presses"][1]["kept_key0"] == 1.0
    for args, message in [(["--ratios", "0.5,1"], "must be in [0, 1)"), (["--context", "400"], "shorter than the text"),
                          (["--context", "16"], "shorter than snapkv's window"), (["--press", "h2o"], "unknown press"),
                          (["--arch", "bidir"], "cannot compress a KV cache")]:
        bad = run("compress", "--corpus", "stdlib:specialnames", "--max-tokens", "160", *args)
        assert bad.returncode == 2 and message in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_effects_page_kv_compression_section(model_cache, tmp_path):
    from test_app import app_test, charts, on_page, texts

    at = app_test(tmp_path)
    at.run()
    on_page(at, "pages/effects.py")
    at.radio(key="fx_section").set_value("KV compression").run()
    at.selectbox(key="fx_kv_source").set_value("Python docs: special method names").run()
    at.number_input(key="fx_kv_context").set_value(72).run()  # longer than snapkv's window
    at.number_input(key="fx_kv_tokens").set_value(128).run()
    at.multiselect(key="fx_kv_presses").set_value(["streaming(s=4)", "snapkv(window=64, kernel=5)", "knorm"]).run()
    at.text_input(key="fx_kv_ratios").input("0, 0.5, 0.9").run()
    assert not at.error, texts(at.error)
    at.button(key="fx_kv_run").click().run()
    assert not at.exception and not at.error, texts(at.error)
    curves, kept = charts(at)[:2]
    assert [c["name"] for c in curves["data"] if c["type"] == "scatter"] == ["streaming(s=4)",
                                                                           "snapkv(window=64, kernel=5)", "knorm"]
    titles = [a["text"] for a in kept["layout"]["annotations"]]
    assert titles[0] == "streaming(s=4) · key 0 kept"  # the sink is visibly kept (or not) by each press
    at.text_input(key="fx_kv_ratios").input("0.5, 1.5").run()
    assert "must be in [0, 1)" in texts(at.error)
