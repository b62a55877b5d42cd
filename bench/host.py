"""What the host does for a GPU's statistics capture, measured on this CPU: where a small model's capture on a GPU is
bound by the host (SmolLM2 at 4,096 tokens: the GPU worked 22 ms of an H200's 65 ms, docs/gpu.md), its time is the
host's, and the host's work can be counted and timed without a GPU.

    python bench/host.py [--shape thin] [--n 64] [--repeat 15] [--dtype bfloat16] [--layers N]

Builds a random-weight model (bench/gpu.py's shapes; ``thin`` is SmolLM2's 30 layers and 9 / 3 heads with almost no
arithmetic, so what is timed is the framework's and attnviz's own work) and runs, in the same process:

- ``capture``: ``capture(keep=Keep(statistics=True, pool=512))`` on the route a GPU takes (the fused route, forced),
  with the statistics kernel's launch counted and not run, and the results' copies to the host taken as a GPU takes
  them (joined by dtype, one copy each);
- ``sdpa``: one stock forward with transformers' SDPA attention, the baseline of ``bench/gpu.py``.

Prints ``host shape=<s> n=<N> capture_ops=<k> sdpa_ops=<k> extra_ops_per_layer=<x> capture_waits=<k>
capture_copies=<k> extra_mb_per_layer=<MB> capture_ms=<ms> sdpa_ms=<ms> host_ratio=<x>``. The operations are torch's
dispatched operations (on CUDA each is about one launch or, for a view, host work alone) plus the kernel's launches;
the waits are reads that make a GPU's host wait (a scalar, a tensor's truth, ``nonzero``, a list, a copy to pageable
memory); the times are medians of ``--repeat`` alternating runs. ``extra_mb_per_layer`` is what the capture's
operations write beyond SDPA's, a layer (``common.dispatch_counter``'s bytes: views aside; the statistics kernel's
own outputs are the zeroed buffer it is handed): the bytes a GPU's memory takes in outside the kernel. ``--layers``
builds the shape with fewer layers (``--shape llama8b --layers 2``: the 8B shape's layers, what one of them writes,
in a CPU's memory). The counts are the same on a busy machine; the times need a quiet one.
``host_ratio`` stands in for the GPU's time ratio where both sides are bound by the host: an estimate, to be said as
one (docs/gpu.md#the-hosts-share-measured-on-a-cpu).
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import ExitStack
from unittest import mock


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="thin")
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=None, help="layers instead of the shape's")
    args = parser.parse_args()
    print(measure(args.shape, args.n, args.repeat, args.dtype, args.layers), flush=True)


def as_a_gpu_runs(launches: list | None = None) -> ExitStack:
    """Inside: statistics captures on this CPU take the fused route a GPU takes, the statistics kernel's launch
    appended to ``launches`` and not run (its sums stay zero: only the host's work is measured), and finished
    results go to the host as from a GPU (joined by dtype: ``devices.PackedCopy``)."""
    from attnviz.core.engine import routes
    from attnviz.core.kernel import kernels
    from attnviz.core.model import devices

    launches = [] if launches is None else launches

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(grid)

    stack = ExitStack()
    stack.enter_context(mock.patch.object(kernels, "kernel", lambda: Launch()))
    stack.enter_context(mock.patch.object(kernels, "available", lambda: True))
    stack.enter_context(mock.patch.object(devices, "ASYNC_COPIES", {"cuda", "cpu"}))
    stack.enter_context(routes.forcing(fused=True))
    return stack


def count(fn) -> dict:
    """The operations ``fn()`` dispatches, the reads among them that make a GPU's host wait, and its copies to the
    host (``.cpu()``, ``.tolist()``, ``.numpy()`` of a tensor and the joined copies of ``devices.PackedCopy``)."""
    import torch

    from attnviz.core.model import devices
    from common import dispatch_counter

    copies: list = []
    real_cpu, real_tolist, real_host = torch.Tensor.cpu, torch.Tensor.tolist, devices.HostCopy.__init__

    def host_copy(self, tensor):
        copies.append(1)
        real_host(self, tensor)

    launches: list = []
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.Tensor, "cpu",
                                              lambda self, *a, **k: copies.append(1) or real_cpu(self, *a, **k)))
        stack.enter_context(mock.patch.object(torch.Tensor, "tolist", lambda self: copies.append(1) or real_tolist(self)))
        stack.enter_context(mock.patch.object(devices.HostCopy, "__init__", host_copy))
        stack.enter_context(torch.no_grad())
        with as_a_gpu_runs(launches), dispatch_counter() as counted:
            fn()
    return {"ops": counted.ops + len(launches), "waits": counted.waits, "copies": len(copies),
            "launches": len(launches), "written": counted.written}


def measure(shape: str, n: int, repeat: int, dtype: str, layers: int | None = None) -> str:
    import torch

    from attnviz.capture import capture
    from attnviz.plan import Keep
    import gpu

    loaded = gpu.build(shape, "cpu", getattr(torch, dtype), layers)
    text, ids = gpu.text_of(loaded, n)
    keep = Keep(statistics=True, pool=512)
    n_layers = loaded.model.config.num_hidden_layers

    def stats():
        with as_a_gpu_runs():
            return capture(loaded, text, "fwd", keep)

    def sdpa():
        return gpu.stock(loaded, "sdpa", ids)

    with torch.no_grad():
        stats(), sdpa()  # warm up: the first calls make what later ones reuse
        counted = {"capture": count(lambda: capture(loaded, text, "fwd", keep)), "sdpa": count(sdpa)}
        times: dict[str, list[float]] = {"capture": [], "sdpa": []}
        for _ in range(repeat):
            for name, fn in (("capture", stats), ("sdpa", sdpa)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    capture_ms, sdpa_ms = (1e3 * statistics.median(times[k]) for k in ("capture", "sdpa"))
    cap, base = counted["capture"], counted["sdpa"]
    return (f"host shape={shape} n={n} dtype={dtype} capture_ops={cap['ops']} sdpa_ops={base['ops']} "
            f"extra_ops_per_layer={(cap['ops'] - base['ops']) / n_layers:.1f} capture_waits={cap['waits']} "
            f"capture_copies={cap['copies']} "
            f"extra_mb_per_layer={(cap['written'] - base['written']) / n_layers / 1e6:.2f} "
            f"capture_ms={capture_ms:.1f} sdpa_ms={sdpa_ms:.1f} "
            f"host_ratio={capture_ms / sdpa_ms:.2f}")


if __name__ == "__main__":
    main()
