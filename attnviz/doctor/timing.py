"""Speed, reported and never judged: a statistics capture against a plain forward of the same tokens and, on CUDA,
the fused kernel against the block engine, each route chosen by argument (:func:`attnviz.core.engine.routes.forcing`).
Each timed window repeats the call until the plain forward has run for at least :data:`MIN_WINDOW_S`."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from attnviz.core.model import devices
from attnviz.core.kernel import kernels
from attnviz.core.loading.models import LoadedModel
from attnviz.core.engine.routes import forcing
from attnviz.doctor.layers import implementation
from attnviz.doctor.report import Check

MIN_WINDOW_S = 0.25  # a timed window runs the plain forward at least this long (repetitions fill it)
MAX_REPEATS = 200
SPEED_EXPECTED = {"cpu": 3.0, "cuda": 2.0, "mps": 3.0}  # statistics capture / plain SDPA forward: what we aim for


class _Clock:
    """Seconds of the calls inside, on the device: CUDA events on a GPU, the wall clock elsewhere."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    @contextlib.contextmanager
    def window(self, into: list):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            end.synchronize()
            into.append(start.elapsed_time(end) / 1000)
        else:
            devices.synchronize(torch.device("cpu"))
            begun = time.perf_counter()
            yield
            into.append(time.perf_counter() - begun)


def seconds_per_call(fn, device: str, repeats: int, windows: int = 3) -> float:
    """Seconds per call of ``fn``: the median over ``windows`` timed windows of ``repeats`` calls each, after one
    warm-up call."""
    clock, times = _Clock(device), []
    fn()
    devices.synchronize(torch.device(device))
    for _ in range(windows):
        with clock.window(times):
            for _ in range(repeats):
                fn()
    return float(np.median(times)) / repeats


def repeats_for(one_call_s: float) -> int:
    """Calls in a timed window so that it lasts at least ``MIN_WINDOW_S`` (at most ``MAX_REPEATS``)."""
    return int(min(MAX_REPEATS, max(1, np.ceil(MIN_WINDOW_S / max(one_call_s, 1e-6)))))


def speed(loaded: LoadedModel, text: str, device: str) -> list[Check]:
    """A statistics capture against a plain SDPA forward of the same tokens; on CUDA the fused kernel
    against the block engine. Never skipped: a short forward is repeated inside each timed window."""
    from attnviz.capture import capture
    from attnviz.plan import Keep
    from attnviz.tokens import tokenize

    ids, _ = tokenize(loaded, text)
    model = loaded.model
    reference = "sdpa"
    try:  # a family without an SDPA path in transformers (Gemma 2) is timed against its eager forward
        with implementation(model, reference):
            pass
    except ValueError:
        reference = "eager"
    tensor = torch.tensor([ids], device=model.device)

    def plain():
        with implementation(model, reference), torch.inference_mode():
            model(tensor, logits_to_keep=1)

    fell_back: list[str] = []  # a fused launch that failed: the timing would be the block engine's twice

    def statistics(fused: bool | None = None):
        def fn():
            with forcing(fused=fused):
                fell_back.extend(capture(loaded, text, "fwd", Keep(statistics=True)).meta.get("fused_fallback", ()))
        return fn

    repeats = repeats_for(seconds_per_call(plain, device, 1, windows=1))
    base = seconds_per_call(plain, device, repeats)
    stats = seconds_per_call(statistics(), device, repeats)
    expected = SPEED_EXPECTED.get(device, 3.0)
    ratio = stats / base
    name = f"speed: statistics of {len(ids)} tokens vs a plain {'SDPA' if reference == 'sdpa' else reference} forward"
    timing = f"{repeats} call{'s' if repeats > 1 else ''} a window, median of 3 windows"
    checks = [Check.timed(name, ratio, expected, detail=f"{stats * 1000:.1f} ms vs {base * 1000:.1f} ms a call",
                          compared=f"a statistics capture and a plain forward of the same tokens ({timing}"
                                   f"{', CUDA events' if device == 'cuda' else ''})",
                          why=f"{expected:g}x on {device}: what the statistics route aims for over the forward it "
                              "records; a report, not a verdict (stock kernels may be much faster on some CPUs)")]
    if device == "cuda":
        fused = seconds_per_call(statistics(fused=True), device, repeats) if kernels.available() else None
        if fused is not None and not fell_back:
            blocks = seconds_per_call(statistics(fused=False), device, repeats)
            ratio = fused / blocks
            checks.append(Check.timed("speed: fused kernel vs block engine", ratio, 1.0,
                                      detail=f"{fused * 1000:.1f} ms vs {blocks * 1000:.1f} ms a call",
                                      compared=f"a statistics capture through each route ({timing})",
                                      why="the fused kernel exists to be faster than the block engine"))
        else:
            checks.append(Check("speed: fused kernel vs block engine", "SKIP", detail="the fused kernel is not in use"))
    return checks
