"""Contributions (docs/methods.md#contributions) against a direct computation from stock transformers: eager
attention's own probabilities (``output_attentions``), values and streams read with hooks written here by hand for
each family, every (query, source, head) write made out in full and measured with the L1 distance."""

import os

import numpy as np
import pytest
import torch

import tiny
from attnviz.flow import contributions
from attnviz.flow.trace import trace

TEXT = "The cat sat on the mat and looked at the door."
# the module whose input is the stream after attention, and the post-norm (its input is the attention's output)
MID = {"gemma3_text": "pre_feedforward_layernorm", "olmo2": "mlp", "phi": None}
POST = {"gemma3_text": ("post_attention_layernorm", 1.0), "olmo2": ("post_attention_layernorm", 0.0)}
SCALE = {"granite": 0.5}


def _first(value):
    return (value[0] if isinstance(value, tuple) else value)[0].float()


@torch.no_grad()
def stock(model, ids, family):
    """Per layer: (residual (n,), heads (n, n, H), mlp (n,), mlp residual (n,)) written out in full."""
    seen, hooks = {}, []
    layers = model.model.layers
    for l, layer in enumerate(layers):
        put = lambda name, l=l: (lambda m, a, *o: seen.__setitem__((name, l), _first(o[0] if o else a[0])))  # noqa: E731
        hooks += [layer.register_forward_pre_hook(put("x")), layer.register_forward_hook(put("out")),
                  layer.self_attn.v_proj.register_forward_hook(put("v")),
                  layer.self_attn.register_forward_hook(put("attn"))]
        mid = MID.get(family, "post_attention_layernorm")
        if mid:
            hooks.append(getattr(layer, mid).register_forward_pre_hook(put("y")))
        if family in POST:
            hooks.append(getattr(layer, POST[family][0]).register_forward_pre_hook(put("o")))
    try:
        output = model(torch.tensor([ids]), output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    config = model.config
    n_heads, width = config.num_attention_heads, config.hidden_size
    out = []
    for l, layer in enumerate(layers):
        attn = layer.self_attn
        probs = output.attentions[l][0].float()  # (H, n, n)
        n = probs.shape[-1]
        o_proj = attn.dense if family == "phi" else attn.o_proj
        d = o_proj.weight.shape[1] // n_heads
        v = seen["v", l].view(n, -1, d)  # (n, H_kv, d)
        group = n_heads // v.shape[1]
        x = seen["x", l]
        y = seen["y", l] if ("y", l) in seen else x + seen["attn", l]  # parallel: the stream after attention alone
        w = o_proj.weight.float().view(width, n_heads, d)
        c = torch.full((n,), SCALE.get(family, 1.0))
        gain = torch.ones(width)
        if family in POST:
            norm = getattr(layer, POST[family][0])
            o = seen["o", l]
            c = c * torch.rsqrt(o.pow(2).mean(-1) + getattr(norm, "variance_epsilon", getattr(norm, "eps", None)))
            gain = norm.weight.float() + POST[family][1]
        writes = torch.einsum("hqk,q,khd,xhd->hqkx", probs, c, v.repeat_interleave(group, 1), w * gain[:, None, None])
        parts = torch.cat([x[None], writes.permute(0, 2, 1, 3).reshape(-1, n, width)])  # residual, then (h, k) rows
        got = contributions.proximity(parts, y)  # (1 + H n, n)
        heads = got[1:].view(n_heads, n, n).permute(2, 1, 0)  # (q, k, h)
        mlp = contributions.proximity(torch.stack((seen["out", l] - y, y)), seen["out", l])
        out.append((got[0], heads, mlp[0], mlp[1]))
    return out


def _compare(flow, expected, tol=1e-4):
    n = flow.n_tokens
    for l, (residual, heads, mlp, mlp_residual) in enumerate(expected):
        layer = flow.layers[l]
        np.testing.assert_allclose(layer.attn_residual, residual.numpy(), atol=tol, err_msg=f"layer {l} residual")
        np.testing.assert_allclose(layer.dense(flow.n_heads, n), heads.numpy(), atol=tol, err_msg=f"layer {l} heads")
        np.testing.assert_allclose(layer.mlp, mlp.numpy(), atol=tol, err_msg=f"layer {l} MLP")
        np.testing.assert_allclose(layer.mlp_residual, mlp_residual.numpy(), atol=tol)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "olmo2", "phi", "granite", "gpt_oss", "qwen2"])
