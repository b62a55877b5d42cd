"""Per-layer statistics accumulated one block of query rows at a time (issue 8 §1).

Every statistic of :func:`metrics.summarise` is a sum over query rows (column sums → alpha, column
mean) or a value per row (key-0 profile, entropy, discarded mass, allocation), so the engine can
hand a layer over in blocks of rows and never hold the (H, n, n) fp32 map: the working set is
O(H · block · n). :func:`metrics.summarise` itself is this accumulator fed with one block, so the
streamed and the whole-matrix statistics are one implementation; the tests check it against the
plain numpy definitions in :mod:`attnviz.metrics`.
"""

from __future__ import annotations

import numpy as np
import torch

from . import metrics


class LayerSummary:
    """Accumulates one layer's statistics from ``add(q0, probs, allow)`` calls covering every query row."""

    def __init__(self, n_heads: int, n_q: int, n_kv: int, tokens: list[str] | None = None):
        self.n_q, self.n_kv = n_q, n_kv
        self.masked_sum = torch.zeros(n_heads, n_kv, dtype=torch.float64)  # sum_i allowed[i,k] A[i,k]
        self.plain_sum = torch.zeros(n_heads, n_kv, dtype=torch.float64)  # sum_i A[i,k]
        self.counts = torch.zeros(n_kv, dtype=torch.float64)  # queries allowed to see k
        self.self_seen = torch.zeros(n_kv, dtype=torch.float64)  # 1 where k's own query sees k
        self.key0 = torch.full((n_heads, n_q), float("nan"))
        self.discarded = torch.zeros(n_heads, n_q)
        self.entropy = torch.zeros(n_heads, n_q)
        self.delim = None
        if tokens is not None:
            delim = torch.tensor([metrics.is_delimiter(t) for t in tokens], dtype=torch.float32)
            delim[0] = 0.0  # the first token counts as first
            self.delim = delim
            self.allocation = torch.zeros(n_heads, n_q, len(metrics.ALLOCATION_PARTS))

    def add(self, q0: int, probs: torch.Tensor, allow: torch.Tensor, k0: int = 0, zero_outside: bool = False) -> None:
        """``probs`` (H, b, w) fp32 and ``allow`` (b, w) bool for queries q0 .. q0 + b - 1 and keys
        k0 .. k0 + w - 1; keys outside that range are forbidden to these rows and get nothing.
        ``zero_outside``: probs are exactly 0 wherever ``allow`` is False (as the engine's are), so
        the allowed-only column sum is the plain one and costs no extra pass."""
        probs = probs.float().cpu()
        allow = allow.cpu()
        b, w = probs.shape[1], probs.shape[2]
        rows, cols = slice(q0, q0 + b), slice(k0, k0 + w)
        column = probs.sum(1).double()
        self.plain_sum[:, cols] += column
        self.masked_sum[:, cols] += column if zero_outside else (probs * allow).sum(1).double()
        self.counts[cols] += allow.sum(0).double()
        index = torch.arange(b)
        on_diag = (q0 + index >= k0) & (q0 + index < k0 + w)
        diag_cols = (q0 + index)[on_diag] - k0  # within the block's key range
        self.self_seen[diag_cols + k0] = allow[index[on_diag], diag_cols].double()
        if k0 == 0:
            self.key0[:, rows] = torch.where(allow[:, 0][None, :], probs[:, :, 0], float("nan"))
        rowsum = probs.sum(-1)
        self.discarded[:, rows] = (1.0 - rowsum).clamp(min=0.0)
        h = -torch.special.xlogy(probs, probs).sum(-1)
        norm = torch.log(allow.sum(-1).clamp(min=1).float())[None, :]
        self.entropy[:, rows] = torch.where(norm > 0, h / torch.where(norm > 0, norm, 1.0), 0.0)
        if self.delim is not None:
            diagonal = torch.zeros(probs.shape[0], b)
            diagonal[:, on_diag] = probs[:, index[on_diag], diag_cols]
            if q0 == 0:
                diagonal[:, 0] = 0.0  # query 0's own key is the first token
            first = probs[:, :, 0] if k0 == 0 else torch.zeros(probs.shape[0], b)
            delim_q = torch.zeros(b)
            delim_q[on_diag] = self.delim[diag_cols + k0]
            delimiter = probs @ self.delim[cols] - diagonal * delim_q[None, :]
            other = rowsum - first - diagonal - delimiter
            self.allocation[:, rows] = torch.stack([first, delimiter, diagonal, other, (1.0 - rowsum).clamp(min=0.0)],
                                                   dim=-1)

    def result(self) -> dict[str, np.ndarray]:
        others = self.counts - self.self_seen
        alpha = torch.where(others > 0, self.masked_sum / self.counts.clamp(min=1), float("nan"))
        out = {"alpha": alpha.float().numpy(), "column_mean": (self.plain_sum / self.n_q).float().numpy(),
               "key0": self.key0.numpy(), "discarded": self.discarded.numpy(), "entropy": self.entropy.numpy()}
        if self.delim is not None:
            out = {"allocation": self.allocation.numpy(), **out}
        return out


class Summaries:
    """The engine's block reducer for ``capture(reduce=True)``: one :class:`LayerSummary` per layer
    (batch of one), started on a layer's first block and finished after its last."""

    def __init__(self, tokens: list[str] | None = None, pool: int | None = None):
        self.tokens = tokens
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
            self.layers[layer] = LayerSummary(heads, n_q, n_kv, self.tokens)
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

    def finish(self, layer: int) -> dict[str, np.ndarray]:
        out = self.layers.pop(layer).result()
        if self.pool:
            pooled = self.pooled.pop(layer)
            out.update(pooled=pooled.result(), pool_factor=np.array(pooled.factor))
            if layer in self.pooled_value:
                out["pooled_value"] = self.pooled_value.pop(layer).result()
            if layer in self.pooled_scores:
                out["pooled_scores"] = self.pooled_scores.pop(layer).result()
        return out


class PooledMap:
    """Every head's map max-pooled to at most ``size`` cells a side, one factor f for both axes,
    accumulated block by block: the overview a long text can afford (H × size² instead of H × n²).

    Max, not mean, so a sink column survives any pooling; a pooled cell is NaN when the mask forbids
    every cell under it (probabilities are 0 where forbidden, so the max over the block is the max
    over its allowed cells).
    """

    def __init__(self, n_heads: int, n_q: int, n_kv: int, size: int):
        self.factor = f = max(1, -(-max(n_q, n_kv) // size))
        self.values = torch.full((n_heads, -(-n_q // f), -(-n_kv // f)), float("-inf"))
        self.seen = torch.zeros(self.values.shape[1:], dtype=torch.bool)

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
        pooled, r, c = self._pool(probs.float(), q0, k0, float("-inf"))
        region = self.values[:, r:r + pooled.shape[1], c:c + pooled.shape[2]]
        torch.maximum(region, pooled, out=region)
        seen, _, _ = self._pool(allow.to(torch.uint8)[None], q0, k0, 0)
        self.seen[r:r + seen.shape[1], c:c + seen.shape[2]] |= seen[0].bool()

    def result(self) -> np.ndarray:
        return torch.where(self.seen, self.values, float("nan")).to(torch.float16).numpy()
