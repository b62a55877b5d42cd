"""What the benchmarks share so that each runs on whatever device the model was loaded on (a GPU where one is
present, as ``attnviz.load`` chooses): token ids made on the model's device, and a clock that waits for the device
before it reads the time (a CUDA call returns before its kernels finish)."""

from __future__ import annotations

import time

from attnviz import settings

# a benchmark is a front end: it reads ATTNVIZ_* once, as the CLI does, and hands them to the library
settings.use(settings.Settings.from_environment())


def ids_on(model, ids, **kwargs):
    """``ids`` (a list of token ids, or a list of such lists) as a (1, n) or (B, n) long tensor on ``model``'s
    device: a CPU tensor handed to a CUDA model stops its embedding ("index is on cpu, different from other tensors
    on cuda:0")."""
    import torch

    rows = ids if ids and isinstance(ids[0], (list, tuple)) else [ids]
    return torch.tensor(rows, dtype=torch.long, device=_device(model), **kwargs)


def _device(model):
    return getattr(model, "device", None) or next(model.parameters()).device


def sync(model) -> None:
    """Wait for ``model``'s device to finish what was queued (nothing to wait for on a CPU)."""
    import torch

    device = _device(model)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(model, fn) -> float:
    """Seconds ``fn()`` takes, the device's queued work included."""
    sync(model)
    start = time.perf_counter()
    fn()
    sync(model)
    return time.perf_counter() - start


def profiled(fn, title: str, rows: int = 18) -> None:
    """One run of ``fn`` under torch's profiler on a GPU: its kernels by GPU time, the host's time and the launches."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    print(f"# profile {title}: launches={launches}", flush=True)
    print(events.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60), flush=True)


#: reads that make a GPU's host wait for the device: data-dependent shapes, a tensor's truth, a scalar
WAITS = {"aten.nonzero.default", "aten.nonzero_numpy.default", "aten.is_nonzero.default", "aten.item.default",
         "aten._local_scalar_dense.default"}


def dispatch_counter():
    """A torch dispatch mode that counts, while it is entered, every operation dispatched (``.ops``; on CUDA about
    one launch each, views included), those of them that make a GPU's host wait (``.waits``, :data:`WAITS`), and the
    bytes they write (``.written``: :func:`written_bytes`): on a GPU, bytes the device's memory takes in."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = self.waits = self.written = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self.waits += str(func) in WAITS
            out = func(*args, **(kwargs or {}))
            self.written += written_bytes(func, args, kwargs, out)
            return out

    return Count()


def written_bytes(func, args, kwargs, out) -> int:
    """The bytes ``func`` wrote into its outputs ``out``: each output's, except a view, an output that its schema
    may alias to an input, that ``func`` does not write, and that shares an input's memory (under inference mode a
    conversion or a ``contiguous`` reaches the dispatcher as one such operation and copies: it counts). An in-place
    or ``out=`` operation's output counts, so a buffer made by ``empty`` and then filled counts twice: a count of
    what is written, not a bound on it. A meta tensor, which has no memory, is a view where its schema says so."""
    import torch
    from torch.utils._pytree import tree_leaves

    outputs = tree_leaves(out)
    returns = func._schema.returns
    memory = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs or {}))
              if isinstance(t, torch.Tensor) and t.device.type != "meta"}
    total = 0
    for i, tensor in enumerate(outputs):
        if not isinstance(tensor, torch.Tensor):
            continue
        alias = returns[min(i, len(returns) - 1)].alias_info if returns else None
        view = alias is not None and not alias.is_write and (
            tensor.device.type == "meta" or tensor.untyped_storage().data_ptr() in memory)
        if not view:
            total += tensor.numel() * tensor.element_size()
    return total
