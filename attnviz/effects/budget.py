"""The plan of an analysis that runs many forwards of one text, made before any forward (docs/methods.md#the-plan-of-an-analysis).

Path patching, the causal scan and activation patching open a text once (:class:`~attnviz.effects.opening.Opening`)
and then resume batches of rows from a layer's kept input, a row a patch. A long text makes each row large (its
activations are n × d a layer, its allow-set n × n), and the number of rows is the analysis's, not the text's: path
patching's defaults put a dozen rows in its lowest batches. :class:`AnalysisPlan` sizes it all from the model's
shape, before anything runs:

- ``held``: what the analysis keeps from its first forward to its last (every layer's input, kept activations);
- ``opening``: what its unpatched forwards make beside that, a row each;
- :meth:`AnalysisPlan.batch`: what one resumed batch of r rows makes at its peak, the largest of its phases
  (:func:`batch_bytes`; a query block's working set whatever the rows, a step of the perplexity's logits);
- ``rows``: the most rows a batch runs at once within the budget (a larger batch is run in parts, the same numbers);
- ``steps``: the forwards in order, each weighed in layer-rows (a row through one layer), for the time left;
- ``seconds``: the time, estimated from the forwards' floating-point operations at the rate this machine's matrix
  product was measured to run (:func:`rate`); a timing is an estimate, never a verdict.

Where even one row does not fit the budget, :meth:`AnalysisPlan.check` refuses before any forward, in one line with
the estimate and a narrower choice (:class:`AnalysisTooLarge`). The budget (:func:`budget`) is the memory budget
(``ATTNVIZ_MEMORY_MB``, else a quarter of the machine's memory) less the model's weights held in it, and at most what
is free on an accelerator. ``tests/test_budget.py`` measures the peak of real runs, every allocation tracked, against
:attr:`AnalysisPlan.peak`.
"""

from __future__ import annotations

import numbers
import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from attnviz import settings
from attnviz.core.model import devices
from attnviz.core.sizing.sizes import Shape
from attnviz.errors import InputError

#: fp32 copies of one query block alive at once while a recorded layer's block is made (its scores, its
#: probabilities, and the mask's and recorder's work beside them)
BLOCK_COPIES = 3
#: the logits one step of the perplexity makes at most (:func:`attnviz.effects.opening.perplexities_of`: their
#: fp32 copy and the cross-entropy's beside them): a text's (n, V) logits are never whole, 590 MB a row at 3,000
#: tokens of a 49k vocabulary
LOGITS_BYTES = 32 * 2**20
#: how much slower a whole forward runs than its matrix products alone at the measured rate (norms, rotary
#: embeddings, the attention's blocks and softmax, the sites' functions): measured on the default model on a CPU
OVERHEAD = 2.0


class AnalysisTooLarge(InputError):
    """An analysis of which not even one row fits the memory budget; the message says what would."""


def _bytes(given) -> int:
    if not isinstance(given, numbers.Integral) or isinstance(given, bool) or given < 1:
        raise InputError(f"a memory budget is a positive number of bytes, not {given!r}")
    return int(given)


def machine_bytes() -> int:
    """The machine's memory (the host's)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weights_bytes(loaded, host_only: bool = False) -> int:
    """The model's weights (``host_only``: those held on the host, in the memory budget)."""
    return sum(p.numel() * p.element_size() for p in loaded.model.parameters()
               if not host_only or p.device.type == "cpu")


def memory_bytes() -> int:
    """The memory budget in bytes (``ATTNVIZ_MEMORY_MB``, :attr:`attnviz.settings.Settings.memory_mb`; 0: a quarter
    of the machine's memory)."""
    mb = settings.active().memory_mb
    return mb * 2**20 if mb > 0 else machine_bytes() // 4


def budget(loaded, given: int | None = None) -> int:
    """Bytes an analysis may make beyond the model's weights: ``given`` (a caller's own: the app's, a visitor's), else
    the memory budget (``ATTNVIZ_MEMORY_MB``, :attr:`attnviz.settings.Settings.memory_mb`; 0: a quarter of the
    machine's memory) less the weights it holds on the host; on an accelerator at most what is free there
    (:func:`attnviz.core.model.devices.free_bytes`)."""
    if given is not None:
        return _bytes(given)
    left = memory_bytes() - weights_bytes(loaded, host_only=True)
    free = devices.free_bytes(loaded.model.device)
    return max(0, left if free is None else min(left, free))


_RATES: dict = {}


