"""Routes on the route a GPU takes, on the CPU (docs/gpu.md#the-hosts-share-measured-on-a-cpu): the Triton pass in
its interpreter (or its launch stubbed where only the host's work is counted), the kept entries on the device. What
makes a GPU's host wait, when it reads each layer, what the device holds, and how many operations the host
dispatches; the numbers equal the CPU's compiled route's."""

import importlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tiny
from attnviz.flow import contributions
from attnviz.flow.trace import trace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TEXT = "The cat sat on the mat and looked at the door."


@pytest.mark.skipif(not INTERPRETED, reason="Triton compiles for the GPU here: tests/test_cuda.py")
def test_routes_on_a_gpu_read_each_layer_while_the_next_one_runs(monkeypatch):
    """Every read from a GPU, counted on the CPU with the route a GPU takes (the Triton pass in its interpreter, the
    kept entries on the device): one a layer, of its checks' flags and how many entries it keeps, by a queued copy
    read only after the next layer's work is queued (so the device is never idle while the host waits; the last
    layer's after the forward); every other result is waited for once after the forward. No ``nonzero``, ``topk``,
    ``.item()`` or copy to pageable memory (the torch path before waited eight times a layer, and the route since
    once a layer with nothing queued). The numbers are the CPU's compiled route's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    trace_mod = importlib.import_module("attnviz.flow.trace")  # the package's ``trace`` is the function

    waits = {"aten.nonzero.default", "aten.nonzero_numpy.default", "aten.is_nonzero.default", "aten.item.default",
             "aten._local_scalar_dense.default"}
    seen, ops, reads = [], [], []
    state = {"layers": 0, "after": False}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.extend([str(func)] if str(func) in waits else [])
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    class Copy(trace_mod.HostCopy):  # when each copy was queued and when it was read, in layers queued
        def __init__(self, tensor):
            super().__init__(tensor)
            self.queued = state["layers"]

        def result(self):
            reads.append((self.queued, state["layers"], state["after"]))
            return super().result()

    start, landed = trace_mod._Probs.start, trace_mod._Tracer.landed

    def counting_start(self, *args):
        state["layers"] += 1
        return start(self, *args)

    def after_forward(self, *args):
        state["after"] = True
        return landed(self, *args)

    for kind in ("llama", "qwen2"):
        lm = tiny.loaded(kind)
        cpu_flow = trace(lm, TEXT)
        with monkeypatch.context() as m:
            m.setattr(contributions, "on_gpu", lambda tensor: True)
            m.setattr(trace_mod, "HostCopy", Copy)
            m.setattr(trace_mod._Probs, "start", counting_start)
            m.setattr(trace_mod._Tracer, "landed", after_forward)
            cpu, tolist = torch.Tensor.cpu, torch.Tensor.tolist
            m.setattr(torch.Tensor, "cpu", lambda self, *a, **k: seen.append("cpu") or cpu(self, *a, **k))
            m.setattr(torch.Tensor, "tolist", lambda self: seen.append("tolist") or tolist(self))
            seen.clear()
            ops.clear()
            reads.clear()
            state.update(layers=0, after=False)
            with Count():
                flow = trace(lm, TEXT)
        layers = len(flow.layers)
        during = [(queued, now) for queued, now, after in reads if not after]
        # one read a layer during the forward, each of a layer before the last one queued; the last after it
        assert len(during) == layers - 1 and all(now > queued for queued, now in during), (kind, reads)
        assert [queued for queued, _ in during] == list(range(1, layers)), (kind, reads)
        # beside a few reads once a run (the token ids' list, on the host already; a window's mask), none
        assert "cpu" not in seen and len(seen) <= 3, (kind, seen)
        assert not any("topk" in op or op.startswith("aten.nonzero.") for op in ops), kind
        for a, b in zip(flow.layers, cpu_flow.layers):
            np.testing.assert_array_equal(a.attn_index, b.attn_index)
            np.testing.assert_allclose(a.attn_weight, b.attn_weight, atol=1e-5)
            np.testing.assert_array_equal(a.sum_index, b.sum_index)
            np.testing.assert_allclose(a.sum_weight, b.sum_weight, atol=1e-5)
            np.testing.assert_allclose(a.attn_residual, b.attn_residual, atol=1e-6)
            np.testing.assert_allclose(a.mlp, b.mlp, atol=1e-6)
        np.testing.assert_allclose(flow.streams, cpu_flow.streams, atol=1e-6)


@pytest.mark.skipif(not INTERPRETED, reason="Triton compiles for the GPU here: tests/test_cuda.py")
def test_routes_on_a_gpu_hold_one_layer_s_contributions_at_a_time(monkeypatch):
    """A layer read a layer late is finished before the next layer's (H, n, n) contributions are made: when any
    layer's are made, no earlier layer's are still alive (a GPU's longest text is as long as before)."""
    import gc
    import weakref

    made: list = []
    alive: list = []
    real = contributions.scaled_and_kept

    def spy(raw, inv, floor):
        gc.collect()
        alive.append(sum(ref() is not None for ref in made))
        made.append(weakref.ref(raw))
        return real(raw, inv, floor)

    monkeypatch.setattr(contributions, "on_gpu", lambda tensor: True)
    monkeypatch.setattr(contributions, "scaled_and_kept", spy)
    lm = tiny.loaded("llama")
    trace(lm, TEXT)
    assert len(alive) == lm.n_layers and alive == [0] * lm.n_layers, alive


def test_routes_on_a_gpu_dispatch_a_bounded_few_operations_a_layer(default_model, monkeypatch):
    """On a GPU routes are bound by the host: every torch operation is a launch or at least the dispatcher's work.
    Counted on the CPU on the route a GPU takes (the routes pass's launch stubbed, not run), the default model's
    routes of a 64-token text dispatch at most 155 operations a layer beyond the plain forward's (144 now; 173 before
    each L1 norm was made once and the no-op conversions went: docs/gpu.md#the-hosts-share-measured-on-a-cpu)."""
    from attnviz import corpus
    from attnviz.flow import _triton_routes
    from common import dispatch_counter

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(contributions, "on_gpu", lambda tensor: True)
    monkeypatch.setattr(_triton_routes, "raw_tile", Launch())
    ids = corpus.head_ids(default_model.tokenizer, corpus.stdlib().text, 64)
    text = corpus.text_of(default_model.tokenizer, ids)
    counts = {}
    with torch.no_grad():
        trace(default_model, text)  # the first call makes what later ones reuse
        for name, run in (("routes", lambda: trace(default_model, text)),
                          ("forward", lambda: default_model.model(input_ids=torch.tensor([ids])))):
            with dispatch_counter() as counted:
                run()
            counts[name] = counted.ops
    per_layer = (counts["routes"] - counts["forward"]) / default_model.n_layers
    assert per_layer <= 155, (per_layer, counts)
