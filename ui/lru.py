"""A thread-safe LRU mapping bounded by bytes, not by count: one long result can weigh as much as
a thousand short ones, so a count bound says nothing about memory."""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections import OrderedDict
from typing import Any, Hashable

import numpy as np
import torch


def nbytes(obj: Any, _depth: int = 0, _seen: set | None = None) -> int:
    """Approximate resident size: arrays and tensors by their buffers (a buffer shared by several
    arrays, e.g. the allow-set of every layer with the same mask, counts once), containers and
    dataclasses by their parts (to a small depth), anything else by ``sys.getsizeof``."""
    seen = set() if _seen is None else _seen
    if isinstance(obj, (np.ndarray, torch.Tensor)):
        size = int(obj.nbytes) if isinstance(obj, np.ndarray) else int(obj.numel() * obj.element_size())
        pointer = obj.__array_interface__["data"][0] if isinstance(obj, np.ndarray) else obj.data_ptr()
        if (pointer, size) in seen:
            return 0
        seen.add((pointer, size))
        return size
    held = getattr(obj, "held_bytes", None)  # an object that says what it keeps (not what it refers to)
    if isinstance(held, int):
        return held
    if _depth > 4:
        return sys.getsizeof(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(nbytes(getattr(obj, f.name), _depth + 1, seen) for f in dataclasses.fields(obj)) + 64
    if isinstance(obj, dict):
        return sum(nbytes(k, _depth + 1, seen) + nbytes(v, _depth + 1, seen) for k, v in obj.items()) + 64
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(nbytes(x, _depth + 1, seen) for x in obj) + 56
    return sys.getsizeof(obj)


class ByteLRU:
    """Keeps the most recently used entries whose sizes add up to at most ``budget`` bytes.

    An entry larger than the whole budget is not kept (the caller still has its result).
    """

    def __init__(self, budget: int):
        self.budget = int(budget)
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.used = 0

    def get(self, key: Hashable, default=None):
        with self._lock:
            if key not in self._items:
                return default
            self._items.move_to_end(key)
            return self._items[key][0]

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def reserve(self, size: int) -> bool:
        """Evict least recently used entries until ``size`` more bytes fit; False if they never can.

        Called before a computation, so the old entries leave before the new one is built: the
        resident size stays near the budget instead of budget + the new entry."""
        with self._lock:
            if size > self.budget:
                return False
            while self._items and self.used + size > self.budget:
                self.used -= self._items.popitem(last=False)[1][1]
            return True

    def put(self, key: Hashable, value: Any, size: int | None = None) -> bool:
        """Store ``value``; evict the least recently used entries until it fits. True if kept."""
        size = nbytes(value) if size is None else int(size)
        with self._lock:
            if key in self._items:
                self.used -= self._items.pop(key)[1]
            if size > self.budget:
                return False
            while self._items and self.used + size > self.budget:
                self.used -= self._items.popitem(last=False)[1][1]
            self._items[key] = (value, size)
            self.used += size
            return True
