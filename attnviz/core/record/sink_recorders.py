"""Recorders of the sink's attention in a batched forward (:mod:`attnviz.core.record.recorders`): what the causal scan and
activation patching measure, read from the blocks the engine makes, one column or one cell a layer."""

from __future__ import annotations

import torch

from attnviz.core.record.recorders import Recorder


class SinkColumn(Recorder):
    """Per layer and batch row, alpha at the layer's sink key per head (the mean of its column over every query that
    may see it, the key's own query included; NaN where no other query does): only the sink key's column is read."""

    holds = "reduced"

    def __init__(self):
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, torch.Tensor] = {}

    def block(self, run, layer, q0, k0, probs, allow):
        key = run.sink_key(layer)
        if not k0 <= key < k0 + probs.shape[-1]:
            return
        column = probs[..., key - k0].float()  # (B, H, b)
        seen = allow[..., key - k0].expand_as(column)  # (B, H, b)
        self.sums[layer] = self.sums.get(layer, 0) + (column * seen).sum(-1)
        self.counts[layer] = self.counts.get(layer, 0) + seen.sum(-1).float()

    def attention(self, layer: int) -> torch.Tensor:
        """(B,) the mean over heads of alpha at the sink key (heads where it is undefined left out; NaN if all)."""
        sums, counts = self.sums[layer], self.counts[layer]
        alpha = torch.where(counts > 1, sums / counts.clamp(min=1), torch.nan)  # counts include the key's own query
        defined = torch.isfinite(alpha)
        return torch.where(defined.any(-1), torch.where(defined, alpha, 0).sum(-1) / defined.sum(-1).clamp(min=1),
                           torch.nan)


class SinkCell(Recorder):
    """Per layer, (B,) the last query's attention on the layer's sink key, the mean over heads."""

    holds = "reduced"

    def __init__(self):
        self.values: dict[int, list] = {}
        self.n = 0

    def start(self, run, layer, inputs):
        self.n = inputs.key.shape[2]

    def block(self, run, layer, q0, k0, probs, allow):
        last, key = self.n - 1, run.sink_key(layer)
        if q0 <= last < q0 + probs.shape[-2] and k0 <= key < k0 + probs.shape[-1]:
            self.values.setdefault(layer, []).append(probs[:, :, last - q0, key - k0].float().mean(1))

    def layers(self) -> dict[int, torch.Tensor]:
        """Per recorded layer, (B,) the last query's attention on its sink key, the mean over heads."""
        return {layer: sum(v) for layer, v in self.values.items()}  # one block holds the last row
