"""Every allocation a computation makes on the CPU, tracked (the plans' tests: ``test_sizing.py``, ``test_budget.py``).

- torch: a ``TorchDispatchMode`` sees every operator. Each CPU tensor an operator makes in new storage (a view, an
  in-place or ``out=`` operator, or a ``to``/``reshape`` that returns its input, makes none) is counted by its
  storage's bytes until that storage is freed (a ``weakref.finalize`` on the storage, which torch keeps alive
  exactly as long as the memory). Allocations inside an operator's own kernel (workspaces) are not seen.
- numpy: numpy reports its data allocations to ``tracemalloc``, which the dispatch mode reads at every operator
  (Python objects are counted there too: small beside the arrays). At each operator the numpy peak since the
  previous operator is added to the torch bytes live after the previous operator, so the peak is not missed
  between operators.

Deterministic: the same operators allocate the same sizes on every run; nothing is timed.
"""

import gc
import tracemalloc
import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class Allocations(TorchDispatchMode):
    """Every CPU tensor storage made while it is active, and numpy's allocations (module docstring)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}  # id of a storage -> its bytes, while it lives
        self.events: list[tuple[int, int]] = []  # (storage, +bytes when made, -bytes when freed), in order
        self.torch = self.last = self.peak = self.numpy_base = 0
        self._fresh: dict = {}

    def __enter__(self):
        gc.collect()
        tracemalloc.start()
        self.numpy_base = tracemalloc.get_traced_memory()[0]
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._numpy_peak()
        tracemalloc.stop()
        return out

    def _numpy_peak(self) -> None:
        """The numpy peak since the last operator, beside the torch bytes live after it."""
        _, between = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        self.peak = max(self.peak, self.last + between - self.numpy_base)

    def _freed(self, key: int) -> None:
        size = self.live.pop(key)
        self.torch -= size
        self.events.append((key, -size))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._numpy_peak()
        out = func(*args, **(kwargs or {}))
        if func not in self._fresh:  # per output: whether the schema says it may alias an input
            self._fresh[func] = tuple(r.alias_info is None for r in func._schema.returns)
        inputs = None
        for fresh, tensor in zip(self._fresh[func], out if isinstance(out, (tuple, list)) else (out,)):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            if not fresh:  # new storage only where no input holds it (`to` to another dtype, a copying reshape)
                if inputs is None:
                    inputs = {a.untyped_storage().data_ptr() for a in pytree.tree_leaves((args, kwargs))
                              if isinstance(a, torch.Tensor)}
                if storage.data_ptr() in inputs:
                    continue
            key = id(storage)
            if key not in self.live:
                self.live[key] = storage.nbytes()
                self.torch += storage.nbytes()
                self.events.append((key, storage.nbytes()))
                weakref.finalize(storage, self._freed, key)
        self.last = self.torch
        used, _ = tracemalloc.get_traced_memory()
        self.peak = max(self.peak, self.torch + used - self.numpy_base)
        return out

    def working(self) -> int:
        """The peak of the torch bytes that did not outlive the tracking."""
        kept, now, peak = set(self.live), 0, 0
        for key, size in self.events:
            if key not in kept:
                now += size
                peak = max(peak, now)
        return peak
