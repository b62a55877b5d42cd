"""CUDA code paths (docs/methods.md#devices), marked ``cuda``: skipped on a machine without a GPU (see
conftest.py), run where there is one. Stock eager ``output_attentions`` is the reference on the GPU
itself, and every GPU result is also compared with the same capture on the CPU."""

import numpy as np
import pytest
import torch

from attnviz.core import engine
from attnviz import regions
from attnviz.core.spec.arch import parse
from attnviz.capture import capture
from attnviz.plan import Keep

from tiny import ARCHS, CharTokenizer, build, loaded

pytestmark = pytest.mark.cuda
N = 40
TEXT = "The keeper lit the lamp, and the ships passed the rocks all night long; " * 3
N_TEXT = len(CharTokenizer()(TEXT)["input_ids"])  # the text's real length in tokens
QUERIES = (N_TEXT - 66, N_TEXT)  # the last 66 queries
MASKS = ["fwd", "back*3", "bidir*3", "nosink-fwd*3", "mask0-bidir(k=2)", "mask0&bidir(k=2, k0=1)", "sliding(w=5)*3",
         "stablemask(gamma=0.5)", "stablemask(slopes=alibi, T=512)"]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # docs/methods.md#devices


def _ids(n=N):
    return torch.randint(3, 90, (1, n), generator=torch.Generator().manual_seed(1))


def _on(kind, device, dtype):
    lm = loaded(kind)
    lm.model.to(device, dtype)
    return lm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ARCHS)
def test_fwd_equals_stock_eager_on_cuda(kind, dtype):
    stock = build(kind, "eager").to("cuda", dtype)
    ours = build(kind, "eager").to("cuda", dtype)
    ids = _ids().cuda()
    with torch.no_grad():
        ref = stock(input_ids=ids, output_attentions=True)
    _, run = engine.forward(ours, ids, list(parse("fwd", 3).layers), engine.Record(storage_dtype=torch.float32))
    for layer, ref_probs in enumerate(ref.attentions):
        assert (run.probs[layer] - ref_probs.float().cpu()).abs().max().item() <= TOL[dtype], f"layer {layer}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", MASKS)
def test_every_mask_type_gives_the_cpu_maps_on_cuda(spec, dtype):
    cpu = capture(_on("llama", "cpu", torch.float32), TEXT, spec, Keep(storage_dtype=torch.float32))
    gpu = capture(_on("llama", "cuda", dtype), TEXT, spec, Keep(storage_dtype=torch.float32))
    for layer in cpu.layers:
        np.testing.assert_allclose(gpu.layer_probs(layer), cpu.layer_probs(layer), atol=TOL[dtype])
        np.testing.assert_array_equal(gpu.allowed[layer], cpu.allowed[layer])


@pytest.mark.parametrize("spec", MASKS)
def test_long_mode_statistics_and_pooled_maps_on_cuda_equal_the_cpu(spec):
    keep = Keep(statistics=True, pool=24, value_norms=True, scores=True, block_bytes=4 * 4 * len(TEXT) * 7)
    cpu = capture(_on("llama", "cpu", torch.float32), TEXT, spec, keep)
    gpu = capture(_on("llama", "cuda", torch.float32), TEXT, spec, keep)
    for layer in cpu.layers:
        for name, value in cpu.stats[layer].items():
            np.testing.assert_allclose(gpu.stats[layer][name].astype(np.float32), value.astype(np.float32),
                                       atol=1e-4, rtol=2e-3, equal_nan=True, err_msg=f"{name} L{layer}")


@pytest.mark.parametrize("spec", ["fwd", "stablemask(gamma=0.5)", "mask0-bidir(k=2)"])
def test_regions_on_cuda_equal_the_cpu(spec):
    cpu = regions.region(_on("llama", "cpu", torch.float32), TEXT, spec, 1, QUERIES, (3, 70))
    gpu = regions.region(_on("llama", "cuda", torch.float32), TEXT, spec, 1, QUERIES, (3, 70))
    np.testing.assert_allclose(gpu.values, cpu.values, atol=1e-4)
    np.testing.assert_array_equal(gpu.allowed, cpu.allowed)


