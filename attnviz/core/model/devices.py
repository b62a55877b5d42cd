"""Where attention runs (docs/methods.md#devices): block sizes from free device memory, host copies of finished
results, and out-of-memory errors a page or the CLI can explain.

Every statistic is computed on the device of the layer that produced the probabilities, in float32;
only finished results cross to the host. This module holds the few decisions that depend on the
kind of device, so the engine and the reducers stay device-agnostic: nothing here creates a
tensor on the CPU behind a caller's back.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

import torch

from attnviz import settings
from attnviz.errors import AttnvizError

MB = 2**20
CPU_BLOCK_BYTES = 16 * MB  # fp32 scores of one query block on the CPU: fits its L3 cache (bench: 9 % faster than 64 MB)
# On an accelerator a block's working set is at most about three and a half fp32 copies of its scores
# (attnviz.plan.Keep.block_copies: the scores, a recorder's copies, the cast for P·V); a sixteenth of free memory
# per block keeps it well under a quarter of what is free, and 512 MB caps it where more only adds memory (the
# matmuls are long saturated by then). The plan decides each run's block size from this one (attnviz.core.sizing.sizes.Sizes).
DEVICE_BLOCK_SHARE = 16
DEVICE_BLOCK_MAX = 512 * MB


class DeviceMemoryError(AttnvizError):
    """The device ran out of memory during a capture: its cache has been emptied, nothing is kept."""


def default_device() -> str:
    """Where a model loads when no device is named: the settings' ``device`` when set (``ATTNVIZ_DEVICE`` for the
    CLI and the app: ``cpu``, ``cuda``, ``cuda:1``, ``mps``: a shared server that keeps its GPU for other work, or a
    test suite that must give the same results on any machine), else CUDA when this machine has it, else the CPU."""
    return settings.active().device or ("cuda" if torch.cuda.is_available() else "cpu")


def available(device: str) -> str:
    """``device`` when this machine has it, else a :class:`~attnviz.errors.ModelLoadError` in one line naming what
    it has (asked before a model loads: "cuda" on a machine without CUDA, "cuda:3" with two GPUs, a misspelling)."""
    from attnviz.errors import ModelLoadError

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ModelLoadError(f"unknown device '{device}': expected cpu, cuda, cuda:N or mps") from None
    have = ["cpu"]
    if torch.cuda.is_available():
        have += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    if mps:
        have.append("mps")
    missing = ((parsed.type == "cuda" and (not torch.cuda.is_available() or
                                           (parsed.index or 0) >= torch.cuda.device_count()))
               or (parsed.type == "mps" and not mps) or parsed.type not in ("cpu", "cuda", "mps", "meta"))
    if missing:
        raise ModelLoadError(f"this machine has no device '{device}' (torch {torch.__version__} sees: "
                             f"{', '.join(have)})")
    return device


def mapped_device(device_map) -> str:
    """The type of device a model loaded with accelerate's ``device_map`` computes on, which decides its dtype:
    a dict that places any module on a GPU ("cuda:0", an index) or on MPS computes there; one that places
    everything on the CPU and disk computes on the CPU. A named strategy ("auto", "balanced", "sequential")
    fills the GPUs first when there are any; "cpu" is the CPU."""
    if isinstance(device_map, dict):
        types = {"cuda" if isinstance(d, int) else str(d).split(":")[0] for d in device_map.values()}
        return "cuda" if "cuda" in types else "mps" if "mps" in types else "cpu"
    if str(device_map) in ("cpu", "disk"):
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def mb(n: int) -> str:
    return f"{n / MB:,.0f} MB"


def free_bytes(device) -> int | None:
    """Free memory of an accelerator (``torch.cuda.mem_get_info``); None for the CPU and meta, whose
    captures the host memory budget bounds. The settings' ``device_mb`` (``ATTNVIZ_DEVICE_MB``) caps it on any
    device: headroom kept for other processes on a shared GPU, and how the tests give the CPU a small device
    budget."""
    device = torch.device(device)
    cap = settings.active().device_mb
    if cap:
        return int(cap * MB)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return None


def block_bytes(device) -> int:
    """fp32 bytes of one query block's scores: the settings' ``block_mb`` (``ATTNVIZ_BLOCK_MB``) when set, else
    16 MB on the CPU and a share of free memory on a GPU."""
    if settings.active().block_mb:
        return max(1, int(settings.active().block_mb * MB))
    free = free_bytes(device)
    if free is None or torch.device(device).type == "cpu":
        return CPU_BLOCK_BYTES
    return int(min(DEVICE_BLOCK_MAX, max(CPU_BLOCK_BYTES // 4, free // DEVICE_BLOCK_SHARE)))


def host_buffer(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros on the host for results coming from ``device``: pinned when that is a GPU, so the copy
    is one asynchronous DMA instead of a staged one."""
    pinned = torch.device(device).type == "cuda"
    return torch.zeros(shape, dtype=dtype, pin_memory=pinned)


