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
    so the engine may route the layer through :mod:`attnviz.core.kernels`."""

    pool: int | None = None
    delim: torch.Tensor | None = None

    def add_fused(self, layer: int, raw: dict[str, torch.Tensor], allow: torch.Tensor, n_q: int, n_kv: int) -> None:
        raise NotImplementedError

    def add_scores(self, layer: int, q0: int, scores: torch.Tensor, allow: torch.Tensor, n_q: int, n_kv: int,
                   k0: int = 0) -> None:
        """Pre-softmax scores of a block, when the capture keeps them (``capture(scores=True)``)."""
        raise NotImplementedError


class LayerSummary:
    """Accumulates one layer's statistics from ``add(q0, probs, allow)`` calls covering every query row.

    Its state lives on the device of the first block it is fed, in float32 (docs/methods.md#devices), and every
    update is a tensor operation on that device: no host synchronisation per block. ``delim`` are the
    text's delimiter flags (:func:`metrics.delimiter_flags`, computed once per text); ``tokens`` is
    the convenience form that computes them here.
    """

    def __init__(self, n_heads: int, n_q: int, n_kv: int, tokens: list[str] | None = None,
                 delim: torch.Tensor | None = None, entropy: bool = True):
        self.n_heads, self.n_q, self.n_kv = n_heads, n_q, n_kv
        if delim is None and tokens is not None:
            delim = torch.from_numpy(metrics.delimiter_flags(tokens))
        self.delim = delim  # None: no allocation (it needs the text's delimiters)
        self.with_entropy = entropy  # False: no entropy (a log over every probability of the layer)
        self.device = None

    def _start(self, device: torch.device) -> None:
        f32 = {"dtype": torch.float32, "device": device}
        h, n_q, n_kv = self.n_heads, self.n_q, self.n_kv
        self.device = device
        self.masked_sum = torch.zeros(h, n_kv, **f32)  # sum_i allowed[i,k] A[i,k]
        self.plain_sum = torch.zeros(h, n_kv, **f32)  # sum_i A[i,k]
        self.counts = torch.zeros(n_kv, **f32)  # queries allowed to see k
        self.self_seen = torch.zeros(n_kv, **f32)  # 1 where k's own query sees k
        self.key0 = torch.full((h, n_q), float("nan"), **f32)
        self.discarded = torch.zeros(h, n_q, **f32)
        self.entropy = torch.zeros(h, n_q, **f32)
        if self.delim is not None:
            self.delim = self.delim.to(**f32)
            self.allocation = torch.zeros(h, n_q, len(metrics.ALLOCATION_PARTS), **f32)

    def add(self, q0: int, probs: torch.Tensor, allow: torch.Tensor, k0: int = 0, zero_outside: bool = False) -> None:
        """``probs`` (H, b, w) and ``allow`` (b, w) bool for queries q0 .. q0 + b - 1 and keys
        k0 .. k0 + w - 1; keys outside that range are forbidden to these rows and get nothing.
        ``zero_outside``: probs are exactly 0 wherever ``allow`` is False (as the engine's are), so
        the allowed-only column sum is the plain one and costs no extra pass."""
        if self.device is None:
            self._start(probs.device)
        probs = probs.float()
        allow = allow.to(probs.device)
        b, w = probs.shape[1], probs.shape[2]
        cols = slice(k0, k0 + w)
        column = probs.sum(1)
        self.plain_sum[:, cols] += column
        self.masked_sum[:, cols] += column if zero_outside else (probs * allow).sum(1)
        self.counts[cols] += allow.sum(0)
        # The diagonal (query q0 + r sees its own key) within this block: rows r_lo .. r_hi - 1, whose
        # keys q0 + r - k0 fall inside the block's key range. Plain slices: no boolean indexing, no sync.
        r_lo, r_hi = max(0, k0 - q0), min(b, k0 + w - q0)
        diag_p = diag_a = None
        if r_lo < r_hi:
            c_lo = q0 + r_lo - k0
            square = slice(c_lo, c_lo + r_hi - r_lo)
            diag_p = torch.diagonal(probs[:, r_lo:r_hi, square], dim1=-2, dim2=-1)  # (H, r_hi - r_lo)
            diag_a = torch.diagonal(allow[r_lo:r_hi, square])
            self.self_seen[q0 + r_lo:q0 + r_hi] = diag_a.float()
        key0 = probs[:, :, 0] if k0 == 0 else None
        diagonal = probs.new_zeros(probs.shape[0], b)
        delim_q = probs.new_zeros(b)
        if diag_p is not None:
            diagonal[:, r_lo:r_hi] = diag_p
            if self.delim is not None:
                delim_q[r_lo:r_hi] = self.delim[q0 + r_lo:q0 + r_hi]
        delim_sum = probs @ self.delim[cols] if self.delim is not None else None
        plogp = torch.special.xlogy(probs, probs).sum(-1) if self.with_entropy else None
        self._rows(q0, allow[:, 0] if k0 == 0 else None, allow.sum(-1), probs.sum(-1), plogp, key0, diagonal,
                   delim_sum, delim_q)

    def _rows(self, q0: int, key0_allowed, allowed_count, rowsum, plogp, key0, diagonal, delim_sum, delim_q) -> None:
        """Every per-query statistic of rows q0 .. q0 + b - 1 from their sums (H, b): row sum, Σ p log p,
        p of key 0 (None when these rows' keys start past it), of the query's own key, and Σ p·delim.
        One formula for the block engine and the fused kernel."""
        rows = slice(q0, q0 + rowsum.shape[1])
        if key0 is not None:
            self.key0[:, rows] = torch.where(key0_allowed[None, :], key0, float("nan"))
        self.discarded[:, rows] = (1.0 - rowsum).clamp(min=0.0)
        if plogp is not None:
            norm = torch.log(allowed_count.clamp(min=1).float())[None, :]
            self.entropy[:, rows] = torch.where(norm > 0, -plogp / torch.where(norm > 0, norm, 1.0), 0.0)
        if self.delim is not None:
            if q0 == 0:
                diagonal = diagonal.clone()
                diagonal[:, 0] = 0.0  # query 0's own key is the first token
            first = key0 if key0 is not None else torch.zeros_like(rowsum)
            delimiter = delim_sum - diagonal * delim_q[None, :]
            other = rowsum - first - diagonal - delimiter
            self.allocation[:, rows] = torch.stack([first, delimiter, diagonal, other, (1.0 - rowsum).clamp(min=0.0)],
                                                   dim=-1)

    def add_fused(self, raw: dict[str, torch.Tensor], allow: torch.Tensor) -> None:
        """A whole layer from :func:`attnviz.core.kernels.layer_statistics`' sums and its (n_q, n_kv) allow-set."""
        self._start(raw["rowsum"].device)
        allow = allow.to(self.device)
        self.plain_sum += raw["colsum"]
        self.masked_sum += raw["colsum"]  # the kernel's probabilities are 0 wherever the mask forbids
        self.counts += allow.sum(0)
        n = min(self.n_q, self.n_kv)
        self.self_seen[:n] = torch.diagonal(allow[:n, :n]).float()
        delim_q = self.delim[:self.n_q] if self.delim is not None and self.n_q <= self.n_kv else None
        self._rows(0, allow[:, 0], allow.sum(-1), raw["rowsum"], raw["plogp"], raw["key0"], raw["diag"],
                   raw["delim"], delim_q)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The finished statistics, still on the layer's device."""
        if self.device is None:
            raise ValueError("no block was added to this layer summary")
        others = self.counts - self.self_seen
        alpha = torch.where(others > 0, self.masked_sum / self.counts.clamp(min=1), float("nan"))
        out = {"alpha": alpha, "column_mean": self.plain_sum / self.n_q, "key0": self.key0,
               "discarded": self.discarded, **({"entropy": self.entropy} if self.with_entropy else {})}
        if self.delim is not None:
            out = {"allocation": self.allocation, **out}
        return out

    def result(self) -> dict[str, np.ndarray]:
        """The finished statistics on the host: the one copy per layer."""
        return to_host(self.tensors())


class Summaries(FusedReducer):
    """The engine's block reducer for ``capture(reduce=True)``: one :class:`LayerSummary` per layer
    (batch of one), started on a layer's first block and finished after its last. Every layer's
    state lives on that layer's own device (a device map may spread layers over several); its
    finished results go to the host once, in :meth:`finish`."""

    def __init__(self, tokens: list[str] | None = None, pool: int | None = None, statistics=None):
        """``statistics``: the names of :data:`metrics.STATISTICS` a caller needs (None: all). Entropy and
        allocation, the two that cost a pass over every block, are computed only when named; the others
        come from sums the engine makes anyway and are always kept."""
        names = {s.name for s in metrics.STATISTICS}
        wanted = names if statistics is None else set(statistics)
        if wanted - names:
            raise ValueError(f"unknown statistics {sorted(wanted - names)}: choose from {sorted(names)}")
        self.tokens = tokens
        self.entropy = "entropy" in wanted
        self.delim = (torch.from_numpy(metrics.delimiter_flags(tokens))  # once per text
                      if tokens is not None and "allocation" in wanted else None)
        self.pool = pool  # also keep max-pooled maps of at most pool cells a side (stats "pooled", "pool_factor")
        self.layers: dict[int, LayerSummary] = {}
        self.pooled: dict[int, PooledMap] = {}
        self.pooled_value: dict[int, PooledMap] = {}
        self.pooled_scores: dict[int, PooledMap] = {}

    def add_scores(self, layer: int, q0: int, scores: torch.Tensor, allow: torch.Tensor, n_q: int, n_kv: int,
                   k0: int = 0) -> None:
        """Pre-softmax scores (B, H, b, w) of a block (keys k0 .. k0 + w - 1), -inf where forbidden:
        max-pooled like the maps (stats "pooled_scores"), for a long text's pre-softmax view."""
        if not self.pool:
            raise ValueError("pooled scores need a pool size: capture(reduce=True, pool=..., scores=True)")
        if layer not in self.pooled_scores:
            self.pooled_scores[layer] = PooledMap(scores.shape[1], n_q, n_kv, self.pool)
        self.pooled_scores[layer].add(q0, scores[0], allow[0, 0], k0)

    def add(self, layer: int, q0: int, probs: torch.Tensor, allow: torch.Tensor, n_q: int, k0: int = 0,
            n_kv: int | None = None, value_norms: torch.Tensor | None = None) -> None:
        """``probs`` (B, H, b, w) and ``allow`` (B, 1, b, w) of queries q0 .. q0 + b - 1 (of n_q) and keys
        k0 .. k0 + w - 1 (of n_kv); batch row 0. ``value_norms`` (B, H, n_kv), ||W_O^h v_j^h||: with a
        pool, the value-weighted maps A[i, j]·||W_O v_j|| are max-pooled too (stats "pooled_value")."""
        if layer not in self.layers:
            heads, n_kv = probs.shape[1], n_kv or probs.shape[-1]
            self.layers[layer] = LayerSummary(heads, n_q, n_kv, delim=self.delim, entropy=self.entropy)
            if self.pool:
                self.pooled[layer] = PooledMap(heads, n_q, n_kv, self.pool)
                if value_norms is not None:
                    self.pooled_value[layer] = PooledMap(heads, n_q, n_kv, self.pool)
        self.layers[layer].add(q0, probs[0], allow[0, 0], k0, zero_outside=True)
        if self.pool:
            self.pooled[layer].add(q0, probs[0], allow[0, 0], k0)
            if layer in self.pooled_value:
                norms = value_norms[0, :, k0:k0 + probs.shape[-1]].to(probs.device, torch.float32)
                self.pooled_value[layer].add(q0, probs[0].float() * norms[:, None, :], allow[0, 0], k0)

    def add_fused(self, layer: int, raw: dict[str, torch.Tensor], allow: torch.Tensor, n_q: int, n_kv: int) -> None:
        """A whole layer at once from :func:`attnviz.core.kernels.layer_statistics` (the fused route) and its
        (n_q, n_kv) allow-set: the same statistics and pooled maps as the blocks would give."""
        heads = raw["rowsum"].shape[0]
        self.layers[layer] = summary = LayerSummary(heads, n_q, n_kv, delim=self.delim, entropy=self.entropy)
        summary.add_fused(raw, allow)
        if self.pool:
            seen = PooledMap(heads, n_q, n_kv, self.pool).seen_of(allow)  # one grid for every pooled kind
            for name, store in (("pooled", self.pooled), ("pooled_value", self.pooled_value),
                                ("pooled_scores", self.pooled_scores)):
                if name in raw:
                    store[layer] = PooledMap(heads, n_q, n_kv, self.pool).set(raw[name], seen)

    def finish(self, layer: int) -> dict[str, np.ndarray]:
        out = self.layers.pop(layer).tensors()
        if self.pool:
            pooled = self.pooled.pop(layer)
            out.update(pooled=pooled.tensor(), pool_factor=np.array(pooled.factor))
            if layer in self.pooled_value:
                out["pooled_value"] = self.pooled_value.pop(layer).tensor()
            if layer in self.pooled_scores:
                out["pooled_scores"] = self.pooled_scores.pop(layer).tensor()
        return to_host(out)


def pool_factor(n: int, size: int) -> int:
    """Tokens per pooled cell a side for ``n`` tokens and at most ``size`` cells: ceil(n / size),
    rounded up to a power of two up to 16 and to a multiple of 16 above. The rounding lets the fused
    kernel (:mod:`attnviz.core.kernels`) reduce each tile on a fixed grid before its atomic max; a map
    keeps between size / 2 and size cells a side."""
    f = max(1, -(-int(n) // int(size)))
    if f <= 16:
        return 1 << (f - 1).bit_length()
    return -(-f // 16) * 16


class PooledMap:
    """Every head's map max-pooled to at most ``size`` cells a side, one factor f for both axes,
    accumulated block by block on the device of the blocks: the overview a long text can afford
    (H × size² instead of H × n²).

    Max, not mean, so a sink column survives any pooling; a pooled cell is NaN when the mask forbids
    every cell under it (probabilities are 0 where forbidden, so the max over the block is the max
    over its allowed cells).
    """

    def __init__(self, n_heads: int, n_q: int, n_kv: int, size: int):
        self.factor = f = pool_factor(max(n_q, n_kv), size)
        self.shape = (n_heads, -(-n_q // f), -(-n_kv // f))
        self.values = self.seen = None  # created on the first block's device

    def _pool(self, x: torch.Tensor, q0: int, k0: int, fill):
        """(.., b, w) → (.., rows, cols) block maxima on the global grid of f × f cells, and its corner."""
        f = self.factor
        top, left = q0 % f, k0 % f
        b, w = x.shape[-2:]
        rows, cols = -(-(top + b) // f), -(-(left + w) // f)
        x = torch.nn.functional.pad(x, (left, cols * f - w - left, top, rows * f - b - top), value=fill)
        x = x.reshape(*x.shape[:-2], rows, f, cols, f)
        return x.amax(dim=(-3, -1)), q0 // f, k0 // f

    def add(self, q0: int, probs: torch.Tensor, allow: torch.Tensor, k0: int = 0) -> None:
        if self.values is None:
            self.values = torch.full(self.shape, float("-inf"), device=probs.device)
            self.seen = torch.zeros(self.shape[1:], dtype=torch.bool, device=probs.device)
        pooled, r, c = self._pool(probs.float(), q0, k0, float("-inf"))
        region = self.values[:, r:r + pooled.shape[1], c:c + pooled.shape[2]]
        torch.maximum(region, pooled, out=region)
        seen, _, _ = self._pool(allow.to(probs.device, torch.uint8)[None], q0, k0, 0)
        self.seen[r:r + seen.shape[1], c:c + seen.shape[2]] |= seen[0].bool()

    def seen_of(self, allow: torch.Tensor) -> torch.Tensor:
        """The pooled cells under which ``allow`` (n_q, n_kv) allows anything, as a bool grid."""
        seen, _, _ = self._pool(allow.to(torch.uint8)[None], 0, 0, 0)
        return seen[0].bool()

    def set(self, values: torch.Tensor, seen: torch.Tensor) -> "PooledMap":
        """The whole pooled grid at once (the fused kernel's), with its :meth:`seen_of` cells."""
        self.values, self.seen = values.float(), seen.to(values.device)
        return self

    def tensor(self) -> torch.Tensor:
        """The pooled maps in fp16, NaN where nothing was allowed, on the device of the blocks."""
        return torch.where(self.seen, self.values, float("nan")).to(torch.float16)

    def result(self) -> np.ndarray:
        return self.tensor().cpu().numpy()


def summarise(probs, allowed, tokens: list[str] | None = None) -> dict[str, np.ndarray]:
    """Per-layer statistics, O(H·n) memory: kept instead of full maps when a capture is reduced, and
    computed in one pass over a layer when figures need several. The engine streams the same
    accumulator block by block; here it gets the whole layer as one block."""
    probs = torch.from_numpy(metrics._f32(probs))
    summary = LayerSummary(probs.shape[0], probs.shape[1], probs.shape[2], tokens)
    summary.add(0, probs, torch.from_numpy(np.asarray(allowed, dtype=bool)))
    return summary.result()


def to_host(values: dict) -> dict:
    """Finished per-layer results (tensors on any device) as numpy arrays: the one copy per layer."""
    return {k: v.cpu().numpy() if isinstance(v, torch.Tensor) else v for k, v in values.items()}
