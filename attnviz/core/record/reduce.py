"""Per-layer statistics accumulated one block of query rows at a time.

Every statistic of :data:`metrics.STATISTICS` is a sum over query rows (column sums → alpha, column
mean) or a value per row (key-0 profile, entropy, discarded mass, allocation), so the engine can
hand a layer over in blocks of rows and never hold the (H, n, n) fp32 map: the working set is
O(H · block · n). :func:`summarise` itself is this accumulator fed with one block, so the
streamed and the whole-matrix statistics are one implementation; the tests check it against the
plain numpy definitions in :mod:`attnviz.stats.metrics`.
"""

from __future__ import annotations

import numpy as np
import torch

from attnviz.core.model import devices
from attnviz.core.spec.allowsets import Layout  # noqa: F401 - the counts the statistics read
from attnviz.core.record.pooled import PooledMap, pool_factor, shown  # noqa: F401 - pool_factor: routes reads it here
from attnviz.stats import metrics


class BlockReducer:
    """The protocol of a recorder that takes a recorded layer block by block instead of full maps: the
    engine calls :meth:`add` for each block of query rows and :meth:`finish` after the layer's last.
    ``only_rows`` (q0, q1), when set, lets the engine skip the layer's other blocks (a region)."""

    only_rows: tuple[int, int] | None = None

    def add(self, layer: int, q0: int, probs: torch.Tensor, allow: torch.Tensor, n_q: int, k0: int = 0,
            n_kv: int | None = None, **extra) -> None:
        raise NotImplementedError

    def finish(self, layer: int):
        raise NotImplementedError


class FusedReducer(BlockReducer):
    """A block reducer that can also take a whole layer from the fused kernel's sums (:meth:`add_fused`),
    so the engine may route the layer through :mod:`attnviz.core.kernel.kernels`."""

    pool: int | None = None
    delim: torch.Tensor | None = None

    def _delim_on(self, device) -> None:
        """The text's delimiter flags moved to the layer's device once, not copied again for every layer."""
        if self.delim is not None and self.delim.device != torch.device(device):
            self.delim = self.delim.to(device, torch.float32)

    def fusable(self) -> bool:
        """Whether the fused kernel provides every sum this reducer needs (else the engine feeds it blocks)."""
        return True

    def add_fused(self, layer: int, raw: dict[str, torch.Tensor], layout: Layout) -> None:
        raise NotImplementedError

    def add_scores(self, layer: int, q0: int, scores: torch.Tensor, allow: torch.Tensor, n_q: int, n_kv: int,
                   k0: int = 0) -> None:
        """Pre-softmax scores of a block, when the capture keeps them (``Keep(scores=True)``)."""
        raise NotImplementedError


