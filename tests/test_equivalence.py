"""The FWD architecture reproduces stock eager attention; other masks change only what they should."""

import threading

import numpy as np
import pytest
import torch

from attnviz.core import engine
from attnviz.core.record import recorders
from attnviz.core.spec import masks as M
from attnviz.core.spec.arch import parse
from attnviz.capture import capture
from attnviz.errors import ModelLoadError

from tiny import ARCHS, loaded, pair

N = 12


def _ids(n=N, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 90, (1, n), generator=g)


@pytest.mark.parametrize("kind", ARCHS)
def test_fwd_reproduces_stock_eager(kind):
    stock, ours = pair(kind)
    ids = _ids()
    with torch.no_grad():
        ref = stock(input_ids=ids, output_attentions=True)
    out, run = engine.forward(ours, ids, list(parse("fwd", 3).layers), engine.Record(storage_dtype=torch.float32))
    assert (out.logits - ref.logits).abs().max().item() <= 1e-5
    for layer, ref_probs in enumerate(ref.attentions):
        assert (run.probs[layer] - ref_probs).abs().max().item() <= 1e-5, f"layer {layer}"
    if kind == "gpt_oss":  # the learned sink takes real mass: rows sum to < 1, as in stock
        sums = run.probs[0].sum(-1)
        assert sums.max().item() < 0.999 and torch.allclose(sums, ref.attentions[0].sum(-1), atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen2", "gemma2", "mistral"])
def test_model_sliding_window_is_kept(kind):
    _, ours = pair(kind)
    _, run = engine.forward(ours, _ids(), list(parse("fwd", 3).layers), engine.Record(storage_dtype=torch.float32))
    window = {"qwen2": 4, "gemma2": 4, "mistral": 5}[kind]
    sliding_layers = [l for l in range(3) if getattr(ours.model.layers[l].self_attn, "sliding_window", None)
                      or kind == "mistral"]
    assert sliding_layers
    i, j = np.indices((N, N))
    for layer in sliding_layers:
        allowed = run.allowed[layer].whole()[0, 0].numpy()
        np.testing.assert_array_equal(allowed, (j <= i) & (i - j < window))
        assert (run.probs[layer][0][:, ~allowed] == 0).all()


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_model_window_bounds_only_causal_type_layers(kind):
    """docs/methods.md#per-layer-architectures: BIDIR/BACK layers see the whole sequence; causal-type layers keep the model's window."""
    _, ours = pair(kind)
    window = {"qwen2": 4, "mistral": 5}[kind]
    layer = 2  # a sliding layer in both (qwen2 slides from max_window_layers=1 up)
    i, j = np.indices((N, N))
    expected = {"bidir": np.ones((N, N), bool), "back": j >= i,
                "nosink-fwd": (j <= i) & (i - j < window) & ~((j < 1) & (i > j)),
                "stablemask(gamma=0.5)": (j <= i) & (i - j < window)}
    for spec, allowed in expected.items():
        masks = [M.fwd()] * 2 + [parse(spec, 3).layers[0]]
        _, run = engine.forward(ours, _ids(), masks, engine.Record(layers=frozenset({layer}), storage_dtype=torch.float32))
        np.testing.assert_array_equal(run.allowed[layer].whole()[0, 0].numpy(), allowed, err_msg=spec)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_changing_one_layer_changes_only_that_layer_and_above(kind):
    _, ours = pair(kind)
    ids = _ids()
    base, _ = engine.forward(ours, ids, [M.fwd()] * 3, engine.Record(), engine.Feed(hidden_states=True))
    changed, _ = engine.forward(ours, ids, [M.fwd(), M.bidir(), M.fwd()], engine.Record(), engine.Feed(hidden_states=True))
    # hidden_states[l] is the input of layer l; [l + 1] its output
    for l in (0, 1):
        assert torch.equal(base.hidden_states[l], changed.hidden_states[l]), f"hidden {l} changed"
    assert (base.hidden_states[2] - changed.hidden_states[2]).abs().max().item() > 1e-4
    # BIDIR lets early queries see later keys: token 0's state changes too
    assert (base.hidden_states[2][0, 0] - changed.hidden_states[2][0, 0]).abs().max().item() > 1e-4


def test_unrecorded_layers_run_through_sdpa_and_match():
    _, ours = pair("llama")
    ids = _ids()
    arch = list(parse("mask0-bidir(k=2)", 3).layers)
    full, run_full = engine.forward(ours, ids, arch)
    one, run_one = engine.forward(ours, ids, arch, engine.Record(layers=frozenset({2})))
    assert set(run_one.probs) == {2}
    assert (full.logits - one.logits).abs().max().item() <= 1e-5
    assert torch.equal(run_full.probs[2], run_one.probs[2])


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_does_not_move_masks(side):
    """NoSink and global tokens mean the same with left or right padding: real tokens get identical maps."""
    _, ours = pair("llama")
    short, long_ = _ids(7, seed=2), _ids(N, seed=3)
    masks = list(parse("nosink-fwd(m=2) * 1 + global(w=2, g=1) * 1 + nosink-bidir * 1", 3).layers)
    pad = torch.zeros(1, N - 7, dtype=torch.long)
    batch = torch.cat([torch.cat([pad, short], 1) if side == "left" else torch.cat([short, pad], 1), long_])
    attention = torch.ones_like(batch)
    if side == "left":
        attention[0, : N - 7] = 0
    else:
        attention[0, 7:] = 0
    _, batched = engine.forward(ours, batch, masks, engine.Record(storage_dtype=torch.float32), engine.Feed(attention_mask=attention))
    _, alone = engine.forward(ours, short, masks, engine.Record(storage_dtype=torch.float32))
    real = slice(N - 7, N) if side == "left" else slice(0, 7)
    for layer in range(3):
        got = batched.probs[layer][0][:, real, real]
        assert (got - alone.probs[layer][0]).abs().max().item() <= 1e-5, f"layer {layer}"
        assert (batched.probs[layer][0][:, real, :].sum(-1) - 1).abs().max().item() <= 1e-5  # no mass on pads
        np.testing.assert_array_equal(batched.allowed[layer].whole()[0, 0][real, real].numpy(),
                                      masks[layer].matrix(7))


def test_stablemask_closed_form():
    """Future entries exactly 0; row i sums to S_i / (S_i + sum_{j>i} exp(-gamma j)) (docs/methods.md#stablemask)."""
    torch.manual_seed(0)
    n, heads, dim, gamma = 6, 2, 4, 0.7
    query, key, value = torch.randn(1, heads, n, dim), torch.randn(1, heads, n, dim), torch.randn(1, heads, n, dim)
    module = type("Attn", (), {"layer_idx": 0})()
    mask = M.stablemask(gamma)
    pos = torch.arange(n)[None]
    run = engine.Run([mask], frozenset({0}), pos, torch.ones(1, n, dtype=torch.bool),
                     recorders=recorders.for_record(engine.Record(storage_dtype=torch.float32)))
    with engine.active(run):
        engine.attention(module, query, key, value, None, scaling=dim ** -0.5)
    probs = run.probs[0][0]
    assert (torch.triu(probs, 1) == 0).all()
    scores = (query @ key.transpose(-1, -2))[0] * dim ** -0.5
    for i in range(n):
        s_i = scores[:, i, : i + 1].exp().sum(-1)
        pseudo = sum(np.exp(-gamma * j) for j in range(i + 1, n))
        torch.testing.assert_close(probs[:, i].sum(-1), s_i / (s_i + pseudo), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(probs[:, -1].sum(-1), torch.ones(heads))


def test_two_threads_on_one_model_match_serial_runs():
    lm = loaded("qwen2")
    text = "attention sinks everywhere"
    specs = ["fwd", "nosink-bidir(m=2)", "mask0-bidir(k=2)", "stablemask(gamma=0.5)"] * 2
    serial = {s: capture(lm, text, s) for s in specs[:4]}
    results, errors = {}, []

    def work(i, spec):
        try:
            for _ in range(3):
                results[(i, spec)] = capture(lm, text, spec)
        except Exception as err:  # surfaced by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i, s)) for i, s in enumerate(specs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for (i, spec), got in results.items():
        for layer in range(3):
            np.testing.assert_array_equal(got.probs[layer], serial[spec].probs[layer])


def test_outside_a_run_the_model_is_stock():
    stock, ours = pair("gemma2")
    engine.prepare(ours)
    ids = _ids()
    with torch.no_grad():
        assert (stock(input_ids=ids).logits - ours(input_ids=ids).logits).abs().max().item() <= 1e-5


def test_models_that_bypass_the_interface_are_refused():
    from transformers import BloomConfig, AutoModelForCausalLM

    bloom = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=50, hidden_size=16, n_layer=1, n_head=2))
    with pytest.raises(ModelLoadError, match="AttentionInterface"):
        engine.prepare(bloom)