@pytest.mark.parametrize("spec", ["fwd", "sliding(w=7)*3"])
def test_a_capture_on_cuda_holds_its_maps_packed_as_on_the_cpu(spec):
    """Staged on the GPU, packed there, and only the spans' cells copied to the host
    (docs/methods.md#full-maps-held-packed)."""
    from attnviz.core.record.packed import Packed

    cpu = capture(_on("llama", "cpu", torch.float32), TEXT, spec)
    gpu = capture(_on("llama", "cuda", torch.float32), TEXT, spec)
    for layer in cpu.layers:
        held = gpu.probs.packed(layer)
        assert isinstance(held, Packed) and held.values.shape == cpu.probs.packed(layer).values.shape
        np.testing.assert_allclose(gpu.layer_probs(layer), cpu.layer_probs(layer), atol=2e-3)


def test_full_maps_come_back_through_pinned_memory():
    lm = _on("llama", "cuda", torch.float32)
    _, run = engine.forward(lm.model, torch.tensor([CharTokenizer()(TEXT)["input_ids"]]), list(parse("fwd", 3).layers))
    assert all(p.device.type == "cpu" and p.is_pinned() for p in run.probs.values())


def test_doctor_passes_on_the_gpu_and_names_the_fallback_when_the_kernel_fails(monkeypatch):
    """On CUDA: the fused kernel against the block engine, and its speed; a kernel that will not compile is a
    FAIL that names the block engine as the fallback."""
    pytest.importorskip("plotly", reason="the doctor's report draws figures (a GPU machine may lack plotly)")
    from attnviz import doctor
    from attnviz.core.kernel import kernels

    lm = loaded("llama")
    lm.model.to("cuda", torch.bfloat16)
    report = doctor.run(lm, tokens=1024)
    by_name = {c.name: c for c in report.checks}
    for check in report.checks:  # every equivalence check passes in bfloat16; no verdict of a timing is asserted
        if not check.name.startswith("speed:"):
            assert check.status == "PASS", report.text()
    assert by_name["statistics, fused kernel vs their definitions on the full maps"].status == "PASS"
    assert by_name["maps of every layer vs stock eager (float32, end to end)"].status == "PASS"  # cast for it
    speed = by_name["speed: fused kernel vs block engine"]  # reported on a GPU, never skipped
    assert speed.status == "TIME" and speed.ratio > 0

    def broken():
        raise RuntimeError("PTX .version 9.9 does not support .target sm_99")

    monkeypatch.setattr(kernels, "kernel", broken)
    report = doctor.run(lm, tokens=1024)
    fused = next(c for c in report.checks if c.name == "statistics, fused kernel vs their definitions on the full maps")
    assert fused.status == "FAIL" and "falls back to the block engine" in fused.detail and not report.ok


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", ["fwd", "bidir", "sliding(w=9)"])
def test_every_fused_layer_gets_its_log_sum_exp_from_the_attention_kernel(spec, dtype, monkeypatch, use_settings):
    """One pass over QK^T on a GPU too: flash (causal, half precision) or memory-efficient attention (any mask)
    gives each row's log-sum-exp; none falls back to two passes."""
    from attnviz.core.kernel import kernels

    calls = []
    real = kernels.layer_statistics
    monkeypatch.setattr(kernels, "layer_statistics", lambda *a, **k: calls.append(k["lse"] is not None) or real(*a, **k))
    use_settings(fused=True)
    capture(_on("llama", "cuda", dtype), TEXT, spec, Keep(statistics=True, pool=24))
    assert calls and all(calls), calls


@pytest.mark.parametrize("arch", ["fwd", "mask0-bidir(k=2)", "sliding(w=5)*3"])
def test_routes_on_cuda_equal_routes_on_the_cpu(arch, monkeypatch):
    """Contributions on the GPU run one Triton pass a layer (the compiled loop is the CPU's) and keep their entries on
    the device: every layer's contributions equal the CPU's, which the CPU tests hold to the written-out definition
    (docs/methods.md#contributions), at floor 0 and at the default floor (the kept entries alike)."""
    from attnviz.flow import contributions, trace

    calls = []
    real = contributions.attention_raw_triton
    monkeypatch.setattr(contributions, "attention_raw_triton", lambda *a: calls.append(1) or real(*a))
    cpu = trace(_on("llama", "cpu", torch.float32), TEXT, arch, floor=0.0)
    gpu = trace(_on("llama", "cuda", torch.float32), TEXT, arch, floor=0.0)
    assert len(calls) == len(gpu.layers)
    cpu_kept = trace(_on("llama", "cpu", torch.float32), TEXT, arch)
    gpu_kept = trace(_on("llama", "cuda", torch.float32), TEXT, arch)
    for a, b in zip(cpu_kept.layers, gpu_kept.layers):
        np.testing.assert_array_equal(a.sum_index, b.sum_index)
        np.testing.assert_allclose(a.attn_weight, b.attn_weight, atol=1e-4)
    for a, b in zip(cpu.layers, gpu.layers):
        np.testing.assert_allclose(a.dense(cpu.n_heads, cpu.n_tokens), b.dense(gpu.n_heads, gpu.n_tokens), atol=1e-4)
        np.testing.assert_allclose(a.attn_residual, b.attn_residual, atol=1e-4)
        np.testing.assert_allclose(a.mlp, b.mlp, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "gpt_neox"])
