"""Allow-sets: which keys each query of a layer may see, made whole, a block of rows at a time, or arithmetically for
the plain causal mask, and per head where heads have masks of their own; and the sink key a mask leaves open
(docs/methods.md#auto-key). :class:`AllowSets` is the run's half that makes and shares them.
"""

from __future__ import annotations

import numpy as np
import torch

from attnviz.core.kernel import kernels
from attnviz.core.spec.masks import Mask, keep_self_if_empty

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
        self._made: dict = {}  # what every layer with this mask reads, made once

    def seen(self, factor: int) -> torch.Tensor:
        """(⌈n_q / f⌉, ⌈n_kv / f⌉) bool: the f × f cells under which the mask allows anything (made once a
        factor: every layer with this mask reads it)."""
        key = ("seen", factor)
        if key not in self._made:
            self._made[key] = self._seen_of(factor)
        return self._made[key]

    def facts(self, device) -> dict:
        """The statistics' facts of the mask on ``device``, float32, made once a device (every layer with this mask
        reads them; read only): ``col_counts``, ``row_counts``, ``self_seen`` (n_kv: whether key i's own query
        sees it), ``key0_allowed`` (bool) and ``query_index``."""
        key = ("facts", str(device))
        if key not in self._made:
            f32 = {"dtype": torch.float32, "device": device}
            n = min(self.n_q, self.n_kv)
            self_seen = torch.zeros(self.n_kv, **f32)
            self_seen[:n] = self.diagonal[:n].to(**f32)
            self._made[key] = {"col_counts": self.col_counts.to(**f32), "row_counts": self.row_counts.to(**f32),
                               "self_seen": self_seen, "key0_allowed": self.key0.to(device),
                               "query_index": torch.arange(self.n_q, **f32)}
        return self._made[key]

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


def row_spans(seen: "np.ndarray") -> tuple["np.ndarray", "np.ndarray"]:
    """(lo, hi) int64 of each row of an (n_q, n_kv) bool array: its first and one past its last true cell (lo = hi = 0
    for a row with none)."""
    n_kv = seen.shape[1]
    any_ = seen.any(1)
    lo = np.where(any_, seen.argmax(1), 0).astype(np.int64)
    hi = np.where(any_, n_kv - seen[:, ::-1].argmax(1), 0).astype(np.int64)
    return lo, hi