def rate(device, dtype: torch.dtype) -> float:
    """Floating-point operations a second of a matrix product on ``device`` in ``dtype`` (1024³, the best of three
    after a warm-up), measured once a process: what the time estimates divide by."""
    device = torch.device(device)
    key = (str(device), dtype)
    if key not in _RATES:
        if device.type == "meta":
            _RATES[key] = 1e11
            return _RATES[key]
        dt = dtype if device.type != "cpu" or dtype == torch.float32 else torch.float32
        a = torch.randn(1024, 1024, device=device, dtype=dt)
        best = float("inf")
        for _ in range(4):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            (a @ a).sum().item()
            best = min(best, time.perf_counter() - start)
        _RATES[key] = 2 * 1024**3 / max(best, 1e-6)
    return _RATES[key]


def batch_bytes(shape: Shape, n: int, rows: int, allow_sets: int = 1, extra: int = 0, block: int = 0) -> int:
    """What a batch of ``rows`` rows makes at its peak, a layer in flight, the most of its phases: each row holds
    the stream and its normed copy (two n × d), ``extra`` n × d of the sites' functions (a cut's streams, a patch's
    copy) and its allow-sets (an n × n bool each, ``allow_sets`` the recipe's distinct ones), and

    - while an allow-set is made: the queries, keys and values, and one n × n more;
    - while the attention runs block by block: the same and its gathered output, and one query block's working set
      (``block``, whatever the rows: the block's rows shrink as the batch grows);
    - in the MLP: the sum after the attention and three n × intermediate activations."""
    s, d = shape.itemsize, shape.hidden
    qkv = (2 * shape.n_heads + 2 * shape.n_kv_heads) * shape.head_dim
    base = n * s * (2 + extra) * d + allow_sets * n * n
    making = base + n * s * qkv + n * n
    attending = base + n * s * (qkv + 2 * shape.n_heads * shape.head_dim)
    mlp = base + n * s * (d + 3 * shape.inner)
    return max(rows * making, rows * attending + block, rows * mlp)


def layer_flops(shape: Shape, n: int) -> float:
    """One row through one layer: the projections, a gated MLP, the attention's two products (under a causal mask,
    half of them)."""
    d, hd = shape.hidden, shape.head_dim
    projections = 2 * n * d * (2 * shape.n_heads + 2 * shape.n_kv_heads) * hd
    return projections + 2 * n * 3 * d * shape.inner + 2 * shape.n_heads * hd * n * n


def head_flops(shape: Shape, n: int) -> float:
    """One row's logits of every position (the perplexity)."""
    return 2.0 * n * shape.hidden * shape.vocab