def test_gqa_heads_are_not_repeated_and_groups_recorded():
    lm = loaded("llama")  # 4 query heads on 2 KV heads
    cap = capture(lm, "grouped query attention", "fwd")
    assert cap.kv_groups == [0, 0, 1, 1]
    assert cap.probs[0].shape == (4, len("grouped query attention"), len("grouped query attention"))


@pytest.mark.parametrize("spec", ["stablemask(gamma=0.5)", "stablemask(slopes=alibi)"])
def test_sm_i_at_n_equal_t_is_stablemask(spec):
    """docs/methods.md#stablemask: SM-I's one logit per row carries exactly the pseudo-slots StableMask has at n = T."""
    _, ours = pair("llama")
    ids = _ids()
    full_arch = list(parse(spec, 3).layers)
    sm_i = list(parse(spec[:-1] + f", T={N})", 3).layers)
    full, run_full = engine.forward(ours, ids, full_arch, engine.Record(storage_dtype=torch.float32))
    inf, run_inf = engine.forward(ours, ids, sm_i, engine.Record(storage_dtype=torch.float32))
    for layer in range(3):
        torch.testing.assert_close(run_inf.probs[layer], run_full.probs[layer], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(inf.logits, full.logits, atol=1e-5, rtol=1e-5)
    shorter, _ = engine.forward(ours, ids[:, :8], sm_i, engine.Record(storage_dtype=torch.float32))
    longer_t = list(parse(spec[:-1] + f", T={N + 4})", 3).layers)
    other, _ = engine.forward(ours, ids, longer_t, engine.Record(storage_dtype=torch.float32))
    assert (other.logits - full.logits).abs().max() > 1e-4  # T matters; n does not
    torch.testing.assert_close(shorter.logits[0, :8], inf.logits[0, :8], atol=1e-5, rtol=1e-5)


def test_sm_i_streams_with_a_kv_cache_and_refuses_text_past_t():
    from attnviz.errors import InputError
    from attnviz.effects.evaluate import evaluate
    from attnviz.effects.streaming import stream

    lm = loaded("llama")
    ids = _ids(16)[0].tolist()
    spec = "stablemask(gamma=0.3, T=20)"
    np.testing.assert_allclose(stream(lm, ids, "dense", spec).token_nll, evaluate(lm, ids, spec, window=16).token_nll,
                               atol=1e-4)
    with pytest.raises(InputError, match="at most T=20 tokens but the text reaches 24"):
        evaluate(lm, _ids(24)[0].tolist(), spec, window=24)