class AllowSet:
    """One layer's allow-set: which keys each query may see (B, 1, n_q, n_kv), or each head's own (B, H, ...) where
    the layer's heads have masks of their own. The one type the engine asks, whatever its ``form``:

    - "whole": made once, on the layer's device, and shared by every layer with the same mask;
    - "rows": never made whole on the device, a block of query rows at a time (a large statistics capture);
    - "causal": the plain causal mask on the fused route, arithmetic: nothing is made.

    Per head (:meth:`with_heads`), a block's rows are the layer's rows and-ed with each head's own rows: never
    (H, n_q, n_kv) for the whole layer on the device. What it answers: a block's :meth:`rows`, the set
    :meth:`whole` (SDPA and the fused kernel read it), every block's key :meth:`ranges`, the packed :meth:`bits`,
    the :meth:`layout` counts the statistics read, and the :meth:`host` copies a capture keeps."""

    def __init__(self, form: str, shape: tuple[int, int, int, int], device, make_rows=None, head_rows=None):
        self.form, self.shape, self.device = form, shape, torch.device(device)
        self._make_rows, self._head_rows = make_rows, head_rows
        self._cache: dict = {}

    def with_heads(self, head_rows) -> "AllowSet":
        """This set and-ed, head by head, with ``head_rows(q0, q1)`` (H, b, n_kv): the layer's own per-head set."""
        return AllowSet(self.form if self.form != "causal" else "whole", self.shape, self.device, self.rows,
                        head_rows)

    @property
    def per_head(self) -> bool:
        return self._head_rows is not None

    @property
    def n_q(self) -> int:
        return self.shape[2]

    @property
    def n_kv(self) -> int:
        return self.shape[3]

    def rows(self, q0: int, q1: int) -> torch.Tensor:
        """(B, 1 or H, q1 - q0, n_kv): query rows q0 .. q1 - 1, made alone (a row's keys depend on that row only)."""
        if self.form == "whole" and not self.per_head:
            return self.whole()[:, :, q0:q1]
        if self.form == "causal":
            i = torch.arange(q0, q1, device=self.device)[:, None] + (self.n_kv - self.n_q)
            return (torch.arange(self.n_kv, device=self.device)[None, :] <= i)[None, None]
        base = self._make_rows(q0, q1)
        if self.per_head:
            return keep_self_if_empty(base & self._head_rows(q0, q1)[None], self.n_kv - self.n_q + q0)
        return base

    def whole(self) -> torch.Tensor:
        """(B, 1 or H, n_q, n_kv) on the device, made once (what SDPA and the fused kernel read)."""
        if "whole" not in self._cache:
            if self.form == "whole" and not self.per_head:
                self._cache["whole"] = self._make_rows(0, self.n_q)
            else:
                made = AllowSet("rows" if self.form != "causal" else "causal", self.shape, self.device,
                                self._make_rows, self._head_rows)
                self._cache["whole"] = made.rows(0, self.n_q)
        return self._cache["whole"]

    def ranges(self, rows: int, narrow: bool = True) -> list[tuple[int, int]]:
        """[k0, k1) of every block of ``rows`` query rows: the keys its rows may see when ``narrow``, else all.
        Computed on the device and read back in one transfer, once per set: the block loop never waits."""
        if not narrow:
            return [(0, self.n_kv)] * -(-self.n_q // rows)
        if self.form == "causal":  # rows q0 .. q1 - 1 see keys 0 .. q1 - 1 (+ the cached keys before the queries)
            return [(0, min(q0 + rows, self.n_q) + self.n_kv - self.n_q) for q0 in range(0, self.n_q, rows)]
        if ("ranges", rows) not in self._cache:
            self._cache["ranges", rows] = [tuple(r) for r in self.range_tensor(rows).tolist()]
        return self._cache["ranges", rows]

    def causal_ranges(self, rows: int) -> torch.Tensor:
        """The (blocks, 2) int32 key ranges of blocks of ``rows`` queries under the plain causal mask (a block of
        rows q0.. sees keys 0 .. q0 + rows - 1), by arithmetic, on the device, made once."""
        if ("causal ranges", rows) not in self._cache:
            ends = torch.arange(rows, self.n_q + rows, rows, device=self.device).clamp_(max=self.n_kv)
            self._cache["causal ranges", rows] = torch.stack([torch.zeros_like(ends), ends], dim=-1).to(torch.int32)
        return self._cache["causal ranges", rows]

    def range_tensor(self, rows: int) -> torch.Tensor:
        """The (blocks, 2) int32 key ranges of :meth:`ranges`, left on the device (the fused kernel reads them)."""
        if ("range tensor", rows) not in self._cache:
            self._cache["range tensor", rows] = _block_ranges(self, rows).to(torch.int32)
        return self._cache["range tensor", rows]

    def bits(self) -> torch.Tensor:
        """Packed 32 keys to a word for the fused kernel (:func:`attnviz.core.kernel.kernels.pack_allow`), made once."""
        if "bits" not in self._cache:
            self._cache["bits"] = kernels.pack_allow(self.whole()[0, 0])
        return self._cache["bits"]

    def layout(self) -> "Layout":
        """The counts the statistics read (:class:`Layout`): arithmetic for the causal form."""
        if "layout" not in self._cache:
            self._cache["layout"] = (Layout.causal(self.n_q, self.device) if self.form == "causal"
                                     else Layout.of(self.whole()[0, 0]))
        return self._cache["layout"]

    def _host_rows(self, q0: int, q1: int) -> "np.ndarray":
        return self.rows(q0, q1)[0].cpu().numpy()  # (1 or H, b, n_kv)

    def host(self) -> "np.ndarray":
        """(n_q, n_kv) on the host, the cells some head may see (the layer's mask, where heads have none of their
        own), made a chunk of rows at a time: what a capture keeps."""
        if "host" not in self._cache:
            if self.form == "causal" and self.n_q == self.n_kv:
                self._cache["host"] = np.tri(self.n_q, dtype=bool)
            elif self.per_head:  # the heads' own sets, made once: the layer's cells are those some head sees
                self._cache["host"] = self.head_host().any(0)
            else:
                out = np.empty((self.n_q, self.n_kv), dtype=bool)
                step = max(1, CHUNK_ELEMENTS // max(self.n_kv, 1))
                for q0 in range(0, self.n_q, step):
                    out[q0:q0 + step] = self._host_rows(q0, min(q0 + step, self.n_q)).any(0)
                self._cache["host"] = out
        return self._cache["host"]

    def spans(self) -> tuple["np.ndarray", "np.ndarray"]:
        """(lo, hi) int64 of each query row: its first and one past its last key some head may see (of
        :meth:`host`, made once): the cells a capture's maps are held on (docs/methods.md#full-maps-held-packed)."""
        if "spans" not in self._cache:
            self._cache["spans"] = row_spans(self.host())
        return self._cache["spans"]

    def head_host(self) -> "np.ndarray | None":
        """(H, n_q, n_kv) on the host, each head's own set, where the heads have masks of their own; else None."""
        if not self.per_head:
            return None
        if "head host" not in self._cache:
            self._cache["head host"] = np.concatenate(
                [self._host_rows(q0, min(q0 + 256, self.n_q)) for q0 in range(0, self.n_q, 256)], 1)
        return self._cache["head host"]


class AllowSets:
    """The run's allow-sets (a mixin of :class:`attnviz.core.engine.run.Run`, whose fields it reads): one
    :class:`AllowSet` per (mask, n_q, n_kv, window, device, form), shared by the layers with that mask; a layer
    whose heads have masks of their own gets its own, per head."""

    def allow_set(self, layer: int, n_q: int, n_kv: int, window: int | None, device, form: str = "whole",
                  n_heads: int = 1) -> AllowSet:
        """The layer's :class:`AllowSet` of ``form`` ("whole", "rows" or "causal").

        The model's own sliding window (Mistral, Qwen2, Gemma2 ...) bounds causal-type layers only,
        as in the stock model (``i - j < w``); BIDIR/BACK-type layers see the whole sequence, as in
        seed 000's reference code (docs/methods.md#per-layer-architectures).
        """
        device = torch.device(device)
        key = ("allow", self.masks[layer], n_q, n_kv, window, device, form)  # a device map: several devices
        if key not in self._allow_cache:
            self._allow_cache[key] = AllowSet(
                form, (self.valid.shape[0], 1, n_q, n_kv), device,
                lambda q0, q1: self.allow_rows(layer, n_q, n_kv, window, device, q0, q1))
        made = self._allow_cache[key]
        if not self.has_head_mask(layer):
            return made
        return made.with_heads(lambda q0, q1: self.head_mask(layer, n_heads, n_q, n_kv, device, q0, q1))

    def allow_rows(self, layer: int, n_q: int, n_kv: int, window: int | None, device, q0: int,
                   q1: int) -> torch.Tensor:
        """(B, 1, q1 - q0, n_kv): query rows q0 .. q1 - 1 of the layer's mask (and window, and padding), made
        alone (a row's allowed keys depend on that row only, keep-self included)."""
        mask = self.masks[layer]
        kv_pos = self.positions_on(device)[:, -n_kv:]
        q_pos = self.query_positions(n_q, device)[:, q0:q1]
        allow = mask.allow(q_pos[:, None, :, None], kv_pos[:, None, None, :])
        if window and mask.causal_type:
            allow = allow & ((q_pos[:, None, :, None] - kv_pos[:, None, None, :]) < window)
        allow = allow & self.valid_on(device)[:, -n_kv:][:, None, None, :]
        return keep_self_if_empty(allow, n_kv - n_q + q0)

    def block_rows(self, row_elements: int, device=None) -> int:
        """Query rows per block so that a block's fp32 scores stay within the plan's block size on ``device``
        (``sizes.block_bytes``, :class:`attnviz.core.sizing.sizes.Sizes`), read once per run and device."""
        device = torch.device(device or "cpu")
        if ("block", device) not in self._device_cache:
            self._device_cache["block", device] = self.sizes.block_bytes(device)
        return max(1, self._device_cache["block", device] // (4 * max(row_elements, 1)))

    def valid_on(self, device) -> torch.Tensor:
        """``valid`` on ``device``, copied there once per run."""
        return self._on("valid", self.valid, device)

    def query_positions(self, n_q: int, device) -> torch.Tensor:
        """The last ``n_q`` query positions (the keys' own where queries are the keys) on ``device``."""
        if self.q_positions is None:
            return self.positions_on(device)[:, -n_q:]
        return self._on("query positions", self.q_positions, device)[:, -n_q:]

    def positions_on(self, device) -> torch.Tensor:
        """``positions`` on ``device``, copied there once per run: a copy from pageable host memory makes a GPU's
        host wait for every operation queued before it, so one a layer would keep the host from running ahead."""
        return self._on("positions", self.positions, device)

    def _on(self, name: str, tensor: torch.Tensor, device) -> torch.Tensor:
        key = (name, torch.device(device))
        if key not in self._device_cache:
            self._device_cache[key] = tensor.to(device)
        return self._device_cache[key]

    def sink_key(self, layer: int) -> int:
        """The position of the layer's sink key under its mask and the model's window there (:func:`auto_key`),
        over the run's longest row; once per layer. The window is the one the layer's attention was called
        with (a block's output hook runs after its attention), or before it has run, the model's own there."""
        key = ("sink key", layer)
        if key not in self._allow_cache:
            n = int(self.positions.max()) + 1
            window = (self.windows[layer] if layer in self.windows
                      else self.model_window(layer) if self.model_window is not None else None)
            self._allow_cache[key] = auto_key(self.masks[layer], n, window)
        return self._allow_cache[key]

    def has_head_mask(self, layer: int) -> bool:
        """Whether some heads of ``layer`` see fewer keys than its mask allows: a compressed cache's kept keys
        (``head_masks``) or an intervention's per-head key mask (``headwindow``)."""
        return layer in self.head_masks or self.interventions.masks_heads(layer)

    def head_mask(self, layer: int, n_heads: int, n_q: int, n_kv: int, device, q0: int = 0,
                  q1: int | None = None) -> torch.Tensor:
        """(H, q1 - q0, n_kv): query rows q0 .. q1 - 1 of the per-head allow-set of ``layer``, every head mask of
        the layer and-ed together (an intervention's made for those rows only)."""
        q1 = n_q if q1 is None else q1
        masks = []
        if layer in self.head_masks:  # a compressed cache's (H, n_q, n_kv): made once per layer, not per block
            key = ("head mask", layer, n_q, n_kv, torch.device(device))
            if key not in self._allow_cache:
                self._allow_cache[key] = self.head_masks[layer](n_q, n_kv, device)
            masks.append(self._allow_cache[key][:, q0:q1])
        kv_pos, q_pos = self.positions_on(device)[0, -n_kv:], self.query_positions(n_q, device)[0, q0:q1]
        for intervention in self.interventions.at(layer):
            made = intervention.key_mask(q_pos, kv_pos, n_heads)
            if made is not None:
                masks.append(made)
        out = masks[0]
        for more in masks[1:]:
            out = out & more
        return out


def _block_ranges(allow: "AllowSet | torch.Tensor", rows: int) -> torch.Tensor:
    """(blocks, 2) [first, last + 1) of the keys any row of each block of ``rows`` query rows of an allow-set (an
    :class:`AllowSet`, or a (B, 1, n_q, n_kv) tensor) may see (every key for a block that sees none), on its device."""
    whole = isinstance(allow, torch.Tensor)  # the kernel's tests hand it a tensor
    n_q, n_kv = allow.shape[-2], allow.shape[-1]
    seen = torch.stack([(allow[:, :, q0:q0 + rows] if whole else allow.rows(q0, min(q0 + rows, n_q))).any(2).any(1).any(0)
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

    return metrics.auto_key(allowed(mask, n, window, metrics.auto_key_limit(n)).numpy())


def sink_keys(masks, n: int, windows) -> list[int]:
    """Every layer's sink key over a text of ``n`` tokens (:func:`auto_key`), its mask and the model's own window
    there (``windows``: one a layer, None where the layer has none): the one list every capability reads."""
    return [auto_key(mask, n, window) for mask, window in zip(masks, windows)]


def allowed(mask: Mask, n: int, window: int | None = None, columns: int | None = None) -> torch.Tensor:
    """(n, columns) bool on the host: which keys each query of an ``n``-token text may see in a layer, its ``mask`` and
    the model's own sliding ``window`` together (the window bounds causal-type masks only, as the attention applies
    it): the cells the model computes, the same allow-set a capture records. ``columns``: the first keys only
    (default all ``n``)."""
    i, j = torch.arange(n)[:, None], torch.arange(n if columns is None else columns)[None, :]
    allow = mask.allow(i[None, None], j[None, None])[0, 0]
    if window and mask.causal_type:
        allow = allow & ((i - j) < window)
    return allow
