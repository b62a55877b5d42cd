"""Full maps held as the cells that can be non-zero: each query row's span of keys, from its first to its last
non-zero cell over every head (docs/methods.md#full-maps-held-packed).

A causal map keeps only its lower triangle, a sliding window only its band: half of a causal layer's storage, less
under a window. The engine packs on the mask's spans (``AllowSet.spans``: no probability lies outside the mask); an
array given here is packed on the spans of its own non-zero cells, so packing it is exact whatever it holds (a cell
outside every span is zero; a zero inside one is kept as it is).
:class:`PackedMaps` is the ``layer -> (H, n_q, n_kv)`` mapping a :class:`attnviz.captured.Capture` holds: it packs
what it is given and hands back the full array on every read, with the process's last few reads kept whole.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import MutableMapping
from dataclasses import dataclass

import numpy as np

from attnviz.core.spec.allowsets import row_spans

WORTH = 0.75  # pack only where the spans hold at most this share of the cells: else the array is kept whole
READS_KEPT = 4  # whole arrays kept after a read, over every store of the process (a page reads a layer many times)
_READS: OrderedDict = OrderedDict()  # (store's token, layer) -> the whole read-only array, the last read last
_READS_LOCK = threading.Lock()


@dataclass(frozen=True)
class Packed:
    """One layer's (H, n_q, n_kv) map as its rows' spans: row i's keys ``lo[i] .. hi[i] - 1`` of every head, laid
    end to end in ``values`` (H, total) from ``start[i]``."""

    shape: tuple[int, int, int]
    lo: np.ndarray  # (n_q,) int64
    hi: np.ndarray  # (n_q,) int64
    start: np.ndarray  # (n_q + 1,) int64: row i's values are values[:, start[i]:start[i + 1]]
    values: np.ndarray  # (H, total) in the map's dtype

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.lo.nbytes + self.hi.nbytes + self.start.nbytes

    @classmethod
    def empty(cls, shape, lo: np.ndarray, hi: np.ndarray, dtype) -> "Packed":
        """A layer of ``shape`` (H, n_q, n_kv) held on the spans ``lo .. hi``, every cell zero, filled by
        :meth:`put`."""
        start = starts(lo, hi)
        return cls(tuple(shape), lo, hi, start, np.zeros((shape[0], int(start[-1])), dtype=dtype))

    @classmethod
    def of(cls, shape, lo: np.ndarray, hi: np.ndarray, values: np.ndarray) -> "Packed":
        """A layer of ``shape`` whose spans' cells are ``values`` (H, total), gathered as :func:`flat_index` lays
        them out (on the device, before the copy to the host)."""
        return cls(tuple(shape), lo, hi, starts(lo, hi), values)

    def put(self, q0: int, k0: int, block: np.ndarray) -> None:
        """Write ``block`` (H, b, w), the cells of queries q0.. and keys k0.., where they fall in the spans (a cell
        outside every span must be zero: it is not kept)."""
        b, w = block.shape[1:]
        rows = zip(self.lo[q0:q0 + b].tolist(), self.hi[q0:q0 + b].tolist(), self.start[q0:q0 + b].tolist())
        for r, (lo, hi, s) in enumerate(rows):
            a, e = max(lo, k0), min(hi, k0 + w)
            if e > a:
                self.values[:, s + a - lo:s + e - lo] = block[:, r, a - k0:e - k0]

    def full(self) -> np.ndarray:
        """The (H, n_q, n_kv) array, zero outside the spans."""
        out = np.zeros(self.shape, dtype=self.values.dtype)
        for i, (lo, hi, s) in enumerate(zip(self.lo.tolist(), self.hi.tolist(), self.start.tolist())):
            if hi > lo:
                out[:, i, lo:hi] = self.values[:, s:s + hi - lo]
        return out


def starts(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """(n_q + 1,) int64: where each row's cells begin, laid end to end, and the total last."""
    start = np.zeros(len(lo) + 1, dtype=np.int64)
    np.cumsum(hi - lo, out=start[1:])
    return start