def test_contributions_equal_the_written_out_definition(family):
    loaded = tiny.loaded(family)
    stock_model = tiny.build(family)
    flow = trace(loaded, TEXT, floor=0.0)
    _compare(flow, stock(stock_model, flow.token_ids, family))


def test_contributions_of_the_default_model(default_model):
    from transformers import AutoModelForCausalLM

    flow = trace(default_model, TEXT, floor=0.0)
    stock_model = AutoModelForCausalLM.from_config(default_model.model.config, attn_implementation="eager",
                                                   dtype=torch.float32)
    stock_model.load_state_dict(default_model.model.state_dict())
    _compare(flow, stock(stock_model.eval(), flow.token_ids, "llama"))


def test_each_sum_adds_up_to_one():
    flow = trace(tiny.loaded("llama"), TEXT, floor=0.0)
    for layer in flow.layers:
        total = layer.dense(flow.n_heads, flow.n_tokens).sum((1, 2)) + layer.attn_residual
        np.testing.assert_allclose(total, 1.0, atol=1e-5)
        np.testing.assert_allclose(layer.mlp + layer.mlp_residual, 1.0, atol=1e-5)


# the GPU's Triton pass runs here in Triton's interpreter (tests/conftest.py); on a GPU machine Triton compiles, and
# tests/test_cuda.py runs it there on CUDA tensors
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
PATHS = [contributions.attention_raw_torch, contributions.attention_raw_compiled,
         pytest.param(contributions.attention_raw_triton, marks=pytest.mark.skipif(
             not INTERPRETED, reason="Triton compiles for the GPU here: tests/test_cuda.py"))]
IDS = ["torch", "compiled", "triton"]


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_the_fast_path_equals_the_definition_where_parts_outweigh_the_stream(path):
    """Parts that pass the stream in some dimensions (the exact correction's case), many queries at once."""
    gen = torch.Generator().manual_seed(1)
    n, heads, kv, d, width = 40, 4, 2, 8, 16
    y = torch.randn(n, width, generator=gen) * 0.3
    probs = torch.softmax(torch.randn(heads, n, n, generator=gen) * 3, -1)
    value = torch.randn(kv, n, d, generator=gen) * 2
    w_out = torch.randn(heads, width, d, generator=gen)
    c = torch.rand(n, generator=gen) + 0.5
    fast = path(y, probs, value, w_out, c)
    written = torch.einsum("hqk,q,hkd,hxd->hqkx", probs, c, value.repeat_interleave(2, 0), w_out)
    direct = contributions.raw_part(written, y[None, :, None, :])
    assert (direct > 0).any() and ((written.abs() > y[None, :, None].abs()).sum() > 100)
    torch.testing.assert_close(fast, direct, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_every_tier_of_the_exact_correction_equals_the_definition(path):
    """Rows flat enough that the bound sends some (query, dimension) pairs past the 4, 16 and 64 heaviest keys to
    every key: each tier is taken, and the result is still the written-out definition."""
    gen = torch.Generator().manual_seed(2)
    n, heads, d, width = 150, 3, 8, 24
    y = torch.randn(n, width, generator=gen) * 0.05
    probs = torch.softmax(torch.randn(heads, n, n, generator=gen) * torch.tensor([0.3, 2.0, 6.0])[:, None, None], -1)
    value = torch.randn(heads, n, d, generator=gen) * 3
    w_out = torch.randn(heads, width, d, generator=gen)
    c = torch.rand(n, generator=gen) + 0.5
    a = probs * c[None, :, None]
    written = torch.einsum("hkd,hxd->hkx", value, w_out)  # (H, n, D): each source's write
    bound = torch.where(y[None] >= 0, written.amax(1)[:, None, :], -written.amin(1)[:, None, :])  # (H, n, D)
    ranked = a.sort(-1, descending=True).values
    for rank in (contributions.TOP, *contributions.WIDER):  # some pair needs the tier past each
        assert (ranked[..., rank, None] * bound > y.abs()[None]).any(), rank
    fast = path(y, probs, value, w_out, c)
    parts = torch.einsum("hqk,q,hkd,hxd->hqkx", probs, c, value, w_out)
    torch.testing.assert_close(fast, contributions.raw_part(parts, y[None, :, None, :]), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 33])
