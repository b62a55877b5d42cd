"""Allow-sets: which keys each query of a layer may see, made whole, a block of rows at a time, or arithmetically for
the plain causal mask, and per head where heads have masks of their own; and the sink key a mask leaves open
(docs/methods.md#auto-key). :class:`AllowSets` is the run's half that makes and shares them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from attnviz.core import devices, kernels
from attnviz.core.interventions import Intervention
from attnviz.core.masks import Mask, keep_self_if_empty

# Allow-sets up to this size are made whole, once per mask, and shared by every layer with that mask (at 8,192
# tokens, 64 MB: making each block's rows for every layer instead cost 10 % of a statistics capture on the CPU);
# larger ones (1 GB at 32,768 tokens) are made a block of rows at a time (RowwiseAllow) where the route allows.
WHOLE_ALLOW_BYTES = int(os.environ.get("ATTNVIZ_WHOLE_ALLOW_MB", "256")) * 2**20
_NO_KEY_MASK = Intervention.key_mask


CHUNK_ELEMENTS = 1 << 24  # allow-set cells read at once when a layout is counted from a mask (16 MB of bools)


class Layout:
    """What the statistics need of a layer's (n_q, n_kv) allow-set, without a temporary of n_q × n_kv
    elements: how many queries see each key (``col_counts``), how many keys each query sees
    (``row_counts``), whether query i sees key i (``diagonal``) and key 0 (``key0``), and the pooled grid of cells under which anything is allowed
    (:meth:`seen`). The plain causal mask's are arithmetic (:meth:`causal`); any other mask's are counted
    from its allow-set a chunk of rows at a time (:meth:`of`), on the allow-set's device."""

    def __init__(self, n_q: int, n_kv: int, col_counts, row_counts, diagonal, key0, seen_of):
        self.n_q, self.n_kv = n_q, n_kv
        self.col_counts, self.row_counts, self.diagonal, self.key0 = col_counts, row_counts, diagonal, key0
        self._seen_of = seen_of

    def seen(self, factor: int) -> torch.Tensor:
        """(⌈n_q / f⌉, ⌈n_kv / f⌉) bool: the f × f cells under which the mask allows anything."""
        return self._seen_of(factor)

    @classmethod
    def causal(cls, n: int, device) -> "Layout":
        """The plain causal mask of n queries over the same n keys: query i sees keys 0..i."""
        index = torch.arange(n, device=device, dtype=torch.float32)
        ones = torch.ones(n, dtype=torch.bool, device=device)

        def seen_of(f: int) -> torch.Tensor:  # a cell (a, b) holds some k ≤ i exactly when b ≤ a
            cells = -(-n // f)
            return torch.ones(cells, cells, dtype=torch.bool, device=device).tril_()

        return cls(n, n, n - index, index + 1, ones, ones, seen_of)

    @classmethod
    def of(cls, allow: torch.Tensor) -> "Layout":
        """Counted from an (n_q, n_kv) bool allow-set, ``CHUNK_ELEMENTS`` cells at a time."""
        n_q, n_kv = allow.shape
        rows = max(1, CHUNK_ELEMENTS // max(n_kv, 1))
        col_counts = torch.zeros(n_kv, dtype=torch.int32, device=allow.device)
        row_counts = torch.empty(n_q, dtype=torch.int32, device=allow.device)
        for r0 in range(0, n_q, rows):
            chunk = allow[r0:r0 + rows]
            col_counts += chunk.sum(0, dtype=torch.int32)
            row_counts[r0:r0 + rows] = chunk.sum(-1, dtype=torch.int32)
        n = min(n_q, n_kv)
        diagonal = torch.zeros(n_q, dtype=torch.bool, device=allow.device)
        diagonal[:n] = torch.diagonal(allow[:n, :n])  # query i and key i, as LayerSummary.add reads them

        def seen_of(f: int) -> torch.Tensor:
            step = max(f, rows // f * f)  # whole cells of f rows at a time
            grid = torch.zeros(-(-n_q // f), -(-n_kv // f), dtype=torch.bool, device=allow.device)
            for r0 in range(0, n_q, step):
                chunk = allow[r0:r0 + step]
                pad = (0, -n_kv % f, 0, -chunk.shape[0] % f)
                cells = torch.nn.functional.pad(chunk, pad).view(-1, f, grid.shape[1], f)
                grid[r0 // f:r0 // f + cells.shape[0]] = cells.any(3).any(1)
            return grid

        return cls(n_q, n_kv, col_counts.float(), row_counts.float(), diagonal, allow[:, 0].clone(), seen_of)


class AllowSets:
    """The run's allow-sets (a mixin of :class:`attnviz.core.run.Run`, whose fields it reads): made once per mask,
    length and device, and shared by the layers with that mask."""

    def allow(self, layer: int, n_q: int, n_kv: int, window: int | None, device) -> torch.Tensor:
        """(B, 1, n_q, n_kv) boolean allow-set for a layer, shared by layers with the same mask.

        The model's own sliding window (Mistral, Qwen2, Gemma2 ...) bounds causal-type layers only,
        as in the stock model (``i - j < w``); BIDIR/BACK-type layers see the whole sequence, as in
        seed 000's reference code (docs/methods.md#per-layer-architectures).
        """
        mask = self.masks[layer]
        key = (id(mask), n_q, n_kv, window, torch.device(device))  # a device map puts layers on several devices
        if key not in self._allow_cache:
            self._allow_cache[key] = self.allow_rows(layer, n_q, n_kv, window, device, 0, n_q)
        return self._allow_cache[key]

    def allow_rows(self, layer: int, n_q: int, n_kv: int, window: int | None, device, q0: int,
                   q1: int) -> torch.Tensor:
        """(B, 1, q1 - q0, n_kv): query rows q0 .. q1 - 1 of :meth:`allow`, made alone (a row's allowed keys
        depend on that row only, keep-self included)."""
        mask = self.masks[layer]
        kv_pos = self.positions[:, -n_kv:].to(device)
        q_pos = self.query_positions(n_q, device)[:, q0:q1]
        allow = mask.allow(q_pos[:, None, :, None], kv_pos[:, None, None, :])
        if window and mask.causal_type:
            allow = allow & ((q_pos[:, None, :, None] - kv_pos[:, None, None, :]) < window)
        allow = allow & self.valid[:, -n_kv:].to(device)[:, None, None, :]
        return keep_self_if_empty(allow, n_kv - n_q + q0)

    def rowwise(self, layer: int, n_q: int, n_kv: int, window: int | None, device) -> "RowwiseAllow":
        """The layer's allow-set as a :class:`RowwiseAllow` (made a block of rows at a time, never n_q × n_kv
        at once), shared by layers with the same mask like :meth:`allow`."""
        key = ("rowwise", id(self.masks[layer]), n_q, n_kv, window, torch.device(device))
        if key not in self._allow_cache:
            self._allow_cache[key] = RowwiseAllow(self, layer, n_q, n_kv, window, torch.device(device))
        return self._allow_cache[key]

    def block_rows(self, row_elements: int, device=None) -> int:
        """Query rows per block so that a block's fp32 scores stay within ``block_bytes`` (by default
        16 MB on the CPU and a share of free memory on a GPU, read once per run and device)."""
        budget = self.block_bytes
        if budget is None:
            device = torch.device(device or "cpu")
            if ("block", device) not in self._device_cache:
                self._device_cache["block", device] = devices.block_bytes(device)
            budget = self._device_cache["block", device]
        return max(1, budget // (4 * max(row_elements, 1)))

    def key_ranges(self, layer: int, allow: torch.Tensor, rows: int, narrow: bool) -> list[tuple[int, int]]:
        """[k0, k1) of every block of ``rows`` query rows: the keys its rows may see when ``narrow``,
        else all. Computed on the device and read back in one transfer, shared by layers with one
        allow-set: the block loop itself never waits for the device."""
        n_q, n_kv = allow.shape[-2], allow.shape[-1]
        if not narrow:
            return [(0, n_kv)] * -(-n_q // rows)
        key = ("ranges", id(allow), rows, layer if self.has_head_mask(layer) else None)  # head masks: per layer
        if key not in self._allow_cache:
            self._allow_cache[key] = [tuple(r) for r in _block_ranges(allow, rows).tolist()]
        return self._allow_cache[key]

    def key_range_tensor(self, allow: torch.Tensor, rows: int) -> torch.Tensor:
        """The (blocks, 2) key ranges of :meth:`key_ranges`, left on the device (the fused kernel reads them)."""
        key = ("range tensor", id(allow), rows)
        if key not in self._allow_cache:
            self._allow_cache[key] = _block_ranges(allow, rows).to(torch.int32)
        return self._allow_cache[key]

    def allow_bits(self, allow: torch.Tensor) -> torch.Tensor:
        """A (B, 1, n_q, n_kv) allow-set packed 32 keys to a word for the fused kernel
        (:func:`attnviz.core.kernels.pack_allow`), made once per mask."""
        key = ("bits", id(allow))
        if key not in self._allow_cache:
            self._allow_cache[key] = kernels.pack_allow(allow[0, 0])
        return self._allow_cache[key]

    def valid_on(self, device) -> torch.Tensor:
        """``valid`` on ``device``, copied there once per run."""
        key = ("valid", torch.device(device))
        if key not in self._device_cache:
            self._device_cache[key] = self.valid.to(device)
        return self._device_cache[key]

    def sink_key(self, layer: int) -> int:
        """The position of the layer's sink key under its mask and the model's window there (:func:`auto_key`),
        over the run's longest row; once per layer. The window is the one the layer's attention was called
        with (a block's output hook runs after its attention)."""
        key = ("sink key", layer)
        if key not in self._allow_cache:
            n = int(self.positions.max()) + 1
            self._allow_cache[key] = auto_key(self.masks[layer], n, self.windows.get(layer))
        return self._allow_cache[key]

    def has_head_mask(self, layer: int) -> bool:
        """Whether some heads of ``layer`` see fewer keys than its mask allows: a compressed cache's kept keys
        (``head_masks``) or an intervention's per-head key mask (``headwindow``)."""
        return layer in self.head_masks or any(type(a).key_mask is not _NO_KEY_MASK
                                               for a in self.interventions.at(layer))

    def head_mask(self, layer: int, n_heads: int, n_q: int, n_kv: int, device) -> torch.Tensor:
        """The (H, n_q, n_kv) per-head allow-set of ``layer``: every head mask of the layer and-ed together."""
        masks = [self.head_masks[layer](n_q, n_kv, device)] if layer in self.head_masks else []
        kv_pos, q_pos = self.positions[0, -n_kv:].to(device), self.query_positions(n_q, device)[0]
        for intervention in self.interventions.at(layer):
            made = intervention.key_mask(q_pos, kv_pos, n_heads)
            if made is not None:
                masks.append(made)
        out = masks[0]
        for more in masks[1:]:
            out = out & more
        return out


class RowwiseAllow:
    """A layer's (B, 1, n_q, n_kv) allow-set that is never made whole: :meth:`rows` makes a block of query rows
    on the layer's device (the block route asks for each block's rows as it goes), :meth:`host` the whole set
    on the host, a chunk of rows at a time (what a capture keeps). Used by the block route when every
    recorder takes the layer block by block: nothing n_q × n_kv is then made on the device."""

    def __init__(self, run, layer: int, n_q: int, n_kv: int, window: int | None, device: torch.device):
        self.run, self.layer, self.window, self.device = run, layer, window, device
        self.shape = (run.valid.shape[0], 1, n_q, n_kv)

    def rows(self, q0: int, q1: int) -> torch.Tensor:
        return self.run.allow_rows(self.layer, self.shape[2], self.shape[3], self.window, self.device, q0, q1)

    def __getitem__(self, index) -> torch.Tensor:
        """Indexing makes the whole set (B, 1, n_q, n_kv) first, as :meth:`Run.allow` would have: for a reader
        of ``run.allowed`` that wants it whole (the capture reads :meth:`host` instead)."""
        return self.rows(0, self.shape[2])[index]

    def host(self):
        import numpy as np

        n_q, n_kv = self.shape[2], self.shape[3]
        out = np.empty((n_q, n_kv), dtype=bool)
        step = max(1, CHUNK_ELEMENTS // max(n_kv, 1))
        for q0 in range(0, n_q, step):
            out[q0:q0 + step] = self.run.allow_rows(self.layer, n_q, n_kv, self.window, "cpu", q0,
                                                    min(q0 + step, n_q))[0, 0].numpy()
        return out


def _rows(allow, q0: int, q1: int) -> torch.Tensor:
    """Rows q0 .. q1 - 1 of an allow-set, whole (a tensor) or :class:`RowwiseAllow`."""
    return allow.rows(q0, q1) if isinstance(allow, RowwiseAllow) else allow[:, :, q0:q1]


@dataclass(frozen=True)
class CausalAllow:
    """A recorded layer's plain causal allow-set of ``n`` tokens, not made on the device: the fused route
    needs none (:class:`attnviz.core.reduce.Layout`); the host's copy is made once per length
    (:func:`attnviz.capture.host_allowed`)."""

    n: int

    def host(self):
        import numpy as np

        return np.tri(self.n, dtype=bool)


def _block_ranges(allow: torch.Tensor, rows: int) -> torch.Tensor:
    """(blocks, 2) [first, last + 1) of the keys any row of each block of ``rows`` query rows of a
    (B, 1, n_q, n_kv) allow-set may see (every key for a block that sees none), on allow's device."""
    n_q, n_kv = allow.shape[-2], allow.shape[-1]
    seen = torch.stack([_rows(allow, q0, min(q0 + rows, n_q)).any(2).any(1).any(0)
                        for q0 in range(0, n_q, rows)])  # (blocks, n_kv)
    index = torch.arange(n_kv, device=seen.device)
    first = torch.where(seen, index, n_kv).amin(-1)
    last = torch.where(seen, index, -1).amax(-1) + 1
    none = ~seen.any(-1)
    return torch.stack([torch.where(none, 0, first), torch.where(none, n_kv, last)], dim=-1)


def auto_key(mask: Mask, n: int, window: int | None = None) -> int:
    """The sink key's position under ``mask`` (and the model's own sliding ``window`` on causal-type layers, as the
    attention applies it) over a text of ``n`` tokens: :func:`attnviz.stats.metrics.auto_key`, the one
    definition (docs/methods.md#auto-key), read from the allow-set's first columns only (n × 64 at most, nothing
    n × n). A position counted from a row's first real token, as ``patch`` compares it: in a left-padded batch
    it is the same token of every row."""
    from attnviz.stats import metrics

    columns = metrics.auto_key_limit(n)
    i, j = torch.arange(n)[:, None], torch.arange(columns)[None, :]
    allow = mask.allow(i[None, None], j[None, None])[0, 0]
    if window and mask.causal_type:
        allow = allow & ((i - j) < window)
    return metrics.auto_key(allow.numpy())
