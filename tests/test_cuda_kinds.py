"""Attention kinds and the lab on a GPU (docs/methods.md#attention-kinds, docs/lab.md), marked ``cuda`` (skipped
without one), and in half precision on the CPU: the same maps as float32 on the CPU, within the tolerance each dtype
allows (docs/methods.md#devices)."""

import pytest
import torch

import tiny
from attnviz import recipe
from attnviz.core import engine

KINDS = ["softmax", "softpick", "sigmoid", "sink(logit=0)", "relu"]
IDS = torch.randint(3, 90, (1, 24), generator=torch.Generator().manual_seed(2))
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _maps(kind, arch, device="cpu", dtype=torch.float32):
    lm = tiny.loaded("llama")
    lm.model.to(device, dtype)
    record = engine.Record.every_layer(storage_dtype=torch.float32)
    _, _, run = recipe.build(lm, arch, kind=kind).forward(lm, IDS.to(device), record)
    return [torch.as_tensor(run.probs[layer]).float().cpu() for layer in range(lm.n_layers)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_in_half_precision_gives_the_float32_maps(kind, dtype):
    for got, want in zip(_maps(kind, "fwd", dtype=dtype), _maps(kind, "fwd")):
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["fwd", "stablemask"])
@pytest.mark.parametrize("kind", ["softpick", "sink(logit=0)"])
def test_each_kind_on_cuda_gives_the_cpu_maps(kind, arch, dtype):
    for got, want in zip(_maps(kind, arch, "cuda", dtype), _maps(kind, arch)):
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["softmax", "softpick", "sink", "gate", "relu"])
def test_the_lab_trains_on_cuda_and_its_checkpoint_loads_on_the_cpu(kind, tmp_path):
    import attnviz
    from attnviz.lab.tasks import BigramBackcopy
    from attnviz.lab.train import Setup, train

    setup = Setup(kind=kind, steps=4, every=2, width=32, heads=2, device="cuda",
                  task=BigramBackcopy(vocab=16, length=12))
    last = train(setup, tmp_path / "run")
    lm = attnviz.load(str(last), device="cpu")
    assert next(lm.model.parameters()).device.type == "cpu"
    out = lm.model(torch.tensor([[0, 5, 6, 7]]))
    assert torch.isfinite(out.logits).all()


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [True, False])
def test_training_s_sink_route_and_lean_weights_on_a_gpu(causal):
    """On a GPU the sink route takes SDPA's output and lse from the scores, and the lean training weights run as
    on the CPU: the output and the gradients for q, k, v and a learned s are the explicit softmax's on the CPU
    (float32); softpick's and sigmoid's lean weights and gradients are the kinds' own on the GPU."""
    import math

    from attnviz.core.engine import lean
    from attnviz.core.kernel.lse import sink_attention
    from attnviz.core.spec import kinds

    gen = torch.Generator().manual_seed(0)
    n = 40
    cpu = [torch.randn(2, 4, n, 16, generator=gen) for _ in range(3)] + [torch.randn(4, generator=gen)]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allow = ((j <= i) if causal else ((i - j).abs() < 5) | (j == 0))[None, None].expand(2, 1, n, n)
    weight = torch.randn(2, 4, n, 16, generator=gen)

    def grads(device, explicit):
        q, k, v, s = (t.to(device).requires_grad_() for t in cpu)
        if explicit:
            z = torch.matmul(q * 0.25, k.transpose(-1, -2)).masked_fill(~allow.to(device), -math.inf)
            z = torch.cat([z, s.reshape(1, -1, 1, 1).expand(2, 4, n, 1)], -1)
            out = torch.matmul(torch.softmax(z, -1)[..., :-1], v)
        else:
            out = sink_attention(q, k, v, s, None if causal else allow.to(device), 0.25, causal)
        return [out.cpu()] + [g.cpu() for g in torch.autograd.grad((out * weight.to(device)).sum(), (q, k, v, s))]

    for got, want in zip(grads("cuda", False), grads("cpu", True)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for spec in ("softpick", "sigmoid"):
        kind = kinds.parse(spec)
        raw = (torch.randn(2, 4, n, n, generator=gen) * 3).cuda()
        a, b = raw.clone().requires_grad_(), raw.clone().requires_grad_()
        got = lean.weigher(kind)(allow.cuda())(lean.masked(a, allow.cuda()))
        want = kind.weights(b.masked_fill(~allow.cuda(), -math.inf))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        got.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
