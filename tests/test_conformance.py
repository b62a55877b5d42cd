"""The conformance matrix: every capability on every decoder family, on tiny random configs in float32, against
stock transformers with hand-written hooks (docs/support.md is generated from the same checks).

Where each family's blocks write into the residual stream is written out by hand here (``WRITES``), from reading
each family's modeling code, not read from attnviz: the anatomy must find the same modules.
"""

import re

import numpy as np
import pytest
import torch

from attnviz import regions
from attnviz import recipe as recipe_mod
from attnviz.capture import capture
from attnviz.core.model import anatomy
from attnviz.core import engine
from attnviz.core.loading.models import LoadedModel
from attnviz.plan import Keep
from attnviz.recipe import Recipe
from attnviz.stats import metrics

import tiny
from tiny import FAMILIES, CharTokenizer, pair

TEXT = "The keeper lit the lamp at dusk, and watched."
FULL = Keep(storage_dtype=torch.float32)
# (attention's write, MLP's write) as each family's decoder layer adds them to the residual stream
POST_NORMS = {"gemma2": ("post_attention_layernorm", "post_feedforward_layernorm"),
              "gemma3_text": ("post_attention_layernorm", "post_feedforward_layernorm"),
              "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm"),
              "olmo3": ("post_attention_layernorm", "post_feedforward_layernorm"),
              "exaone4": ("post_attention_layernorm", "post_feedforward_layernorm"),
              "glm4": ("post_self_attn_layernorm", "post_mlp_layernorm")}
WRITES = {"gpt2": ("attn", "mlp"), "gpt_neox": ("attention", "mlp"), **POST_NORMS}
PARALLEL = {"gpt_neox", "phi", "cohere2"}  # attention and MLP read the same input


def _layers(model, kind):
    return {"gpt2": lambda: model.transformer.h, "gpt_neox": lambda: model.gpt_neox.layers}.get(
        kind, lambda: model.model.layers)()


def _stock_write(model, kind, block, layer):
    attn, mlp = WRITES.get(kind, ("self_attn", "mlp"))
    return getattr(_layers(model, kind)[layer], attn if block == "attn" else mlp)


def _pair(kind):
    stock, ours = pair(kind)
    return stock, LoadedModel(ours, CharTokenizer(), f"tiny-{kind}", None, 0.0)


def _stock(stock, ids, hook=None, module=None):
    handle = module.register_forward_hook(hook) if hook else None
    try:
        with torch.no_grad():
            return stock(input_ids=torch.tensor([ids]), output_attentions=True)
    finally:
        if handle:
            handle.remove()


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_anatomy_finds_the_modules_written_out_by_hand(kind):
    stock, lm = _pair(kind)
    found = anatomy.of(lm.model)
    for layer in found.layers:
        assert layer.attn_write is _stock_write(lm.model, kind, "attn", layer.index)
        assert layer.mlp_write is _stock_write(lm.model, kind, "mlp", layer.index)
        assert layer.parallel == (kind in PARALLEL)
        assert layer.scale == (0.5 if kind == "granite" else 1.0)  # the tiny Granite's residual_multiplier


@pytest.mark.parametrize("kind", FAMILIES)
def test_maps_and_mask0_bidir(kind):
    """Every layer's maps equal stock eager ``output_attentions`` within 1e-4; a MASK0-BIDIR capture runs and
    its rows are distributions over what the mask allows."""
    stock, lm = _pair(kind)
    ids = CharTokenizer()(TEXT)["input_ids"]
    ref = _stock(stock, ids)
    cap = capture(lm, TEXT, "fwd", FULL)
    for layer, probs in enumerate(ref.attentions):
        np.testing.assert_allclose(cap.layer_probs(layer), probs[0].numpy(), atol=1e-4, err_msg=f"layer {layer}")
    np.testing.assert_allclose(cap.next_logprobs, torch.log_softmax(ref.logits[0, -1], -1).numpy(), atol=1e-4)
    other = capture(lm, TEXT, "mask0-bidir(k=1)", FULL)
    for layer in range(3):
        probs, allowed = other.layer_probs(layer), other.allowed[layer]
        assert np.isfinite(probs).all() and (probs[:, ~allowed] == 0).all()
        assert (probs.sum(-1) <= 1 + 1e-5).all()
    assert not allowed[1:, 0].any() or not np.allclose(other.layer_probs(2), cap.layer_probs(2), atol=1e-4)