@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_the_correction_under_a_causal_mask_zero_streams_and_few_keys(path, n):
    """Rows with fewer keys than the heaviest-key tiers, masked keys (zero weight), dimensions where the stream is
    exactly zero (every part along either sign passes it) and ties in weight: still the written-out definition."""
    gen = torch.Generator().manual_seed(n)
    heads, d, width = 3, 4, 12
    y = torch.randn(n, width, generator=gen) * 0.2
    y[:, ::4] = 0.0
    scores = torch.randn(heads, n, n, generator=gen) * 2
    scores[1] = 0.0  # ties: a flat row
    probs = torch.softmax(scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf")), -1)
    value = torch.randn(1, n, d, generator=gen) * 2
    w_out = torch.randn(heads, width, d, generator=gen)
    c = torch.rand(n, generator=gen) + 0.5
    parts = torch.einsum("hqk,q,hkd,hxd->hqkx", probs, c, value.expand(heads, n, d), w_out)
    torch.testing.assert_close(path(y, probs, value, w_out, c), contributions.raw_part(parts, y[None, :, None, :]),
                               atol=1e-4, rtol=1e-5)


def test_the_cpu_runs_the_compiled_correction_where_the_requirements_are_installed(monkeypatch):
    """numba is a requirement: on the CPU in float32, attention_raw takes the compiled loop, not the gathers."""
    assert contributions._kernel() is not None
    called = []
    monkeypatch.setattr(contributions, "attention_raw_torch", lambda *a: called.append(a))
    y, probs = torch.randn(4, 8), torch.softmax(torch.randn(2, 4, 4), -1)
    out = contributions.attention_raw(y, probs, torch.randn(1, 4, 2), torch.randn(2, 8, 2), torch.ones(4))
    assert out.shape == (2, 4, 4) and not called
    contributions.attention_raw(y.double(), probs.double(), torch.randn(1, 4, 2).double(),
                                torch.randn(2, 8, 2).double(), torch.ones(4).double())
    assert called  # float64: the torch path


ROUTES = ["cpu", pytest.param("gpu", marks=pytest.mark.skipif(
    not INTERPRETED, reason="Triton compiles for the GPU here: tests/test_cuda.py"))]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("layer", [1, -1])
@pytest.mark.parametrize("shift", [0.5, 0.05])
def test_a_head_output_that_is_not_its_weighted_values_is_refused(shift, layer, route, monkeypatch):
    """A family whose heads write something besides their probabilities times their values (here: a hook on the
    output projection moves one head's output) cannot be split by source token: routes refuse it, naming the layer,
    also when the change is small (the check along fixed random directions sees it), on the CPU's route and on the
    GPU's (which reads a layer's checks while the next one runs, the last layer's after the forward)."""
    from attnviz.core.model.modules import output_linear
    from attnviz.errors import InputError

    if route == "gpu":
        monkeypatch.setattr(contributions, "on_gpu", lambda tensor: True)
    lm = tiny.loaded("llama")
    layer = layer % lm.n_layers
    attn = lm.model.model.layers[layer].self_attn
    d = attn.head_dim

    def move(module, args):
        z = args[0].clone()
        z[..., :d] += shift * z[..., :d].abs().amax()
        return (z,)

    handle = output_linear(attn).register_forward_pre_hook(move)
    try:
        with pytest.raises(InputError, match=f"layer {layer}: .*their probabilities times their values.*cannot be "
                                             "split by source token"):
            trace(lm, TEXT)
    finally:
        handle.remove()
    assert trace(lm, TEXT).n_layers == lm.n_layers  # without the hook it runs


@pytest.mark.parametrize("n_kv", [1, 7, 64])
def test_the_compiled_collection_keeps_what_the_torch_one_keeps(n_kv):
    """Normalised entries at or above the floor, per head and heads summed: the compiled pass and torch's agree in
    indices, order and weights (ties with the floor included)."""
    gen = torch.Generator().manual_seed(n_kv)
    raw = torch.rand(3, 20, n_kv, generator=gen) ** 4
    raw[0, 0, 0] = 0.25  # exactly the floor after scaling by 1/5... below: an entry equal to it
    inv = torch.rand(20, generator=gen) * 0.2
    inv[0], inv[1] = 0.02, 0.0  # 0.25 * 0.02 = 0.005; a zero stream keeps nothing
    got = contributions.kept_entries(raw.clone(), inv, 0.005)
    want = contributions.kept_entries_torch(raw.clone(), inv, 0.005)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert len(want[0]) > 3 and (want[0] == [0, 0, 0]).all(1).any()


@pytest.mark.parametrize("arch", ["fwd", "bidir", "mask0-bidir(k=2)", "nosink-fwd", "sliding(w=4)", "fwd+bidir+sliding(w=3)"])
def test_the_layer_assembled_from_narrowed_blocks_equals_the_whole_layer(monkeypatch, arch):
    """The probabilities come block by block with only the keys some of their rows may see, into a layer buffer
    reused from layer to layer: with several blocks a layer, under causal, bidirectional, sink-shifting and
    windowed masks, every layer's contributions equal those from the whole layer in one block with every key."""
    import importlib

    from attnviz.core.model import devices

    trace_mod = importlib.import_module("attnviz.flow.trace")
    lm = tiny.loaded("llama")
    with monkeypatch.context() as m:  # the reference: the layer in one block, every key
        m.setattr(trace_mod._Probs, "whole_layer", True)
        m.setattr(trace_mod._Probs, "all_keys", True)
        whole = trace(lm, TEXT, arch, floor=0.0)
    monkeypatch.setattr(devices, "block_bytes", lambda device: 4 * 4 * 6 * len(TEXT))  # a few rows a block
    seen = []
    block = trace_mod._Probs.block
    monkeypatch.setattr(trace_mod._Probs, "block", lambda self, run, layer, q0, k0, probs, allow: (
        seen.append((layer, q0, k0, probs.shape[-1])), block(self, run, layer, q0, k0, probs, allow)))
    blocks = trace(lm, TEXT, arch, floor=0.0)
    assert len({(layer, q0) for layer, q0, _, _ in seen}) > 2 * lm.n_layers  # several blocks a layer
    if arch in ("fwd", "sliding(w=4)"):
        assert any(k0 + width < len(blocks.tokens) for _, _, k0, width in seen)  # keys narrowed
    for a, b in zip(whole.layers, blocks.layers):
        np.testing.assert_allclose(a.dense(lm.n_heads, whole.n_tokens), b.dense(lm.n_heads, blocks.n_tokens), atol=1e-6)
        np.testing.assert_allclose(a.attn_residual, b.attn_residual, atol=1e-6)


@pytest.mark.parametrize("arch", ["fwd", "mask0-bidir(k=2)", "sliding(w=5)"])
def test_the_torch_path_a_gpu_runs_equals_the_compiled_path_end_to_end(monkeypatch, arch):
    """What a GPU (or a machine without numba) runs: torch's gathers for the correction and torch's collection.
    On the CPU, forced, every layer's contributions equal the compiled path's."""
    lm = tiny.loaded("llama")
    compiled = trace(lm, TEXT, arch, floor=0.0)
    monkeypatch.setattr(contributions, "_kernel", lambda: None)
    plain = trace(lm, TEXT, arch, floor=0.0)
    for a, b in zip(compiled.layers, plain.layers):
        np.testing.assert_allclose(a.dense(lm.n_heads, compiled.n_tokens), b.dense(lm.n_heads, plain.n_tokens),
                                   atol=1e-5)
        np.testing.assert_array_equal(a.sum_index, b.sum_index)
        np.testing.assert_allclose(a.sum_weight, b.sum_weight, atol=1e-5)


def test_the_torch_path_waits_for_the_device_once_a_tier_not_once_a_head(monkeypatch):
    """What a GPU runs (no device here: counted on the CPU): every head's rows go through each tier together, so the
    data-dependent ``nonzero`` (a device sync on CUDA) runs once a layer whatever the number of heads, and the result
    is the written-out definition."""
    calls = []
    real = torch.nonzero

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "nonzero", counting)
    counts = {}
    for heads in (2, 8):
        gen = torch.Generator().manual_seed(3)
        n, d, width = 60, 8, 16
        y = torch.randn(n, width, generator=gen) * 0.1
        probs = torch.softmax(torch.randn(heads, n, n, generator=gen) * 0.5, -1)
        value = torch.randn(heads, n, d, generator=gen) * 3
        w_out = torch.randn(heads, width, d, generator=gen)
        c = torch.rand(n, generator=gen) + 0.5
        calls.clear()
        fast = contributions.attention_raw_torch(y, probs, value, w_out, c)
        counts[heads] = len(calls)
        parts = torch.einsum("hqk,q,hkd,hxd->hqkx", probs, c, value, w_out)
        torch.testing.assert_close(fast, contributions.raw_part(parts, y[None, :, None, :]), atol=1e-4, rtol=1e-5)
    assert counts[2] == counts[8] == 1