class LayerSummary:
    """Accumulates one layer's statistics from ``add(q0, probs, allow)`` calls covering every query row, or from
    the fused kernel's sums in one call (:meth:`add_fused`), then finishes each from its declaration
    (:class:`attnviz.stats.metrics.Statistic`): only the sums the wanted statistics name are accumulated.

    Its state lives on the device of the first block it is fed, in float32 (docs/methods.md#devices), and every
    update is a tensor operation on that device: no host synchronisation per block. ``delim`` are the
    text's delimiter flags (:func:`metrics.delimiter_flags`, computed once per text); ``tokens`` is
    the convenience form that computes them here. ``statistics``: the :class:`~attnviz.stats.metrics.Statistic`
    declarations to keep (default: all, allocation only with delimiters).
    """

    def __init__(self, n_heads: int, n_q: int, n_kv: int, tokens: list[str] | None = None,
                 delim: torch.Tensor | None = None, statistics=None):
        self.n_heads, self.n_q, self.n_kv = n_heads, n_q, n_kv
        if delim is None and tokens is not None:
            delim = torch.from_numpy(metrics.delimiter_flags(tokens))
        self.delim = delim  # None: no allocation (it needs the text's delimiters)
        if statistics is None:
            statistics = [s for s in metrics.STATISTICS if s.name != "allocation" or delim is not None]
        self.statistics = tuple(statistics)
        self.sums_needed = metrics.needed_sums(self.statistics)
        if "delim" in self.sums_needed and delim is None:
            raise ValueError("allocation needs the text's delimiters: give tokens or delim")
        self.device = None

    def _start(self, device: torch.device, per_head: bool = False) -> None:
        """The sums on ``device``; the mask's facts per key and query, or per head as well where the layer's
        heads have masks of their own (``per_head``: a headwindow intervention, a compressed cache)."""
        f32 = {"dtype": torch.float32, "device": device}
        h, n_q, n_kv = self.n_heads, self.n_q, self.n_kv
        self.device = device
        per_key = {"colsum", "colsum_allowed"}
        self.sums = {(x.name if isinstance(x, metrics.RowSum) else x): torch.zeros(h, n_kv if x in per_key else n_q, **f32)
                     for x in self.sums_needed}
        heads = (h,) if per_head else ()
        self.facts = {"col_counts": torch.zeros(*heads, n_kv, **f32), "row_counts": torch.zeros(*heads, n_q, **f32),
                      "self_seen": torch.zeros(*heads, n_kv, **f32),
                      "key0_allowed": torch.zeros(*heads, n_q, dtype=torch.bool, device=device),
                      "query_index": torch.arange(n_q, **f32), "n_q": n_q}
        if self.delim is not None:
            self.facts["delim_q"] = self.delimiters_of_queries(device)

    def add(self, q0: int, probs: torch.Tensor, allow: torch.Tensor, k0: int = 0, zero_outside: bool = False) -> None:
        """``probs`` (H, b, w) and ``allow`` (b, w) bool, or (H, b, w) where each head has its own mask, for
        queries q0 .. q0 + b - 1 and keys k0 .. k0 + w - 1; keys outside that range are forbidden to these rows
        and get nothing. ``zero_outside``: probs are exactly 0 wherever ``allow`` is False (as the engine's
        are), so the allowed-only column sum is the plain one and costs no extra pass."""
        if self.device is None:
            self._start(probs.device, per_head=allow.dim() == 3)
        probs = probs.float()
        allow = allow.to(probs.device)
        b, w = probs.shape[1], probs.shape[2]
        rows, cols = slice(q0, q0 + b), slice(k0, k0 + w)
        sums, facts = self.sums, self.facts
        facts["col_counts"][..., cols] += allow.sum(-2)
        facts["row_counts"][..., rows] = allow.sum(-1).float()
        if k0 == 0:
            facts["key0_allowed"][..., rows] = allow[..., :, 0]
        # The diagonal (query q0 + r sees its own key) within this block: rows r_lo .. r_hi - 1, whose
        # keys q0 + r - k0 fall inside the block's key range. Plain slices: no boolean indexing, no sync.
        r_lo, r_hi = max(0, k0 - q0), min(b, k0 + w - q0)
        if r_lo < r_hi:
            square = slice(q0 + r_lo - k0, q0 + r_hi - k0)
            facts["self_seen"][..., q0 + r_lo:q0 + r_hi] = torch.diagonal(allow[..., r_lo:r_hi, square],
                                                                          dim1=-2, dim2=-1).float()
            if "diag" in sums:
                sums["diag"][:, q0 + r_lo:q0 + r_hi] = torch.diagonal(probs[:, r_lo:r_hi, square], dim1=-2, dim2=-1)
        if "colsum" in sums or "colsum_allowed" in sums:
            column = probs.sum(1)
            if "colsum" in sums:
                sums["colsum"][:, cols] += column
            if "colsum_allowed" in sums:
                sums["colsum_allowed"][:, cols] += column if zero_outside else (probs * allow).sum(-2)
        if "rowsum" in sums:
            sums["rowsum"][:, rows] = probs.sum(-1)
        if "key0" in sums and k0 == 0:
            sums["key0"][:, rows] = probs[:, :, 0]
        if "delim" in sums:
            sums["delim"][:, rows] = probs @ self.delim[cols]
        if "plogp" in sums:  # head by head: a temporary of one head's rows, not of the whole block
            tiny = torch.finfo(torch.float32).tiny  # p · log max(p, tiny): 0 where p is 0, as xlogy(p, p) (to an
            for head, p in enumerate(probs):  # ulp), in place in one temporary: ~8x faster on a CPU (bench/long.py)
                sums["plogp"][head, rows] = p.clamp_min(tiny).log_().mul_(p).sum(-1)
        for extra in self.sums_needed:
            if isinstance(extra, metrics.RowSum):
                sums[extra.name][:, rows] = extra.of(probs, allow)

    def delimiters_of_queries(self, device) -> torch.Tensor:
        """The delimiter flag of query i's own key i, float32 on ``device``."""
        self.delim = self.delim.to(device, torch.float32)
        return delimiters_of_queries(self.delim, self.n_q, self.n_kv, device)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The finished statistics, still on the layer's device: each from its declaration's sums."""
        if self.device is None:
            raise ValueError("no block was added to this layer summary")
        known = {**self.facts, **self.sums}
        return {s.name: s.finish(known, torch) for s in self.statistics}

    def result(self) -> dict[str, np.ndarray]:
        """The finished statistics on the host: the one copy per layer."""
        return to_host(self.tensors())


def delimiters_of_queries(delim: torch.Tensor, n_q: int, n_kv: int, device) -> torch.Tensor:
    """The delimiter flag of query i's own key i (``delim`` the text's flags by key), float32 on ``device``."""
    delim_q = torch.zeros(n_q, dtype=torch.float32, device=device)
    delim_q[:min(n_q, n_kv)] = delim[:min(n_q, n_kv)].to(device, torch.float32)
    return delim_q


def _layer_allow(allow: torch.Tensor) -> torch.Tensor:
    """Batch row 0 of a block's allow-set (B, 1 or H, b, w): (b, w) for the layer, or (H, b, w) where its heads
    have masks of their own (each head's statistics read through its own mask)."""
    return allow[0, 0] if allow.shape[1] == 1 else allow[0]


CHOSEN = metrics.CHOSEN


class Summaries(FusedReducer):
    """The engine's block reducer for ``Keep(statistics=True)``: one :class:`LayerSummary` per layer
    (batch of one), started on a layer's first block and finished after its last. Every layer's
    state lives on that layer's own device (a device map may spread layers over several); its
    finished results go to the host once, in :meth:`finish`."""

    def __init__(self, tokens: list[str] | None = None, pool: int | None = None, statistics=None):
        """``statistics``: the names of :data:`metrics.STATISTICS` a caller needs (None: all). Entropy and
        allocation, the two that cost a pass over every block, are computed only when named; the others
        come from sums the engine makes anyway and are always kept."""
        names = {s.name for s in metrics.STATISTICS}
        wanted = names if statistics is None else set(statistics)
        unknown = metrics.unknown_statistics(sorted(wanted))
        if unknown:
            raise ValueError(f"unknown statistics {unknown}: choose from {sorted(names)}")
        if tokens is None:
            wanted.discard("allocation")
        self.tokens = tokens
        # the cheap ones come from sums the engine makes anyway and are always kept
        self.statistics = metrics.kept_statistics(wanted)
        self.delim = (torch.from_numpy(metrics.delimiter_flags(tokens))  # once per text
                      if tokens is not None and "allocation" in wanted else None)
        self.pool = pool  # also keep max-pooled maps of at most pool cells a side (stats "pooled", "pool_factor")
        self.layers: dict[int, LayerSummary] = {}
        self.pooled: dict[int, PooledMap] = {}
        self.pooled_value: dict[int, PooledMap] = {}
        self.pooled_scores: dict[int, PooledMap] = {}
        self._delim_q: dict = {}  # the delimiter flag of each query's own key, by device and shape
        self._waiting: FusedLayers | None = None  # fused layers whose sums wait to be finished together

    def fusable(self) -> bool:
        """The fused kernel provides every sum the kept statistics are finished from (``kernels.SUMS``)."""
        from attnviz.core.kernel import kernels

        return not self.missing_sums(kernels.SUMS)

    def missing_sums(self, provided) -> list[str]:
        """The sums these statistics need that ``provided`` lacks (names; a statistic's own RowSum by its name)."""
        needed = metrics.needed_sums(self.statistics)
        return sorted(x.name if isinstance(x, metrics.RowSum) else x for x in needed
                      if isinstance(x, metrics.RowSum) or x not in provided)

    def add_scores(self, layer: int, q0: int, scores: torch.Tensor, allow: torch.Tensor, n_q: int, n_kv: int,
                   k0: int = 0) -> None:
        """Pre-softmax scores (B, H, b, w) of a block (keys k0 .. k0 + w - 1), -inf where forbidden:
        max-pooled like the maps (stats "pooled_scores"), for a long text's pre-softmax view."""
        if not self.pool:
            raise ValueError("pooled scores need a pool size: Keep(statistics=True, pool=..., scores=True)")
        if layer not in self.pooled_scores:
            self.pooled_scores[layer] = PooledMap(scores.shape[1], n_q, n_kv, self.pool)
        self.pooled_scores[layer].add(q0, scores[0], _layer_allow(allow).any(0) if allow.shape[1] > 1 else allow[0, 0], k0)

    def add(self, layer: int, q0: int, probs: torch.Tensor, allow: torch.Tensor, n_q: int, k0: int = 0,
            n_kv: int | None = None, value_norms: torch.Tensor | None = None) -> None:
        """``probs`` (B, H, b, w) and ``allow`` (B, 1, b, w) of queries q0 .. q0 + b - 1 (of n_q) and keys
        k0 .. k0 + w - 1 (of n_kv); batch row 0. ``value_norms`` (B, H, n_kv), ||W_O^h v_j^h||: with a
        pool, the value-weighted maps A[i, j]·||W_O v_j|| are max-pooled too (stats "pooled_value")."""
        if layer not in self.layers:
            heads, n_kv = probs.shape[1], n_kv or probs.shape[-1]
            self._delim_on(probs.device)
            self.layers[layer] = LayerSummary(heads, n_q, n_kv, delim=self.delim, statistics=self.statistics)
            if self.pool:
                self.pooled[layer] = PooledMap(heads, n_q, n_kv, self.pool)
                if value_norms is not None:
                    self.pooled_value[layer] = PooledMap(heads, n_q, n_kv, self.pool)
        own = _layer_allow(allow)  # (b, w), or (H, b, w) where heads have masks of their own
        self.layers[layer].add(q0, probs[0], own, k0, zero_outside=True)
        if self.pool:
            seen = own.any(0) if own.dim() == 3 else own  # a pooled cell is shown where some head may look
            self.pooled[layer].add(q0, probs[0], seen, k0)
            if layer in self.pooled_value:
                norms = value_norms[0, :, k0:k0 + probs.shape[-1]].to(probs.device, torch.float32)
                self.pooled_value[layer].add(q0, probs[0].float() * norms[:, None, :], seen, k0)

    def add_fused(self, layer: int, raw: dict[str, torch.Tensor], layout: Layout) -> None:
        """A whole layer at once from :func:`attnviz.core.kernel.kernels.layer_statistics` (the fused route) and its
        mask's :class:`Layout`: the same statistics and pooled maps as the blocks would give. Its sums wait on the
        device with the layers before it and are finished with them (:class:`FusedLayers`)."""
        self._delim_on(raw["rowsum"].device)
        if self._waiting is None or self._waiting.copies is not None:  # none, or one finished (a run before)
            self._waiting = FusedLayers(self)
        self._waiting.add(layer, raw, layout)

    def delim_q(self, device, n_q: int, n_kv: int) -> torch.Tensor:
        """The delimiter flag of each query's own key on ``device``, made once a text, device and shape."""
        key = (str(device), n_q, n_kv)
        if key not in self._delim_q:
            self._delim_q[key] = delimiters_of_queries(self.delim, n_q, n_kv, device)
        return self._delim_q[key]

    def finish(self, layer: int):
        waiting = self._waiting
        if waiting is not None and layer in waiting.layers:
            if waiting.nbytes >= GROUP_BYTES:  # enough wait: finish them now (the next layer starts another group)
                waiting.finish()
            return Finished(waiting, layer)
        out = self.layers.pop(layer).tensors()
        if self.pool:
            pooled = self.pooled.pop(layer)
            out.update(pooled=pooled.tensor(), pool_factor=np.array(pooled.factor))
            if layer in self.pooled_value:
                out["pooled_value"] = self.pooled_value.pop(layer).tensor()
            if layer in self.pooled_scores:
                out["pooled_scores"] = self.pooled_scores.pop(layer).tensor()
        return devices.host_copies(out)  # on their way to the host: the run collects them after the forward


#: Fused layers' sums wait on their device until this many bytes of them wait (and at the end of the forward), then
#: are finished together: one set of operations for the group, where finishing each layer alone cost about 45 a
#: layer, which on a small model on a GPU the host launches one by one: the capture's cost there
#: (docs/gpu.md#the-hosts-share-measured-on-a-cpu).
GROUP_BYTES = 64 * 2**20


class FusedLayers:
    """Fused layers finished together. Each layer's kernel sums (:func:`attnviz.core.kernel.kernels.layer_statistics`)
    wait on the device; :meth:`finish` stacks the sums of the layers that share a mask's :class:`Layout`, device and
    shape, finishes every statistic and pooled map of them at once (the statistics' declarations broadcast over the
    stacked layers as over the heads), and sends them to the host in one copy a dtype. :class:`Finished` gives each
    layer its own back."""

    def __init__(self, owner: "Summaries"):
        self.owner = owner
        self.layers: dict[int, tuple[dict, Layout]] = {}
        self.nbytes = 0
        self.copies: dict[int, tuple] | None = None  # layer: (its group's copy, its index in the stack)
        self.landed: dict[int, dict] = {}  # id of a copy: its numpy arrays

    def add(self, layer: int, raw: dict[str, torch.Tensor], layout: Layout) -> None:
        if self.copies is not None:
            raise RuntimeError("these fused layers were finished: a layer added now would never be")
        self.layers[layer] = (raw, layout)
        self.nbytes += sum(v.numel() * v.element_size() for v in raw.values())

    def finish(self) -> None:
        """Finish every waiting layer and queue the copies to the host; the sums are let go."""
        if self.copies is not None:
            return
        owner, copies = self.owner, {}  # kept only once every part is made: an error leaves the group as it was
        parts: dict = {}
        for layer, (raw, layout) in self.layers.items():
            key = (id(layout), str(raw["rowsum"].device), tuple(raw["rowsum"].shape), tuple(sorted(raw)))
            parts.setdefault(key, []).append(layer)
        needed = [x.name if isinstance(x, metrics.RowSum) else x for x in metrics.needed_sums(owner.statistics)]
        for layers in parts.values():
            raws = [self.layers[layer][0] for layer in layers]
            layout = self.layers[layers[0]][1]
            device, (n_q, n_kv) = raws[0]["rowsum"].device, (layout.n_q, layout.n_kv)

            made: dict = {}

            def stacked(name):
                if name not in made:
                    made[name] = raws[0][name][None] if len(raws) == 1 else torch.stack([raw[name] for raw in raws])
                return made[name]

            known = {**layout.facts(device), "n_q": n_q}
            if owner.delim is not None:
                known["delim_q"] = owner.delim_q(device, n_q, n_kv)
            for name in needed:  # the kernel's probabilities are 0 wherever forbidden: its column sums are allowed-only
                known[name] = stacked("colsum" if name == "colsum_allowed" else name)
            out = {s.name: s.finish(known, torch) for s in owner.statistics}
            if owner.pool:
                factor = pool_factor(max(n_q, n_kv), owner.pool)
                seen = layout.seen(factor).to(device)  # one grid for every pooled kind, made once a mask
                for name in ("pooled", "pooled_value", "pooled_scores"):
                    if name in raws[0]:
                        out[name] = shown(stacked(name), seen)
                out["pool_factor"] = np.array(factor)
            copy = devices.host_copies(out)
            for index, layer in enumerate(layers):
                copies[layer] = (copy, index)
            del made, out
        self.copies, self.layers = copies, {}

    def result(self, layer: int) -> dict[str, np.ndarray]:
        """``layer``'s finished results on the host (its group finished first where it still waits)."""
        self.finish()
        copy, index = self.copies[layer]
        if id(copy) not in self.landed:
            self.landed[id(copy)] = devices.landed(copy)
        return {k: v[index] if k != "pool_factor" else v for k, v in self.landed[id(copy)].items()}


class Finished(devices.Landing):
    """One fused layer's results, finished with its group (:class:`FusedLayers`) and on their way to the host."""

    def __init__(self, group: FusedLayers, layer: int):
        self.group, self.layer = group, layer

    def result(self) -> dict[str, np.ndarray]:
        return self.group.result(self.layer)


def summarise(probs, allowed, tokens: list[str] | None = None) -> dict[str, np.ndarray]:
    """Per-layer statistics, O(H·n) memory: kept instead of full maps when a capture is reduced, and
    computed in one pass over a layer when figures need several. The engine streams the same
    accumulator block by block; here it gets the whole layer as one block."""
    probs = torch.from_numpy(metrics.f32(probs))
    summary = LayerSummary(probs.shape[0], probs.shape[1], probs.shape[2], tokens)
    summary.add(0, probs, torch.from_numpy(np.asarray(allowed, dtype=bool)))
    return summary.result()


def to_host(values: dict) -> dict:
    """Finished per-layer results (tensors on any device) as numpy arrays: the one copy per layer."""
    return {k: v.cpu().numpy() if isinstance(v, torch.Tensor) else v for k, v in values.items()}