#: device types whose copies to the host may be queued without waiting (``non_blocking`` into pinned memory,
#: an event to wait on): CUDA's. Elsewhere (MPS, XPU) a queued copy to the host is not safe to read without a
#: synchronisation those backends do not give per copy, so the copy waits there.
ASYNC_COPIES = {"cuda"}


class Landing:
    """Results on their way to the host: :meth:`result` waits for them (once, after the forward) and gives numpy
    arrays (:func:`landed`)."""

    def result(self):
        raise NotImplementedError


class HostCopy(Landing):
    """A finished result on its way to the host. From a CUDA GPU it goes into pinned memory with one asynchronous
    copy, queued on the device's stream after the kernels that made it, so the next layer is queued without
    waiting for it (other accelerators copy and wait, :data:`ASYNC_COPIES`); :meth:`result` waits for it (once, after the forward: :meth:`attnviz.core.engine.Run.collect`)
    and gives the numpy array. A CPU tensor is its own host copy."""

    def __init__(self, tensor: torch.Tensor):
        self.event = None
        if tensor.device.type == "cpu":
            self.host = tensor
            return
        queued = tensor.device.type in ASYNC_COPIES
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
        self.host.copy_(tensor, non_blocking=queued)
        if tensor.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(tensor.device))

    def result(self):
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host.numpy()


class PackedCopy(Landing):
    """A finished layer's results on their way to the host together: the tensors of each dtype joined into one on
    the device (one concatenation), one queued copy a dtype into pinned memory and one event, where a
    :class:`HostCopy` of each would cost a pinned buffer, a copy and an event apiece (on a small model on a GPU
    those calls, not the bytes, are the layer's cost: docs/gpu.md). :meth:`result` gives the dict back, numpy
    arrays in their shapes."""

    def __init__(self, values: dict):
        self.values = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
        self.parts: list[tuple[HostCopy, list[tuple[str, tuple, int]]]] = []
        groups: dict = {}
        for k, v in values.items():
            if isinstance(v, torch.Tensor):
                groups.setdefault(v.dtype, []).append((k, v))
        for tensors in groups.values():
            joined = torch.cat([v.reshape(-1) for _, v in tensors]) if len(tensors) > 1 else tensors[0][1].reshape(-1)
            self.parts.append((HostCopy(joined), [(k, tuple(v.shape), v.numel()) for k, v in tensors]))

    def result(self) -> dict:
        out = dict(self.values)
        for copy, layout in self.parts:
            flat, at = copy.result(), 0
            for k, shape, size in layout:
                out[k] = flat[at:at + size].reshape(shape)
                at += size
        return out


def host_copies(values: dict):
    """A finished layer's results sent to the host: from a GPU joined by dtype (:class:`PackedCopy`), each tensor
    of another device by itself (:class:`HostCopy`), the rest as it is; :func:`landed` gives the dict back."""
    if any(isinstance(v, torch.Tensor) and v.device.type in ASYNC_COPIES for v in values.values()):
        return PackedCopy(values)
    return {k: HostCopy(v) if isinstance(v, torch.Tensor) else v for k, v in values.items()}


def landed(values):
    """``values`` (a dict of results, or one) with every :class:`Landing` waited for, as numpy arrays."""
    if isinstance(values, Landing):
        return values.result()
    if isinstance(values, dict):
        return {k: v.result() if isinstance(v, Landing) else v for k, v in values.items()}
    return values


def synchronize(device) -> None:
    """Wait for a GPU's queued work (host copies made with ``non_blocking``); nothing on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_out_of_memory(err: BaseException) -> bool:
    """A device out-of-memory error (``torch.OutOfMemoryError``, or its message from another backend)."""
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def release() -> None:
    """Give back what a failed capture held: Python garbage first, then the GPU's cached blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def describe(model) -> str:
    """'cuda:0 · bfloat16' or 'cpu · float32'; several devices under a device map are listed."""
    placed = getattr(model, "hf_device_map", None)  # a device map: disk-offloaded weights sit on `meta`
    devices = sorted({f"cuda:{d}" if isinstance(d, int) else str(d) for d in placed.values()} if placed
                     else {str(p.device) for p in model.parameters()})
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return f"{' + '.join(devices)} · {dtype}"



@contextmanager
def out_of_memory_explained(what: str):
    """Turn a device out-of-memory error inside the block into a :class:`DeviceMemoryError` that says
    what to do, after emptying the device's cache, so the process (a server's other sessions
    included) goes on with its memory back."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - only out-of-memory errors are translated, and only once
        if isinstance(err, DeviceMemoryError) or not is_out_of_memory(err):
            raise
        del err
        release()
        raise DeviceMemoryError(
            f"the device ran out of memory during {what}; its cache has been emptied. Try a shorter text, "
            "fewer recorded layers, statistics only (a lower full-maps size), or a smaller block size "
            "(ATTNVIZ_BLOCK_MB)") from None


