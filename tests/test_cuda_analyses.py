"""The analyses beyond a capture on a GPU, marked ``cuda`` (skipped without one): the causal scan, activation and path
patching, the compression valley, the learned sink and sinks at any key, in float32 and bfloat16, each against the
same call in float32 on the CPU within the tolerance each dtype allows (docs/methods.md#devices). On the CPU the same
entry points run on a simulated second device (tests/test_placement.py) and in half precision (tests/test_paths.py,
tests/test_valley.py, tests/test_precision.py)."""

import numpy as np
import pytest
import torch

import tiny
from attnviz.support import in_dtype

pytestmark = pytest.mark.cuda
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
TEXT = "The keeper lit the lamp, and the ships passed the rocks all night long; the keeper slept at dawn."
ATTENTION = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # a share of a row
ENTROPY = {torch.float32: 1e-4, torch.bfloat16: 5e-3}  # tests/test_valley.py's limit for bfloat16
DEVICE = "cuda"


def _pair(kind: str, dtype, prepare=None):
    """The tiny model on the CPU in float32, and a copy on the GPU in ``dtype`` (``prepare`` applied to both)."""
    cpu, gpu = tiny.loaded(kind), tiny.loaded(kind)
    if prepare is not None:
        prepare(cpu.model), prepare(gpu.model)
    gpu.model.to(DEVICE)
    return cpu, in_dtype(gpu, dtype) if dtype != torch.float32 else gpu


@DTYPES
def test_the_causal_scan_and_activation_patching(dtype):
    from attnviz.effects.causal import scan
    from attnviz.effects.patching import patching

    cpu, gpu = _pair("llama", dtype)
    ref, got = scan(cpu, TEXT, leaders=False), scan(gpu, TEXT, leaders=False)
    assert [c.source for c in got.checks] == [c.source for c in ref.checks]
    for a, b in zip(ref.checks, got.checks):
        np.testing.assert_allclose(b.after.attention, a.after.attention, atol=ATTENTION[dtype], equal_nan=True,
                                   err_msg=a.source)
    clean, corrupted = "The cat sat on the mat and", "The dog sat on the hat and"
    p32, p = (patching(m, clean, corrupted, "P", "R", site="resid") for m in (cpu, gpu))
    assert p.effect.shape == p32.effect.shape and np.isfinite(p.effect).all()
    if dtype == torch.float32:
        np.testing.assert_allclose(p.effect, p32.effect, atol=1e-3)
    else:  # a normalised effect over a tiny model's small divergences: bfloat16 keeps the clean run's metric
        assert p.clean == pytest.approx(p32.clean, rel=0.05, abs=0.05)


@DTYPES
def test_path_patching(dtype):
    from attnviz.effects.paths import paths

    cpu, gpu = _pair("gemma3_text", dtype)
    ask = ("mlp.0", "attn.1,keys.2,mlp.1,head,all")
    ref, got = paths(cpu, TEXT, "fwd", *ask), paths(gpu, TEXT, "fwd", *ask)
    assert got.after.keys() == ref.after.keys()
    for key, profile in ref.after.items():
        np.testing.assert_allclose(got.after[key].attention, profile.attention, atol=ATTENTION[dtype],
                                   equal_nan=True, err_msg=str(key))
        assert got.after[key].perplexity == pytest.approx(profile.perplexity, rel=1e-4 if dtype == torch.float32
                                                          else 5e-2)


@DTYPES
def test_the_compression_valley(dtype):
    from attnviz.effects import valley

    cpu, gpu = _pair("llama", dtype)
    ref, got = valley.measure(cpu, TEXT * 3, "fwd"), valley.measure(gpu, TEXT * 3, "fwd")
    np.testing.assert_allclose(got.entropy, ref.entropy, atol=ENTROPY[dtype], rtol=0)
    np.testing.assert_allclose(got.first_norm, ref.first_norm, rtol=1e-4 if dtype == torch.float32 else 2e-2)


@DTYPES
def test_the_learned_sink_and_sinks_at_any_key(dtype):
    """gpt-oss's learned sink share from its logits, in full maps and statistics, and every sink found at any key."""
    from attnviz.capture import capture
    from attnviz.plan import Keep

    def sunk(model):  # layer 0's head 0 sends about half of each row to its learned sink (tests/test_learned_sink.py)
        with torch.no_grad():
            model.model.layers[0].self_attn.sinks.copy_(torch.tensor([1.5, -30.0, -30.0, -30.0]))

    cpu, gpu = _pair("gpt_oss", dtype, sunk)
    for keep in (Keep(storage_dtype=torch.float32), Keep(statistics=True)):
        ref, got = capture(cpu, TEXT, "fwd", keep), capture(gpu, TEXT, "fwd", keep)
        assert sorted(got.learned_sink) == sorted(ref.learned_sink)
        for layer in ref.layers:
            np.testing.assert_allclose(got.learned_sink[layer], ref.learned_sink[layer], atol=ATTENTION[dtype])
            if dtype == torch.float32:  # in bfloat16 a head whose share sits near the threshold may fall either side
                assert [(s["key"], s["category"], s["heads"]) for s in got.sinks(layer, 0.3)] == [
                    (s["key"], s["category"], s["heads"]) for s in ref.sinks(layer, 0.3)], layer