def flat_index(lo: np.ndarray, hi: np.ndarray, n_kv: int) -> np.ndarray:
    """The position in a row-major (n_q, n_kv) map of each cell of the spans, in their packed order: a layer's
    ``maps.reshape(H, -1)[:, flat_index]`` is its packed values."""
    start = starts(lo, hi)
    offset = np.arange(len(lo), dtype=np.int64) * n_kv + lo - start[:-1]
    return np.repeat(offset, hi - lo) + np.arange(int(start[-1]), dtype=np.int64)


def spans(maps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`row_spans` of the cells of an (H, n_q, n_kv) array that are non-zero in some head. A negative zero
    counts as non-zero, so it is kept as it is."""
    bits = maps.view(f"u{maps.dtype.itemsize}") if maps.dtype.kind == "f" else maps
    return row_spans(np.logical_or.reduce(bits != 0, axis=0) if maps.shape[0] else np.zeros(maps.shape[1:], bool))


def worth(lo: np.ndarray, hi: np.ndarray, n_kv: int) -> bool:
    """Whether spans ``lo .. hi`` hold at most :data:`WORTH` of the cells of ``len(lo)`` rows of ``n_kv`` keys."""
    return int((hi - lo).sum()) <= WORTH * len(lo) * n_kv


def pack(maps: np.ndarray, lo: np.ndarray | None = None, hi: np.ndarray | None = None) -> "Packed | np.ndarray":
    """``maps`` (H, n_q, n_kv) as :class:`Packed` on its spans (``lo``, ``hi``: given where every cell outside them
    is known to be zero; else found in the values) where they hold at most :data:`WORTH` of its cells; else
    ``maps`` itself."""
    if maps.ndim != 3 or maps.size == 0:
        return maps
    if lo is None or hi is None:
        lo, hi = spans(maps)
    if not worth(lo, hi, maps.shape[2]):
        return maps
    held = Packed.empty(maps.shape, lo, hi, maps.dtype)
    held.put(0, 0, maps)
    return held


class PackedMaps(MutableMapping):
    """``layer -> (H, n_q, n_kv)`` full maps, held packed (:func:`pack`). Reading a layer gives the whole array (a
    fresh one, or one of the last :data:`READS_KEPT` read in this process, which are shared: do not write into
    it); setting one packs it. Safe to read from several threads (the app's shared server)."""

    def __init__(self, items=()):
        self._held: dict = {}
        self._token = object()  # names this store in the reads kept (unique while it lives)
        self._lock = threading.Lock()
        for layer, maps in dict(items).items():
            self[layer] = maps

    def __getitem__(self, layer):
        held = self._held[layer]
        if not isinstance(held, Packed):
            return held
        key = (self._token, layer)
        with _READS_LOCK:
            if key in _READS:
                _READS.move_to_end(key)
                return _READS[key]
        full = held.full()
        full.flags.writeable = False
        with self._lock, _READS_LOCK:
            if self._held.get(layer) is held:  # not replaced while it was unpacked: keep the read
                _READS[key] = full
                while len(_READS) > READS_KEPT:
                    _READS.popitem(last=False)
        return full

    def __setitem__(self, layer, maps) -> None:
        held = maps if isinstance(maps, Packed) else pack(np.asarray(maps))
        with self._lock, _READS_LOCK:
            self._held[layer] = held
            _READS.pop((self._token, layer), None)

    def __delitem__(self, layer) -> None:
        with self._lock, _READS_LOCK:
            del self._held[layer]
            _READS.pop((self._token, layer), None)

    def __iter__(self):
        return iter(list(self._held))

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, layer) -> bool:
        return layer in self._held

    def __repr__(self) -> str:
        return f"PackedMaps(layers={sorted(self._held)}, held_bytes={self.nbytes})"

    def __getstate__(self):
        return {"held": self._held}

    def __setstate__(self, state):
        self.__init__()
        self._held = state["held"]

    @property
    def nbytes(self) -> int:
        """What the maps hold, packed."""
        with self._lock:
            return sum(h.nbytes for h in self._held.values())

    @property
    def held_bytes(self) -> int:
        """What a cache of captures weighs of it: what it holds, packed (the reads kept whole are the process's,
        at most :data:`READS_KEPT` layers over every store)."""
        return self.nbytes

    def packed(self, layer) -> "Packed | np.ndarray":
        """The layer as held: :class:`Packed`, or the whole array where packing would not pay."""
        return self._held[layer]
