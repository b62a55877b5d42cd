"""Fused layers finished together (attnviz.core.record.reduce.FusedLayers), without a kernel: hand-made kernel sums
fed as the fused route feeds them, against the same sums finished one layer at a time."""

import numpy as np
import pytest
import torch

from attnviz.core.record import reduce
from attnviz.core.spec.allowsets import Layout

H, N = 3, 10


def _raw(seed: int, pooled: bool = True) -> dict:
    """What the kernel gives for one layer: per-row sums, column sums and a pooled map."""
    g = torch.Generator().manual_seed(seed)
    raw = {name: torch.rand(H, N, generator=g) for name in ("rowsum", "plogp", "diag", "key0", "delim", "colsum")}
    raw["plogp"] = -raw["plogp"]
    if pooled:
        raw["pooled"] = torch.rand(H, N, N, generator=g)
    return raw


def _alone(raw: dict, layout: Layout) -> dict:
    """One layer finished by a reducer of its own."""
    summaries = reduce.Summaries(list("abcdefghij"), pool=N)
    summaries.add_fused(0, raw, layout)
    return reduce.devices.landed(summaries.finish(0))


def test_layers_finished_together_equal_each_alone_and_keep_their_own_results():
    layout = Layout.causal(N, torch.device("cpu"))
    summaries = reduce.Summaries(list("abcdefghij"), pool=N)
    raws = {layer: _raw(layer) for layer in range(4)}
    handles = {}
    for layer, raw in raws.items():
        summaries.add_fused(layer, raw, layout)
        handles[layer] = summaries.finish(layer)
    for layer, handle in handles.items():
        got, want = reduce.devices.landed(handle), _alone(raws[layer], layout)
        assert got.keys() == want.keys() and int(got["pool_factor"]) == 1
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=f"{name} L{layer}")


def test_a_reducer_run_again_finishes_the_new_run_s_sums():
    """A reducer whose group was finished (a run collected) starts a new group for the next run's layers: the second
    run's results are its own, never the first's."""
    layout = Layout.causal(N, torch.device("cpu"))
    summaries = reduce.Summaries(list("abcdefghij"), pool=N)
    summaries.add_fused(0, _raw(1), layout)
    first = reduce.devices.landed(summaries.finish(0))
    summaries.add_fused(0, _raw(2), layout)
    second = reduce.devices.landed(summaries.finish(0))
    np.testing.assert_array_equal(second["alpha"], _alone(_raw(2), layout)["alpha"])
    assert not np.array_equal(first["alpha"], second["alpha"], equal_nan=True)
    finished = reduce.FusedLayers(summaries)
    finished.finish()
    with pytest.raises(RuntimeError, match="finished"):
        finished.add(0, _raw(3), layout)


def test_an_error_while_a_group_is_finished_leaves_it_to_be_finished_again(monkeypatch):
    """An error while finishing (a device out of memory) propagates as itself, and the group, untouched, can still be
    finished: no layer's result is lost or replaced by another error."""
    layout = Layout.causal(N, torch.device("cpu"))
    summaries = reduce.Summaries(list("abcdefghij"), pool=N)
    handles = []
    for layer in range(2):
        summaries.add_fused(layer, _raw(layer), layout)
        handles.append(summaries.finish(layer))
    real = torch.where

    def fails(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(torch, "where", fails)
    with pytest.raises(torch.OutOfMemoryError):
        handles[0].result()
    monkeypatch.setattr(torch, "where", real)
    for layer, handle in enumerate(handles):
        np.testing.assert_array_equal(handle.result()["alpha"], _alone(_raw(layer), layout)["alpha"])


def test_a_full_group_is_finished_at_once_and_the_next_layers_start_another(monkeypatch):
    layout = Layout.causal(N, torch.device("cpu"))
    monkeypatch.setattr(reduce, "GROUP_BYTES", 2 * sum(v.numel() * 4 for v in _raw(0).values()))
    summaries = reduce.Summaries(list("abcdefghij"), pool=N)
    handles = []
    for layer in range(5):
        summaries.add_fused(layer, _raw(layer), layout)
        handles.append(summaries.finish(layer))
    groups = [handle.group for handle in handles]
    assert groups[0] is groups[1] and groups[2] is groups[3] and len({id(g) for g in groups}) == 3
    assert groups[0].copies is not None and groups[4].copies is None  # the last waits for the run's collection
    for layer, handle in enumerate(handles):
        np.testing.assert_array_equal(handle.result()["entropy"], _alone(_raw(layer), layout)["entropy"])


def test_the_device_estimate_counts_the_waiting_sums_where_the_fused_route_runs(monkeypatch):
    """On CUDA with Triton the working set counts the fused layers' sums waiting to be finished together and their
    stack, at most twice (64 MB and a layer); on another accelerator (MPS, XPU), where the block engine runs, nothing."""
    from attnviz.core.kernel import kernels
    from attnviz.core.sizing import estimates
    from attnviz.core.sizing.sizes import Masks, Shape
    from attnviz.plan import Keep

    monkeypatch.setattr(kernels, "available", lambda: True)

    def shape(device):
        return Shape(n_layers=30, n_heads=9, n_kv_heads=3, hidden=576, head_dim=64, inner=1536, vocab=49152,
                     dtype=torch.bfloat16, device=device, free=None, block=512 * 2**20, resumable=True)

    keep, n = Keep(statistics=True, pool=512), 4096
    layer = 9 * (6 * n + 512 ** 2) * 4  # a layer's sums and its 512-cell map, float32
    extra = {device: estimates.working(shape(device), keep, n, Masks(), list(range(30))) for device in ("cuda:0", "mps")}
    assert extra["cuda:0"] - extra["mps"] == 2 * (reduce.GROUP_BYTES + layer)
    few = {device: estimates.working(shape(device), keep, n, Masks(), [0, 1]) for device in ("cuda:0", "mps")}
    assert few["cuda:0"] - few["mps"] == 2 * 2 * layer
