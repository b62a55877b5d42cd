"""The machine the doctor runs on: the device it picks (:func:`pick_device`) and what the report says of the
environment (:func:`environment`): versions, every device with its free memory, the model's device and dtype."""

from __future__ import annotations

import os
import platform

import torch

from attnviz import settings
from attnviz.core.model import devices
from attnviz.core.loading.models import LoadedModel
from attnviz.doctor.compare import dtype_name


def pick_device(asked: str = "auto") -> str:
    """``auto``: ``ATTNVIZ_DEVICE`` when set, else CUDA, else MPS, else the CPU; an asked device that is not here
    is refused in one line."""
    from attnviz.errors import InputError

    have = {"cpu": True, "cuda": torch.cuda.is_available(),
            "mps": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())}
    if asked == "auto":
        if settings.active().device:  # ATTNVIZ_DEVICE, read by the command (attnviz.settings)
            return devices.default_device()
        return "cuda" if have["cuda"] else "mps" if have["mps"] else "cpu"
    if asked not in have:
        raise InputError(f"unknown device '{asked}': expected auto, cpu, cuda or mps")
    if not have[asked]:
        raise InputError(f"this machine has no {asked} device (torch {torch.__version__} sees: "
                         f"{', '.join(d for d, ok in have.items() if ok)})")
    return asked


def _compiled_routes() -> bool:
    """Whether routes' exact correction runs as its compiled loop on the CPU (:mod:`attnviz.flow.kernel`, which
    needs numba)."""
    try:
        from attnviz.flow import kernel  # noqa: F401
    except ImportError:
        return False
    return True


def environment(loaded: LoadedModel | None = None) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    try:  # the host's available memory (Linux, macOS); None where the system does not say
        free_cpu = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
    except (ValueError, OSError, AttributeError):
        free_cpu = None
    found = [{"name": "cpu", "free_mb": free_cpu, "cores": os.cpu_count()}]
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        free, total = torch.cuda.mem_get_info(i)
        found.append({"name": f"cuda:{i} {torch.cuda.get_device_name(i)}", "free_mb": free // 2**20,
                      "total_mb": total // 2**20,
                      "capability": ".".join(map(str, torch.cuda.get_device_capability(i)))})
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        found.append({"name": "mps", "free_mb": None})
    env = {"attnviz": v("attnviz") or "source", "torch": torch.__version__, "transformers": v("transformers"),
           "triton": v("triton"), "python": platform.python_version(), "platform": platform.platform(terse=True),
           # the user's setting; the doctor's checks choose their route by argument (attnviz.core.engine.routes.forcing)
           "devices": found, "fused_kernel": {None: "auto", True: "1", False: "0"}[settings.active().fused],
           # routes' exact correction on the CPU: the compiled loop where numba is installed, else torch's gathers
           # (the same numbers, about 2.4 times the time: docs/methods.md#contributions)
           "routes_correction": (f"compiled (numba {v('numba')})" if _compiled_routes()
                                 else "torch (numba not installed)")}
    if loaded is not None:
        env.update(model=loaded.model_id, device=str(loaded.model.device), dtype=dtype_name(loaded.model.dtype),
                   layers=loaded.n_layers, heads=loaded.n_heads)
    return env
