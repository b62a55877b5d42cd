"""The emergence table's plan, made before its first forward (docs/lab.md#sizing-the-emergence-table): what measuring
each checkpoint on a probe of ``rows`` sequences of ``n`` tokens makes at its peak and how long it takes, from the
model's shape (:class:`attnviz.core.sizing.sizes.Shape`), the way an analysis of many forwards is planned
(:mod:`attnviz.effects.budget`: the same memory budget and the same measured rate).

A checkpoint's probe runs in one batch, twice: the measures (:func:`attnviz.lab.emergence.measure`: every layer's
key-0 column, queries, keys and values, the residual stream entering each layer, the logits) and the head classes'
dormancy (:func:`attnviz.effects.induction.maps_and_outputs`: every layer's whole maps on the host, and each head's
output per query in float64). A probe whose batch does not fit the budget is refused in one line with the estimate
and the most sequences that fit (:class:`TableTooLarge`); the time is an estimate, never a verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnviz.core.model import devices
from attnviz.core.sizing.sizes import Shape
from attnviz.effects import budget as budgets
from attnviz.effects import induction
from attnviz.errors import InputError
from attnviz.lab import formation

#: fp32 copies of one layer's (B, H, n, n) map alive at once while the engine makes and reduces it
MAP_COPIES = budgets.BLOCK_COPIES
#: a probe row's time over its floating-point operations at the measured matrix-product rate (the maps copied to
#: the host and cast to float64, the engine's elementwise work): measured on the default run on this 2-core CPU, busy
WORK = 20.0
#: seconds a probe sequence's per-layer spectrum takes on the host beside its eigenvalue problem's operations (a
#: call a sequence and layer: measured on this 2-core CPU, busy)
SPECTRUM_SECONDS = 5e-4
#: the repeated tokens the head classes are scored on, a checkpoint
REPEATED_ROWS = induction.SAMPLES


class TableTooLarge(InputError):
    """An emergence table whose probe does not fit the memory budget; the message says what would."""


def row_bytes(shape: Shape, n: int) -> int:
    """What one probe sequence of ``n`` tokens makes at the peak of a checkpoint's measures, the larger of its two
    forwards: the measures' (the residual stream entering each layer and the last, the queries, keys and values kept,
    the logits with their fp32 copy and the loss's log-softmax, one layer's maps being made) and the head classes'
    (every layer's maps kept in fp32, one layer's in float64 with the head outputs, the values kept)."""
    s, d, L, H = shape.itemsize, shape.hidden, shape.n_layers, shape.n_heads
    qkv = L * (H + 2 * shape.n_kv_heads) * n * shape.head_dim * s
    cells = H * n * n
    measures = (L + 1) * n * d * s + qkv + 3 * n * shape.vocab * 4 + MAP_COPIES * cells * 4 + 3 * L * H * n * 4
    classes = L * cells * 4 + cells * (8 + MAP_COPIES * 4) + H * n * (shape.head_dim + d) * 8 + qkv
    return int(max(measures, classes) + 9 * n)  # and the probe's ids and quiet queries


def row_seconds(shape: Shape, n: int) -> float:
    """One probe sequence's time at a checkpoint: its two forwards, the head outputs and each layer's spectrum (an
    m x m Gram matrix's eigenvalues, m the smaller of n and the width, ~10 m^3), :data:`WORK` times their operations
    at the measured rate, and :data:`SPECTRUM_SECONDS` a layer."""
    L, m = shape.n_layers, min(n, shape.hidden)
    flops = 2 * (L * budgets.layer_flops(shape, n) + budgets.head_flops(shape, n))
    flops += 2 * L * shape.n_heads * n * shape.head_dim * (n + shape.hidden)  # the head outputs
    flops += L * (2 * n * shape.hidden * m + 10 * m**3)  # the spectra
    return WORK * flops / budgets.rate(shape.device, shape.dtype) + L * SPECTRUM_SECONDS


@dataclass(frozen=True)
class TablePlan:
    """The table of ``checkpoints`` checkpoints measured on ``rows`` sequences of ``n`` tokens: ``peak`` bytes a
    checkpoint makes beyond its weights, against ``budget``; ``seconds`` for all of them."""

    checkpoints: int
    rows: int
    n: int
    peak: int
    per_row: int
    budget: int
    seconds: float

    @classmethod
    def of(cls, loaded, checkpoints: int, rows: int, n: int, given_budget: int | None = None) -> "TablePlan":
        """The plan of ``checkpoints`` checkpoints shaped as ``loaded`` (the first of them), under the memory budget
        (:func:`attnviz.effects.budget.budget`; ``given_budget`` a caller's own, in bytes)."""
        shape = Shape.of(loaded)
        per_row = row_bytes(shape, n)
        repeated = 2 * formation.repeat_length(loaded) + 1  # the head classes' repeated tokens
        fixed = REPEATED_ROWS * row_bytes(shape, repeated)
        seconds = checkpoints * (rows * row_seconds(shape, n) + REPEATED_ROWS * row_seconds(shape, repeated))
        return cls(checkpoints, rows, n, max(rows * per_row, fixed), per_row, budgets.budget(loaded, given_budget),
                   seconds)

    @property
    def fits(self) -> int:
        """The most probe sequences whose checkpoint fits the budget."""
        return max(0, self.budget // max(self.per_row, 1))

    def check(self) -> "TablePlan":
        """Refuse, before any forward, a probe whose checkpoint does not fit the budget; returns the plan."""
        if self.peak > self.budget:
            fit = (f"at most ~{self.fits:,} sequences fit (attnviz emergence --samples)" if self.fits
                   else "not one sequence fits: a shorter text, or a larger ATTNVIZ_MEMORY_MB")
            raise TableTooLarge(f"the emergence table of {self.rows:,} probe sequences of {self.n} tokens needs "
                                f"~{devices.mb(self.peak)} a checkpoint (~{budgets.duration(self.seconds)} for its "
                                f"{self.checkpoints}), more than the memory budget's {devices.mb(self.budget)} "
                                f"(ATTNVIZ_MEMORY_MB less the weights): {fit}")
        return self

    def steps(self) -> list[float]:
        """Each checkpoint's work, in order (the same: one probe)."""
        return [1.0] * self.checkpoints

    def describe(self) -> str:
        """One line: the checkpoints, the probe, the peak against the budget, the time."""
        return (f"the emergence table of {self.checkpoints} checkpoint{'s' if self.checkpoints != 1 else ''} on "
                f"{self.rows:,} sequence{'s' if self.rows != 1 else ''} of {self.n} tokens: peak "
                f"~{devices.mb(self.peak)} a checkpoint of the {devices.mb(self.budget)} budget, "
                f"~{budgets.duration(self.seconds)}")
