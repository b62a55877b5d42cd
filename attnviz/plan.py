"""The capture plan: before anything runs, what a capture of n tokens under a recipe will keep, and
whether it fits. A library decision (the app only shows the answer): full maps of every layer when
they fit the per-capture limit, else statistics with max-pooled maps (any length), plus the layer
inputs a long capture keeps so that a region resumes near its layer; or a refusal that says what
would fit. The device's own working set is checked by :func:`attnviz.capture.check_device`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attnviz.capture import checkpoint_count, estimate_bytes
from attnviz.core import devices
from attnviz.core.models import LoadedModel
from attnviz.errors import InputError

POOL = 512  # cells a side of a long capture's pooled maps: what a heatmap image shows anyway
POOLED_EXTRAS = frozenset({"value_norms", "scores"})  # views a long capture serves as pooled maps too
CHECKPOINT_BYTES = 512 * 2**20  # layer inputs a long capture keeps at most (ATTNVIZ_CHECKPOINT_MB in the app)


class CaptureTooLarge(InputError):
    """A capture that does not fit its memory budget; the message says what would."""


@dataclass(frozen=True)
class Plan:
    """What :func:`attnviz.capture.capture` is asked for (``options``) and what it will hold (``estimate``)."""

    options: dict = field(default_factory=dict)
    estimate: int = 0
    notes: tuple[str, ...] = ()  # what the user should know about how it runs (a statistic the fused kernel lacks)

    @property
    def full_maps(self) -> bool:
        return not self.options.get("reduce")


def plan(loaded: LoadedModel, n_tokens: int, per_capture: int, left: int, hidden: bool = True,
         extras: tuple[str, ...] = (), residual: str | None = None,
         checkpoint_bytes: int = CHECKPOINT_BYTES) -> Plan:
    """The plan of a capture of ``n_tokens``: ``per_capture`` bytes is the most one capture's full maps
    may take, ``left`` what the memory budget has left for captures; ``extras`` the views that record
    more ("scores", "value_norms", "activations"); a ``residual`` variant needs full maps. Raises
    :class:`CaptureTooLarge` with what would fit."""
    limit = min(per_capture, left)
    full = estimate_bytes(loaded, n_tokens, hidden_states=hidden)
    if full <= limit:
        return Plan({}, full)
    long_options = dict(reduce=True, pool=POOL, value_norms="value_norms" in extras, scores="scores" in extras)
    if not set(extras) <= POOLED_EXTRAS or residual:
        what = "a residual variant" if residual else "this view"
        fit = devices.largest(n_tokens, lambda n: estimate_bytes(loaded, n, hidden_states=hidden) <= limit)
        one = estimate_bytes(loaded, n_tokens, layers=1, hidden_states=hidden)
        few = max((k for k in range(1, loaded.n_layers + 1)
                   if estimate_bytes(loaded, n_tokens, layers=k, hidden_states=hidden) <= limit), default=0)
        fewer = (f", fewer recorded layers ({few} of {loaded.n_layers} fit at this length: `attnviz capture --layers`)"
                 if few and not residual else "")
        raise CaptureTooLarge(
            f"{what.capitalize()} needs the full maps of every layer: ~{devices.mb(full)} for {n_tokens} tokens, more "
            f"than the {devices.mb(limit)} allowed per capture. What would fit: a text of at most ~{fit} tokens{fewer}, "
            f"or the plain attention weights (statistics and pooled maps, any length). One layer alone would take "
            f"~{devices.mb(one)}.")
    stats = estimate_bytes(loaded, n_tokens, **long_options)
    if stats > left:
        fit = devices.largest(n_tokens, lambda n: estimate_bytes(loaded, n, **long_options) <= left, step=256)
        raise CaptureTooLarge(
            f"This capture would take ~{devices.mb(stats)} even as statistics only, more than the {devices.mb(left)} "
            f"left for captures. What would fit: a text of at most ~{fit} tokens.")
    # layer inputs to resume a region's forward from (regions.of_capture): they only speed regions up
    count = checkpoint_count(loaded, n_tokens, min(checkpoint_bytes, left - stats))
    return Plan({"reduce": True, "pool": POOL, "hidden_states": False, "checkpoints": count},
                estimate_bytes(loaded, n_tokens, **long_options, checkpoints=count), route_notes())


def route_notes(statistics=None) -> tuple[str, ...]:
    """What a statistics capture's route will be, where it matters: statistics finished from sums the fused
    kernel does not compute take the block engine on every device (slower on a GPU, never a statistic left
    at zero)."""
    from attnviz.core import kernels
    from attnviz.stats.metrics import RowSum
    from attnviz.stats.reduce import Summaries

    reducer = Summaries(["."], statistics=statistics)
    missing = reducer.missing_sums(kernels.SUMS)
    if not missing:
        return ()
    names = sorted(s.name for s in reducer.statistics
                   if any((x.name if isinstance(x, RowSum) else x) in missing for x in s.sums))
    return (f"{', '.join(names)} need{'s' if len(names) == 1 else ''} {', '.join(missing)}, which the fused kernel "
            "does not compute: statistics captures take the block engine",)
