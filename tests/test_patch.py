"""The patch intervention (docs/methods.md#patch): a block's output replaced at some tokens, where the residual
stream adds it, checked against stock transformers with a forward hook doing the same by hand."""

import numpy as np
import pytest
import torch

from attnviz.capture import capture
from attnviz.core.loading.models import LoadedModel
from attnviz.effects.streaming import stream
from attnviz.errors import InputError
from attnviz.plan import Keep
from attnviz.recipe import Recipe

from tiny import CharTokenizer, loaded, pair

TEXT = "The keeper lit the lamp at dusk and watched the ships."
FAMILIES = ["llama", "qwen2", "mistral", "phi3", "gemma2", "gpt2", "gpt_oss"]
FULL = Keep(storage_dtype=torch.float32)


def _stock_module(model, kind: str, block: str, layer: int):
    """Written out by hand per family (not read from attnviz): what the residual stream adds."""
    if kind == "gpt2":
        return getattr(model.transformer.h[layer], block)
    decoder = model.model.layers[layer]
    if kind == "gemma2":  # its blocks' outputs are added after their post-norms
        return decoder.post_attention_layernorm if block == "attn" else decoder.post_feedforward_layernorm
    return decoder.self_attn if block == "attn" else decoder.mlp


def _hooked_reference(stock, kind, block, layer, positions, value, ids):
    def hook(module, args, out):
        t = (out[0] if isinstance(out, tuple) else out).clone()
        others = [i for i in range(t.shape[1]) if i not in positions]
        t[:, positions] = 0 if value == "zero" else t[:, others].mean(1, keepdim=True)
        return (t, *out[1:]) if isinstance(out, tuple) else t

    handle = _stock_module(stock, kind, block, layer).register_forward_hook(hook)
    try:
        with torch.no_grad():
            return stock(input_ids=torch.tensor([ids]), output_attentions=True)
    finally:
        handle.remove()