@dataclass(frozen=True)
class AnalysisPlan:
    """What an analysis of ``n`` tokens will run and hold (see the module docstring). Made by :func:`make`."""

    what: str
    n: int
    budget: int
    held: int  # kept from the first forward to the last
    opening: int  # what an unpatched forward (or a phase before it) makes beside that
    batches: tuple[tuple[int, int], ...]  # (the layer a batch resumes from, its rows), before it is split
    openings: int  # the unpatched forwards
    shape: Shape = field(repr=False, compare=False, default=None)
    head: bool = True  # a batch reads the logits of every position (the perplexity), not the last only
    note: str = ""  # what is not known yet (path patching's senders before the scan)
    allow_sets: int = 1  # the recipe's distinct allow-sets
    extra: int = 0  # n × d a row of the sites' functions
    block: int = 0  # a query block's working set
    logits: int = 0  # a step of the logits
    resize: Callable[[int], "AnalysisPlan"] | None = field(repr=False, compare=False, default=None)  # at n tokens

    def batch(self, rows: int) -> int:
        """What one batch of ``rows`` rows makes at its peak: its layers (:func:`batch_bytes`), then its logits
        beside the top layer's output."""
        n, d, s = self.n, self.shape.hidden, self.shape.itemsize
        return max(batch_bytes(self.shape, n, rows, self.allow_sets, self.extra, self.block),
                   rows * n * d * s + self.logits)

    @property
    def per_row(self) -> int:
        return self.batch(2) - self.batch(1)

    @property
    def rows(self) -> int:
        """The most rows one batch runs at once within the budget (at least one: below that, :meth:`check`)."""
        room, lo, hi = self.budget - self.held, 1, max((r for _, r in self.batches), default=1)
        while lo < hi:  # the most rows whose batch fits (a batch grows with its rows)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.batch(mid) <= room else (lo, mid - 1)
        return lo

    @property
    def split(self) -> list[tuple[int, int]]:
        """The batches as they run: each cut into parts of at most :attr:`rows` rows."""
        step = self.rows
        return [(layer, min(step, rows - start)) for layer, rows in self.batches for start in range(0, rows, step)]

    @property
    def forwards(self) -> int:
        return self.openings + len(self.split)

    @property
    def largest(self) -> int:
        return max((r for _, r in self.split), default=0)

    @property
    def peak(self) -> int:
        """The most the analysis makes at once beyond the weights: what it holds, and the larger of an unpatched
        forward and its largest batch."""
        return self.held + max(self.opening, self.batch(self.largest) if self.batches else 0)

    def one_row(self) -> int:
        return self.held + max(self.opening, self.batch(1))

    def steps(self) -> list[float]:
        """Each forward's work in layer-rows, in order: the unpatched forwards, then the batches."""
        L = self.shape.n_layers
        return [float(L)] * self.openings + [float(rows * (L - layer)) for layer, rows in self.split]

    @property
    def seconds(self) -> float:
        shape = self.shape
        flops = sum(self.steps()) * layer_flops(shape, self.n)
        flops += (self.openings + sum(r for _, r in self.split)) * (head_flops(shape, self.n) if self.head else 0)
        return OVERHEAD * flops / rate(shape.device, shape.dtype)

    def check(self, narrower: str) -> "AnalysisPlan":
        """Refuse, before any forward, an analysis of which one row does not fit (``narrower``: what the caller may
        give instead, besides a shorter text); returns the plan."""
        one = self.one_row()
        if one > self.budget:
            fit = self.tokens_that_fit()
            shorter = f"a text of at most ~{fit} tokens" if fit else "a smaller model"
            raise AnalysisTooLarge(
                f"{self.what} of {self.n} tokens needs ~{devices.mb(one)} with one row at a time "
                f"({devices.mb(self.held)} kept from its first forward), more than the memory budget's "
                f"{devices.mb(self.budget)} (ATTNVIZ_MEMORY_MB less the weights): give {shorter}{narrower}")
        return self

    def tokens_that_fit(self) -> int:
        """The longest text whose one-row run fits the budget (0: none)."""
        lo, hi = 0, self.n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.resize(mid).one_row() <= self.budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def describe(self) -> str:
        """One line: the forwards, the largest batch, the peak against the budget, the time."""
        rows = f", batches of at most {self.largest} rows" if self.batches else ""
        split = (f" (split to fit the budget: {self.rows} rows at a time)"
                 if any(r > self.rows for _, r in self.batches) else "")
        return (f"{self.what} of {self.n} tokens: {self.forwards} forwards{rows}{split}, peak ~{devices.mb(self.peak)} "
                f"of the {devices.mb(self.budget)} budget, ~{duration(self.seconds)}"
                + (f"; {self.note}" if self.note else ""))


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 5400:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def make(what: str, loaded, n: int, batches, held_layers: float = 1.0, extra: int = 0, openings: int = 1,
         head: bool = True, allow_sets: int = 1, given_budget: int | None = None, note: str = "",
         before=0) -> AnalysisPlan:
    """The plan of ``what`` over ``n`` tokens of ``loaded``: ``batches`` (the layer each resumes from, its rows);
    ``held_layers`` × L × n × d kept from the first forward (every layer's input: 1); ``extra`` n × d a row of the
    sites' functions;
    ``openings`` unpatched forwards of one row; ``head``: a batch reads every position's logits (the perplexity);
    ``allow_sets``: the recipe's distinct allow-sets; ``before``: what a phase before the first forward makes at its
    peak and lets go (the scan's score attribution), a function of n or a number."""
    shape = Shape.of(loaded)
    total = budget(loaded, given_budget)
    batches = tuple((int(layer), int(rows)) for layer, rows in batches if rows)

    def at(m: int) -> AnalysisPlan:
        s, d, L = shape.itemsize, shape.hidden, shape.n_layers
        block = min(shape.block, 4 * shape.n_heads * m * m) * BLOCK_COPIES
        step = min(LOGITS_BYTES, 12 * m * shape.vocab)  # a step of the perplexity's logits
        held = int(held_layers * L * m * d * s)
        # an unpatched forward: one row with a query block, then the perplexity's step beside the top layer's output
        opening = max(batch_bytes(shape, m, 1, allow_sets, 0, block), 2 * m * d * s + step,
                      before(m) if callable(before) else int(before))
        return AnalysisPlan(what, m, total, held, opening, batches, openings, shape, head, note, allow_sets, extra,
                            block, step if head else 4 * shape.vocab, at)

    return at(int(n))


def with_batches(plan: AnalysisPlan, batches, note: str = "") -> AnalysisPlan:
    """The same plan with its batches known (path patching's, once the scan has named the senders)."""
    return replace(plan, batches=tuple((int(l), int(r)) for l, r in batches if r), note=note)


def parts(rows: list, plan: AnalysisPlan) -> list[list]:
    """``rows`` cut into the parts a batch of them runs in (:attr:`AnalysisPlan.rows` at most each)."""
    step = plan.rows
    return [rows[i:i + step] for i in range(0, len(rows), step)]
