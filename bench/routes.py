"""Contributions of every layer (routes) against a plain capture of every layer's full maps, same text, same run.

    python bench/routes.py [--n 1024] [--repeat 1] [--model default] [--device cuda] [--dense]

The default model is loaded once and warmed up with a short pass of each; then, alternating, ``capture`` keeps
every layer's full attention maps (what the Heatmaps page asks), and ``trace`` measures every layer's
contributions (what ``attnviz routes`` and the Routes page run). Ends with
``routes n=<N> capture_s=<s> routes_s=<s> ratio=<routes/capture>`` (the goal at 1,024 tokens: ratio <= 3).
Run it on a quiet machine: anything else running moves both sides. On a GPU routes take one Triton pass a layer
(attnviz.flow.contributions.attention_raw_triton), which skips the blocks of stream dimensions no key can pass;
``--dense`` times it without skipping, the cost on any weights (a model with random weights skips otherwise than a
trained one: bench/random_model.py).

    python bench/routes.py --count-ops [--n 1024]

counts instead what a GPU would be asked to do, on this CPU: the torch operations each side dispatches (on
CUDA, about one kernel launch each; views included) and the reads that make the host wait for the device
(``nonzero``, a tensor's truth, a scalar, a copy to pageable memory or a list), with routes on the route a GPU
takes (the Triton pass counted as one launch a layer, not run: its numbers are not read; the kept entries on the
device) and the capture's full maps staged on the device as a GPU with room for a layer stages them. A layer's
counts, read from a queued copy after the next layer is queued (the device busy meanwhile), are counted apart.
Prints ``routes-ops n=<N> capture_ops=<k> routes_ops=<k> ops_ratio=<x> capture_waits=<k> routes_waits=<k>
routes_reads_behind=<k>``.
A count, not a time: it is the same on a busy machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--count-ops", action="store_true", help="count dispatched operations instead of timing")
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: as attnviz.load chooses)")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: as attnviz.load chooses)")
    parser.add_argument("--dense", action="store_true", help="the GPU's routes pass without skipping dimensions")
    parser.add_argument("--profile", action="store_true", help="also print a profile of one routes run (a GPU)")
    args = parser.parse_args()

    from attnviz import corpus, load
    from attnviz.capture import capture
    from attnviz.flow import contributions
    from attnviz.flow.trace import trace

    from common import sync

    contributions.ROUTE_SKIP = not args.dense
    lm = load(args.model, dtype=args.dtype, device=args.device)
    capture(lm, "warm up", "fwd")
    trace(lm, "warm up")
    ids = corpus.head_ids(lm.tokenizer, corpus.stdlib().text, args.n)
    text = corpus.text_of(lm.tokenizer, ids)
    if args.count_ops:
        count_ops(lm, text, args.n)
        return
    times: dict[str, list[float]] = {"capture": [], "routes": []}
    for _ in range(args.repeat):
        sync(lm.model)
        start = time.perf_counter()
        cap = capture(lm, text, "fwd")
        sync(lm.model)
        times["capture"].append(time.perf_counter() - start)
        del cap
        start = time.perf_counter()
        flow = trace(lm, text)
        sync(lm.model)
        times["routes"].append(time.perf_counter() - start)
        del flow
    if args.profile:
        from common import profiled

        profiled(lambda: trace(lm, text), f"routes n={args.n}")
    capture_s, routes_s = statistics.median(times["capture"]), statistics.median(times["routes"])
    print(f"routes n={args.n} device={lm.model.device} dtype={lm.model.dtype} dense={args.dense} "
          f"capture_s={capture_s:.3f} routes_s={routes_s:.3f} ratio={routes_s / capture_s:.2f}")


def count_ops(lm, text: str, n: int) -> None:
    """Operations dispatched, and the ones a GPU would make the host wait on, by a capture and by routes on the
    torch path."""
    from unittest import mock

    import torch

    from attnviz.capture import capture
    from attnviz.flow import contributions
    from attnviz.flow.trace import trace

    from common import dispatch_counter

    copies = []  # and every copy to the host (on a CPU tensor a no-op that dispatches nothing): counted at the call
    real_cpu, real_tolist = torch.Tensor.cpu, torch.Tensor.tolist

    launches = []

    class Launch:  # the routes kernel's launch, counted and not run (interpreting it here would take minutes)
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(1)

    from attnviz.flow import _triton_routes

    counted = {}
    from attnviz.core.sizing.sizes import Sizes
    from attnviz.core.model.devices import HostCopy

    trace_mod = sys.modules["attnviz.flow.trace"]
    behind, forward = [], {"on": True}  # results read during the forward: a layer's, after the next one is queued
    real_result, real_landed = HostCopy.result, trace_mod._Tracer.landed

    def result(self):
        if forward["on"]:
            behind.append(1)
        return real_result(self)

    def landed(self, *args):
        forward["on"] = False
        return real_landed(self, *args)

    # full maps staged on the device and copied once a layer, as on a GPU with room for a layer
    with mock.patch.object(Sizes, "stages", staticmethod(lambda nbytes, device: True)), mock.patch.object(
            contributions, "on_gpu", lambda tensor: True), mock.patch.object(
            _triton_routes, "raw_tile", Launch()), mock.patch.object(
            torch.Tensor, "cpu", lambda self, *a, **k: copies.append(1) or real_cpu(self, *a, **k)), mock.patch.object(
            torch.Tensor, "tolist", lambda self: copies.append(1) or real_tolist(self)), mock.patch.object(
            HostCopy, "result", result), mock.patch.object(trace_mod._Tracer, "landed", landed):
        for name, run in (("capture", lambda: capture(lm, text, "fwd")), ("routes", lambda: trace(lm, text))):
            copies.clear()
            launches.clear()
            behind.clear()
            forward["on"] = True
            with torch.no_grad(), dispatch_counter() as count:
                run()
            count.waits += len(copies)
            count.ops += len(launches)
            count.behind = len(behind) if name == "routes" else 0
            counted[name] = count
    print(f"routes-ops n={n} capture_ops={counted['capture'].ops} routes_ops={counted['routes'].ops} "
          f"ops_ratio={counted['routes'].ops / counted['capture'].ops:.2f} capture_waits={counted['capture'].waits} "
          f"routes_waits={counted['routes'].waits} routes_reads_behind={counted['routes'].behind}")


if __name__ == "__main__":
    main()