@pytest.mark.parametrize("value", ["zero", "mean"])
@pytest.mark.parametrize("block", ["mlp", "attn"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_patch_equals_a_forward_hook_on_stock_transformers(kind, block, value):
    stock, ours = pair(kind)
    lm = LoadedModel(ours, CharTokenizer(), f"tiny-{kind}", None, 0.0)
    ids = CharTokenizer()(TEXT)["input_ids"]
    ref = _hooked_reference(stock, kind, block, 1, [0], value, ids)
    cap = capture(lm, TEXT, Recipe.of(lm, "fwd", f"patch(block={block}, tokens=0, value={value})@1"), FULL)
    for layer, probs in enumerate(ref.attentions):
        np.testing.assert_allclose(cap.layer_probs(layer), probs[0].numpy(), atol=1e-4, err_msg=f"layer {layer}")
    np.testing.assert_allclose(cap.next_logprobs, torch.log_softmax(ref.logits[0, -1], -1).numpy(), atol=1e-4)
    plain = capture(lm, TEXT, "fwd", FULL)
    assert np.abs(plain.layer_probs(2) - cap.layer_probs(2)).max() > 1e-6  # the patch changed the layer above
    np.testing.assert_allclose(plain.layer_probs(1), cap.layer_probs(1), atol=1e-6)  # ... not its own layer's


def test_several_tokens_and_the_sink_key_of_each_layers_mask():
    stock, ours = pair("llama")
    lm = LoadedModel(ours, CharTokenizer(), "tiny-llama", None, 0.0)
    ids = CharTokenizer()(TEXT)["input_ids"]
    ref = _hooked_reference(stock, "llama", "mlp", 0, [0, 1], "mean", ids)
    cap = capture(lm, TEXT, Recipe.of(lm, "fwd", "patch(block=mlp, tokens=1,0, value=mean)@0"), FULL)
    np.testing.assert_allclose(cap.layer_probs(2), ref.attentions[2][0].numpy(), atol=1e-4)
    # the sink key is the mask's: 0 under FWD, m under NoSink-FWD(m)
    for arch, key in (("fwd", 0), ("nosink-fwd(m=2)", 2)):
        by_sink = capture(lm, TEXT, Recipe.of(lm, arch, "patch(block=attn, tokens=sink)@0-1"), FULL)
        by_key = capture(lm, TEXT, Recipe.of(lm, arch, f"patch(block=attn, tokens={key})@0-1"), FULL)
        np.testing.assert_array_equal(by_sink.layer_probs(2), by_key.layer_probs(2))


def test_patch_composes_with_masks_interventions_and_the_statistics_route():
    lm = loaded("llama")
    recipe = Recipe.of(lm, "mask0-bidir(k=1)", "patch(block=mlp, tokens=0)@0; temperature(t=2)@2")
    full = capture(lm, TEXT, recipe, FULL)
    stats = capture(lm, TEXT, recipe, Keep(statistics=True, pool=16))
    for layer in range(3):
        np.testing.assert_allclose(stats.stats[layer]["alpha"], full.stat(layer, "alpha"), atol=2e-6, equal_nan=True)
    alone = capture(lm, TEXT, Recipe.of(lm, "mask0-bidir(k=1)", "temperature(t=2)@2"), FULL)
    assert np.abs(alone.layer_probs(2) - full.layer_probs(2)).max() > 1e-6  # the patch below layer 2 counts


def test_patch_in_decoding_with_a_cache_and_its_refusals():
    lm = loaded("llama")
    ids = CharTokenizer()(TEXT)["input_ids"]
    patched = stream(lm, ids, "dense", Recipe.of(lm, "fwd", "patch(block=mlp, tokens=0)@0"))
    plain = stream(lm, ids, "dense", "fwd")
    assert patched.perplexity != pytest.approx(plain.perplexity)
    with pytest.raises(InputError, match="value=zero there"):
        stream(lm, ids, "dense", Recipe.of(lm, "fwd", "patch(block=mlp, tokens=0, value=mean)@0"))
    odd = loaded("llama")  # a layer whose output is not its input plus its writes: its blocks cannot be mapped
    odd.model.model.layers[1].register_forward_hook(lambda module, args, out: out * 2)
    with pytest.raises(InputError, match="layer 1: its output is not its input plus its attention and MLP writes"):
        capture(odd, TEXT, Recipe.of(odd, "fwd", "patch(block=mlp)@0"))


def test_patch_in_every_entry_point_that_takes_an_intervention():
    from attnviz.effects import dataset
    from attnviz.effects.evaluate import evaluate
    from attnviz.effects.generate import generate

    lm = loaded("llama")
    patched, plain = Recipe.of(lm, "fwd", "patch(block=mlp, tokens=0, value=mean)@0"), Recipe.of(lm, "fwd")
    docs = [TEXT * 2, TEXT[::-1] * 2, TEXT.upper() * 2]
    a, b = (dataset.sinks(lm, docs, r, max_len=16, n_samples=3) for r in (patched, plain))  # batches of several
    assert a.alpha.shape == b.alpha.shape and not np.allclose(a.alpha[:, 1:], b.alpha[:, 1:], equal_nan=True)
    np.testing.assert_allclose(a.alpha[:, 0], b.alpha[:, 0], equal_nan=True)  # layer 0's own attention: untouched
    one = capture(lm, docs[0][:16], patched, FULL)  # a batch row is the text alone
    np.testing.assert_allclose(a.alpha[0, 1], one.stat(1, "alpha")[:, :16], atol=1e-5, equal_nan=True)
    assert evaluate(lm, TEXT, patched, window=16).nll != pytest.approx(evaluate(lm, TEXT, plain, window=16).nll)
    zero = Recipe.of(lm, "fwd", "patch(block=attn, tokens=0)@0")
    assert generate(lm, TEXT, zero, max_new_tokens=3).new_ids is not None


def test_cli_capture_with_a_patch_is_the_librarys(default_model, tmp_path):
    from test_cli import run

    from attnviz.capture import Capture

    spec = "patch(block=mlp, tokens=0, value=zero)@11"
    out = run("capture", "--intervene", spec, "--text", "The cat sat on the mat.", "--out", str(tmp_path / "x.npz"))
    assert out.returncode == 0, out.stderr
    saved = Capture.load(tmp_path / "x.npz")
    assert saved.meta["intervene"] == spec
    ours = capture(default_model, "The cat sat on the mat.", Recipe.of(default_model, "fwd", spec))
    np.testing.assert_allclose(saved.layer_probs(20), ours.layer_probs(20), atol=2e-3)  # fp16 storage