@pytest.mark.parametrize("block", ["mlp", "attn"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_patch_equals_a_hand_written_hook(kind, block):
    """patch(value=mean) at token 0 of layer 1 equals stock transformers with a forward hook doing the same on the
    module written out above: every layer's maps and the next-token distribution."""
    stock, lm = _pair(kind)
    ids = CharTokenizer()(TEXT)["input_ids"]

    def hook(module, args, out):
        t = (out[0] if isinstance(out, tuple) else out).clone()
        t[:, 0] = t[:, 1:].mean(1)
        return (t, *out[1:]) if isinstance(out, tuple) else t

    ref = _stock(stock, ids, hook, _stock_write(stock, kind, block, 1))
    cap = capture(lm, TEXT, Recipe.of(lm, "fwd", f"patch(block={block}, tokens=0, value=mean)@1"), FULL)
    for layer, probs in enumerate(ref.attentions):
        np.testing.assert_allclose(cap.layer_probs(layer), probs[0].numpy(), atol=1e-4, err_msg=f"layer {layer}")
    np.testing.assert_allclose(cap.next_logprobs, torch.log_softmax(ref.logits[0, -1], -1).numpy(), atol=1e-4)
    assert np.abs(cap.layer_probs(2) - capture(lm, TEXT, "fwd", FULL).layer_probs(2)).max() > 1e-6


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_causal_check_patches_the_key_it_measures(kind):
    """In every layer, the key ``patch(tokens=sink)`` replaces is the key the causal check reads the sink at,
    under FWD and NoSink-FWD (each family's own windows included)."""
    stock, lm = _pair(kind)
    for spec in ("fwd", "nosink-fwd"):
        recipe = Recipe.of(lm, spec, "patch(block=mlp, tokens=sink)@0")
        cap = capture(lm, TEXT, recipe, FULL)
        _, run = engine.forward(lm.model, torch.tensor([cap.token_ids]), recipe_mod.build(lm, recipe).computes,
                                engine.NOTHING)
        assert [run.sink_key(l) for l in range(3)] == [metrics.auto_key(cap.allowed[l]) for l in range(3)]


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_region_resumed_from_a_layer_equals_the_full_maps(kind):
    stock, lm = _pair(kind)
    text = TEXT * 3
    cap = capture(lm, text, "fwd", Keep(statistics=True, pool=16, checkpoints=1))
    assert sorted(cap.checkpoints) == ([2] if anatomy.of(lm.model).resumable else [])
    full = capture(lm, text, "fwd", FULL)
    region = regions.of_capture(lm, cap, 2, (40, 90), (0, 50))
    np.testing.assert_allclose(region.values, full.layer_probs(2)[:, 40:90, 0:50], atol=1e-4)


REFUSED = {"deepseek_v3": "queries and keys are not a linear map"}  # latent attention: a norm inside its projections


@pytest.mark.parametrize("kind", FAMILIES)
def test_score_attribution_sums_to_the_captured_score(kind):
    """The score of a cell, its split by dimension and by source on each side, against the pre-softmax score a
    capture records (the maps of which equal stock above); the diagnosis runs on every layer."""
    from attnviz.effects.explain import KeptForward, diagnose
    from attnviz.errors import InputError

    stock, lm = _pair(kind)
    if kind in REFUSED:
        with pytest.raises(InputError, match=REFUSED[kind]):
            KeptForward(lm, TEXT).explain(2, 1, 17, 3)
        return
    cap = capture(lm, TEXT, "fwd", Keep(scores=True, storage_dtype=torch.float32))
    run = KeptForward(lm, TEXT)
    for layer, head, i, j in ((2, 1, 17, 15), (1, 3, 9, 7)):  # inside every tiny family's sliding window (4)
        e = run.explain(layer, head, i, j)
        captured = float(cap.layer_scores(layer)[head, i, j])
        assert (e.softcapped_score if e.softcapped_score is not None else e.score) == pytest.approx(captured, abs=1e-4)
        assert sum(e.by_dim) == pytest.approx(e.score, abs=1e-4)
        assert sum(e.key_sources.values()) == pytest.approx(e.score, abs=1e-4)
        assert sum(e.query_sources.values()) == pytest.approx(e.score, abs=1e-4)
        unrotated = kind == "gpt2" or (kind, layer) == ("smollm3", 1)  # learned positions; SmolLM3's NoPE layer
        assert len(e.by_pair) * 2 <= len(e.by_dim) and bool(e.by_pair) != unrotated
        if e.by_pair and kind not in ("gpt_neox", "phi", "glm4"):  # partial rotation: the rest are unpaired
            assert sum(e.by_pair) == pytest.approx(e.score, abs=1e-4)
    assert diagnose(run, 2).leading()[1] >= 1


@pytest.mark.parametrize("kind", FAMILIES)
def test_residual_variants_run_where_defined_and_are_refused_elsewhere(kind):
    """Where seed 003's recomputation is defined, method 2 leaves layers 0 and 1 as they are (the attention residual
    of layer 0 is X, and layer 1's attention reads the same stream) and changes layer 2; elsewhere the recipe is
    refused with the anatomy's reason."""
    from attnviz.core.engine import residual
    from attnviz.errors import ModelLoadError

    stock, lm = _pair(kind)
    why = residual.why_not(anatomy.of(lm.model))
    if why:
        with pytest.raises(ModelLoadError, match=re.escape(why)):
            Recipe.of(lm, "fwd", residual="method2")
        return
    plain = capture(lm, TEXT, "fwd", FULL)
    varied = capture(lm, TEXT, Recipe.of(lm, "fwd", residual="method2"), FULL)
    for layer in (0, 1):
        np.testing.assert_allclose(varied.layer_probs(layer), plain.layer_probs(layer), atol=1e-5)
    assert np.abs(varied.layer_probs(2) - plain.layer_probs(2)).max() > 1e-6
    assert np.isfinite(varied.next_logprobs).all()


@pytest.mark.parametrize("kind", FAMILIES)
def test_value_norms_are_each_head_s_output_projection_of_its_values(kind):
    """||W_O^h v_j^h|| on every family: the attention module is the anatomy's (GPT-NeoX's is ``attention``), and the
    norms equal the layer's own output projection applied to the values the capture kept, head by head."""
    stock, lm = _pair(kind)
    cap = capture(lm, TEXT, "fwd", Keep(layers=(1,), value_norms=True, qkv=True, storage_dtype=torch.float32))
    norms = cap.layer_value_norms(1)
    qkv = cap.layer_qkv(1)
    attn = anatomy.of(lm.model)[1].attn
    proj = engine.output_projection(attn).detach().float()  # (hidden, H * d_v)
    v = torch.from_numpy(np.asarray(qkv.v, dtype=np.float32))  # (KV, n, d_v)
    heads = norms.shape[0]
    v = v.repeat_interleave(heads // v.shape[0], dim=0)
    d_v = v.shape[-1]
    expected = torch.stack([(v[h] @ proj[:, h * d_v:(h + 1) * d_v].T).norm(dim=-1) for h in range(heads)])
    np.testing.assert_allclose(norms, expected.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["gemma3_text", "gpt_neox", "olmo2", "qwen3_moe", "granite"])
def test_the_doctor_passes_on_more_families(kind):
    from attnviz import doctor

    stock, lm = _pair(kind)
    report = doctor.run(lm, tokens=64)
    failed = [c.line() for c in report.checks if c.status == "FAIL"]
    assert report.ok and not failed, failed
    assert sum(c.status == "PASS" for c in report.checks) >= 6


def test_value_norms_make_nothing_of_the_hidden_size_per_key():
    """||W_O^h v_j|| through each head's d × d Gram matrix: no (B, H, n, hidden) temporary (680 MB at 32k tokens on
    the default model before)."""
    from attnviz.core.model import modules

    made = []

    class Seen(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made.extend(t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    stock, lm = _pair("llama")
    attn = anatomy.of(lm.model)[0].attn
    value = torch.randn(1, 2, 200, 8)  # (B, KV heads, n, d): 4 heads of 8 in a hidden size of 32
    with Seen():
        norms = modules.value_norms(attn, value, 4)
    assert max(made) < 1 * 4 * 200 * 32
    w = modules.output_projection(attn).detach().float().view(32, 4, 8)
    expected = torch.einsum("bhnd,ohd->bhno", value.repeat_interleave(2, dim=1), w).norm(dim=-1)
    torch.testing.assert_close(norms, expected, rtol=1e-5, atol=1e-6)


HALF_FAMILIES = ["llama", "qwen2", "gemma3_text", "gpt_neox", "granite", "phi3", "gpt2"]  # the code paths that differ


@pytest.mark.parametrize("kind", HALF_FAMILIES)
def test_bfloat16_column_attribution_patch_causal_check_and_routes(kind):
    """The conformance matrix's bfloat16 column (docs/support.md): in bfloat16 on the CPU, score attribution sums to
    the captured score within 2 % relative, ``patch`` equals a stock forward hook and routes equal their written-out
    definition (the doctor's three checks, against stock transformers), and the causal check's sink drop and the
    score agree with float32's (docs/methods.md#devices)."""
    from attnviz.support import in_dtype

    lm = tiny.loaded(kind)
    tiny.half_agrees(lm, in_dtype(lm, torch.bfloat16), "The keeper lit the lamp at dusk, and watched the sea until "
                                                        "the dawn came.")