def test_the_correction_is_the_same_in_any_chunking_and_a_gpu_takes_bigger_chunks(monkeypatch):
    """The torch path's correction made a few rows at a time (a small chunk: many launches) or all at once (a GPU's
    chunk, where launches bound the time) gives the same numbers, the written-out definition's."""
    gen = torch.Generator().manual_seed(4)
    heads, n, d, width = 3, 50, 8, 16
    y = torch.randn(n, width, generator=gen) * 0.1
    probs = torch.softmax(torch.randn(heads, n, n, generator=gen) * 0.5, -1)
    value = torch.randn(heads, n, d, generator=gen) * 3
    w_out = torch.randn(heads, width, d, generator=gen)
    c = torch.rand(n, generator=gen) + 0.5
    parts = torch.einsum("hqk,q,hkd,hxd->hqkx", probs, c, value, w_out)
    expected = contributions.raw_part(parts, y[None, :, None, :])
    scatters = []
    real = torch.Tensor.scatter_add_
    monkeypatch.setattr(torch.Tensor, "scatter_add_", lambda self, *a: scatters.append(1) or real(self, *a))
    results = {}
    for floats in (contributions.TOP * width * 7, contributions.DEVICE_CANDIDATES):
        monkeypatch.setattr(contributions, "CANDIDATES", floats)
        scatters.clear()
        results[floats] = contributions.attention_raw_torch(y, probs, value, w_out, c)
        torch.testing.assert_close(results[floats], expected, atol=1e-4, rtol=1e-5)
        assert len(scatters) == -(-heads * n // max(1, floats // (contributions.TOP * width)))  # first-tier chunks
    small, big = results.values()
    torch.testing.assert_close(small, big, atol=1e-6, rtol=1e-6)
    assert contributions.chunk_floats(torch.device("cpu")) == contributions.CANDIDATES
    assert contributions.chunk_floats(torch.device("cuda")) == contributions.DEVICE_CANDIDATES
