"""A layer's maps max-pooled to at most a given size a side, a block of query rows at a time: what a long capture
keeps instead of its full maps (docs/viewer.md)."""

from __future__ import annotations

import numpy as np
import torch


def pool_factor(n: int, size: int) -> int:
    """Tokens per pooled cell a side for ``n`` tokens and at most ``size`` cells: ceil(n / size),
    rounded up to a power of two up to 16 and to a multiple of 16 above. The rounding lets the fused
    kernel (:mod:`attnviz.core.kernel.kernels`) reduce each tile on a fixed grid before its atomic max; a map
    keeps between size / 2 and size cells a side."""
    f = max(1, -(-int(n) // int(size)))
    if f <= 16:
        return 1 << (f - 1).bit_length()
    return -(-f // 16) * 16


def shown(values: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Pooled maxima (.., rows, cols) as a capture keeps them: fp16, NaN in the cells ``seen`` (rows, cols) says no
    query may look under."""
    return torch.where(seen, values, float("nan")).to(torch.float16)


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

    def tensor(self) -> torch.Tensor:
        """The pooled maps in fp16, NaN where nothing was allowed, on the device of the blocks."""
        return shown(self.values, self.seen)

    def result(self) -> np.ndarray:
        return self.tensor().cpu().numpy()