def test_the_deep_pages_run_in_bfloat16_on_cuda_as_on_the_cpu(kind):
    """Score attribution, ``patch``, the causal check and routes on CUDA in bfloat16: the doctor's three checks
    against stock transformers pass there, and the score and the sink drop agree with the CPU's float32."""
    from tiny import half_agrees

    half_agrees(_on(kind, "cpu", torch.float32), _on(kind, "cuda", torch.bfloat16), TEXT)


@pytest.mark.parametrize("groups", ["1", "4"])
@pytest.mark.parametrize("stages", ["3", "4"])
@pytest.mark.parametrize("tile", [(64, 64), (128, 64)], ids=["64x64", "128x64"])
@pytest.mark.parametrize("warps", ["4", "8"])
@pytest.mark.parametrize("one_pass", [True, False], ids=["lse", "two-pass"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "packed"])
def test_the_fused_kernel_at_either_warp_count_gives_the_definitions_on_cuda(causal, one_pass, warps, tile, stages,
                                                                             groups, use_settings):
    """The kernel compiled for this GPU at 4 and at 8 warps, every tile, pipeline depth and row grouping of the
    column sums a GPU's measured launch may take (attnviz.core.kernel.kernels.TUNED, row_groups), bf16, full tiles
    below the diagonal, against the sums of the full probabilities."""
    from tiny import long_kernel_case

    use_settings(kernel_warps=int(warps), kernel_stages=int(stages), kernel_groups=int(groups))
    got, expected = long_kernel_case("cuda", torch.bfloat16, causal, one_pass, tile)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-3, rtol=2e-3, msg=name)


@pytest.mark.parametrize("registers", ["128", "168"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "packed"])
def test_the_fused_kernel_with_its_registers_capped_gives_the_definitions_on_cuda(causal, registers, use_settings):
    """The kernel with a thread's registers capped (ATTNVIZ_KERNEL_REGISTERS: an SM then holds a program more,
    kernels.programs_per_sm) at 2 stages, bf16, against the sums of the full probabilities."""
    from tiny import long_kernel_case

    use_settings(kernel_registers=int(registers), kernel_stages=2)
    got, expected = long_kernel_case("cuda", torch.bfloat16, causal, True, (64, 64))
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-3, rtol=2e-3, msg=name)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_the_attention_kernel_s_log_sum_exp_is_every_row_s_on_cuda(heads, use_settings):
    """The log-sum-exp the statistics read from the layer's attention kernel (cuDNN's where it agrees with flash
    attention on this GPU, else flash attention's) is each row's log-sum-exp of its scaled causal scores, and the
    output is SDPA's; the same with cuDNN switched off."""
    from attnviz.core.kernel import lse as attention

    gen = torch.Generator().manual_seed(7)
    n_heads, kv_heads = heads
    q = torch.randn(1, n_heads, 300, 64, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(1, kv_heads, 300, 64, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(1, kv_heads, 300, 64, generator=gen).to("cuda", torch.bfloat16)
    scores = (q.double() @ k.double().repeat_interleave(n_heads // kv_heads, 1).transpose(-1, -2)) * 0.125
    expected = torch.logsumexp(scores.masked_fill(torch.ones(300, 300, dtype=torch.bool, device="cuda").triu(1),
                                                  float("-inf")), -1)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125,
                                                                 enable_gqa=n_heads != kv_heads)
    for cudnn in ("", "0"):
        use_settings(cudnn=cudnn != "0")
        attention.cudnn_agrees.cache_clear()
        out, lse = attention.attention_with_lse(q, k, v, None, 0.125, True)
        assert lse is not None and lse.shape == (1, n_heads, 300)
        torch.testing.assert_close(lse.double(), expected, atol=2e-2, rtol=1e-3)
        torch.testing.assert_close(out.float(), reference.float(), atol=2e-2, rtol=2e-2)
    attention.cudnn_agrees.cache_clear()
