"""A second device on a machine that has only a CPU, for proving where attnviz puts its tensors.

:func:`elsewhere` moves a model's weights to a simulated device (``meta`` by name, real CPU numbers inside)
and, while it is active, every operation that mixes a tensor on that device with a CPU tensor of one or
more dimensions fails, as it does on a GPU ("expected all tensors to be on the same device"). What a GPU
allows stays allowed: CPU scalars (0-d tensors), indexing with CPU indices, copies between the two
(``.to``, ``.cpu()``, ``copy_``), ``.tolist()`` and ``.item()``. Factory calls that name the device
(``torch.zeros(..., device=model.device)``) make tensors on it; calls that name none make CPU tensors, as
they would next to a GPU model. ``.numpy()`` of a tensor on the device fails, as on a GPU. Its copies to the
host may be queued, as CUDA's (``devices.ASYNC_COPIES``).

So an entry point that builds a mask, an index or a buffer on the CPU and uses it with the model's tensors
fails here exactly where it would fail on CUDA, while the numbers stay real and every result can be
compared with the same call on the CPU. tests/test_placement.py runs every entry point through it.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
DEVICE = torch.device("meta")  # the name the simulated device goes by
CPU = torch.device("cpu")
# operations a GPU accepts with CPU tensor arguments
HOST_INDICES = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
COPIES = {aten.copy_.default}


#: every copy from the simulated device to the host, in order: ("wait", op) for one that waits for the device
#: (``.cpu()``, ``.item()``, ``.tolist()``, a blocking ``copy_``), ("async", op) for a ``copy_(non_blocking=True)``;
#: and every copy of a host tensor to the device, ("upload", op): from pageable memory, as a CPU tensor is, CUDA's copy
#: waits for every operation queued before it (PyTorch synchronises the stream after it), so the host stops there
TRANSFERS: list[tuple[str, str]] = []


class Misplaced(RuntimeError):
    """A CPU tensor met tensors on the model's device: on a GPU this operation would fail."""


class OnDevice(torch.Tensor):
    """A tensor on the simulated device: its numbers are a CPU tensor inside."""

    @staticmethod
    def __new__(cls, host: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, host.shape, strides=host.stride(), dtype=host.dtype,
                                                   device=DEVICE, requires_grad=host.requires_grad,
                                                   storage_offset=host.storage_offset(), layout=host.layout)

    def __init__(self, host: torch.Tensor):
        assert host.device.type == "cpu", host.device
        self._host = host

    def tolist(self):  # like a GPU tensor's: a copy to the host
        TRANSFERS.append(("wait", "tolist"))
        return self._host.tolist()

    def __repr__(self):
        return f"OnDevice({self._host!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _host_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, OnDevice) and value.device.type == "cpu"


def _named_devices(args, kwargs) -> list[torch.device]:
    named = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.device)]
    if isinstance(kwargs.get("device"), str):
        named.append(torch.device(kwargs["device"]))
    return named


def _run(func, args, kwargs):
    leaves = tree_leaves((args, kwargs))
    on = [t for t in leaves if isinstance(t, OnDevice)]
    host = [t for t in leaves if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice)
            and t.device.type == "cpu" and t.dim() > 0]
    named = _named_devices(args, kwargs)
    if on and host and func not in COPIES and func not in HOST_INDICES and not named:
        raise Misplaced(f"{func}: a CPU tensor of shape {tuple(host[0].shape)} meets tensors on the model's device "
                        f"(shape {tuple(on[0].shape)}); on a GPU this fails")

    def unwrap(value):
        if isinstance(value, OnDevice):
            return value._host
        if isinstance(value, torch.device) and value.type == DEVICE.type:
            return CPU
        return value

    if func is aten._local_scalar_dense.default or (on and named and named[-1].type == "cpu" and func not in COPIES):
        TRANSFERS.append(("wait", str(func)))
    elif func in COPIES and not isinstance(args[0], OnDevice) and isinstance(args[1], OnDevice):
        TRANSFERS.append(("async" if (args[2] if len(args) > 2 else kwargs.get("non_blocking")) else "wait", str(func)))
    elif (func in COPIES and isinstance(args[0], OnDevice) and _host_tensor(args[1])) or (
            func not in COPIES and named and named[-1].type == DEVICE.type and any(map(_host_tensor, leaves))):
        TRANSFERS.append(("upload", str(func)))  # from pageable host memory: on CUDA the host waits for the device
    args2, kwargs2 = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    if isinstance(kwargs2.get("device"), str) and torch.device(kwargs2["device"]).type == DEVICE.type:
        kwargs2["device"] = CPU
    if named:
        to_device = named[-1].type == DEVICE.type
    elif func in COPIES:
        to_device = isinstance(args[0], OnDevice)
    else:
        to_device = bool(on)
    if func is aten.histc.default and not args2[0].is_floating_point():  # CUDA bins integers; the CPU kernel does not
        args2 = (args2[0].float(), *args2[1:])
    out = func(*args2, **kwargs2)
    if func is aten.histc.default and not args[0].is_floating_point():
        out = out.to(args[0].dtype)
    if func in COPIES:
        return args[0]
    if to_device:
        # a view of a tensor made outside inference mode shares its version counter, as on a GPU: its wrapper is
        # made outside inference mode too (an inference tensor has none to share)
        normal = func.is_view and any(not t.is_inference() for t in on)
        with torch.inference_mode(False) if normal else contextlib.nullcontext():
            return tree_map(lambda t: OnDevice(t) if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice)
                            else t, out)
    return out


class _Factories(TorchDispatchMode):
    """Factory calls that name the simulated device make tensors on it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(t, OnDevice) for t in tree_leaves((args, kwargs))):
            return NotImplemented
        named = _named_devices(args, kwargs)
        if named and named[-1].type == DEVICE.type:
            return _run(func, args, kwargs)
        return func(*args, **kwargs)


def to_host(value):
    """A result with every tensor on the simulated device copied to the CPU (for comparing with a CPU run)."""
    return tree_map(lambda t: t._host if isinstance(t, OnDevice) else t, value)


def _from_data(make):
    """``torch.tensor(data, device=...)`` fills its tensor below the dispatcher, out of this module's sight: on
    the simulated device it is made on the CPU and moved there, which is what it does on a GPU."""
    def made(data, *args, device=None, **kwargs):
        if device is not None and torch.device(device).type == DEVICE.type:
            return make(data, *args, **kwargs).to(device)
        return make(data, *args, device=device, **kwargs)
    return made


@contextlib.contextmanager
def elsewhere(model: torch.nn.Module):
    """The model's weights on the simulated device inside (and every operation checked); back on the CPU after."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    from attnviz.core.model import devices

    factories = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}
    devices.ASYNC_COPIES.add(DEVICE.type)  # the simulated device copies to the host as CUDA does
    try:
        model._apply(lambda t: t if isinstance(t, OnDevice) else OnDevice(t.detach()))
        for name, make in factories.items():
            setattr(torch, name, _from_data(make))
        with _Factories():
            yield model
    finally:
        devices.ASYNC_COPIES.discard(DEVICE.type)
        for name, make in factories.items():
            setattr(torch, name, make)
        try:
            model._apply(lambda t: t._host if isinstance(t, OnDevice) else t)
        except RuntimeError:  # a failure's traceback still holds the weights: the model stays where it is
            pass
        torch.__future__.set_swap_module_params_on_conversion(before)
