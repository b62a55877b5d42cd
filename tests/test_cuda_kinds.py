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
