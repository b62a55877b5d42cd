"""What a capture keeps, and its plan: the one place that sizes a capture.

:class:`Keep` says what a capture keeps (as the :class:`~attnviz.recipe.Recipe` says what its forward
computes): the recorded layers, full maps or statistics (and which ones), the pooled size, the extras,
the checkpoints and the storage dtype. It knows its own host and device bytes (:meth:`Keep.host_bytes`,
:meth:`Keep.device_bytes`) and makes the engine's :class:`~attnviz.core.engine.Record` (:meth:`Keep.record`).

:func:`plan` decides, before anything runs, what a capture of n tokens keeps under a memory budget: full maps
of every layer when they fit the per-capture limit, else statistics with max-pooled maps (any length), plus
the layer inputs a long capture keeps so that a region resumes near its layer; or a refusal that says what
would fit. :func:`check_device` checks the device's working set at the block size :func:`block_bytes` picks.
:func:`decide` does both for :func:`attnviz.capture.prepare`, which the app asks once, showing the answer.

Every size a run works to is decided here, and the engine reads it (:class:`~attnviz.core.sizing.sizes.Sizes`): a query
block's bytes on each device, the size above which an allow-set is made a block of rows at a time, and which
layers' full maps are staged on a device. The plan reads what it needs once, before it computes: the model's
:class:`~attnviz.core.sizing.sizes.Shape`, the recorded layers, and what the recipe's masks make a capture hold
(:class:`~attnviz.core.sizing.sizes.Masks`); every estimate is then arithmetic on them.
``tests/test_sizing.py`` captures with every allocation tracked and holds the estimates to what runs.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace

import torch

from attnviz.core.model import devices
from attnviz.core import engine
from attnviz.core.sizing import estimates
from attnviz.core.spec import syntax
from attnviz.core.loading.models import LoadedModel
from attnviz.core.sizing.estimates import pooled_side  # noqa: F401 - the pooled maps' side, read here
from attnviz.core.engine.routes import route_notes  # noqa: F401 - what a statistics capture's route will be
from attnviz.core.sizing.sizes import STAGE_SHARE, Masks, Shape, Sizes, whole_allow_bytes  # noqa: F401 - read here
from attnviz.errors import InputError
from attnviz.stats import metrics

POOL = 512  # cells a side of a long capture's pooled maps: what a heatmap image shows anyway
POOLED_EXTRAS = frozenset({"value_norms", "scores"})  # views a long capture serves as pooled maps too
CHECKPOINT_BYTES = 512 * 2**20  # layer inputs a long capture keeps at most (ATTNVIZ_CHECKPOINT_MB in the app)
EXTRAS = ("scores", "value_norms", "activations", "qkv", "hidden_states")


def _integer(x) -> bool:
    """An int (numpy's too), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass(frozen=True)
class Keep:
    """What a capture keeps. Frozen and hashable: with the recipe's key and the text it is the app's cache key.

    - ``layers``: the recorded layers, in the one layer-list syntax ("all", "0,5,-1", "20-29") or a sequence;
      None records every layer (the others run through SDPA);
    - ``statistics``: False keeps full maps; True keeps every statistic of :data:`metrics.STATISTICS` per layer
      instead, block by block, never a full map; a tuple of names keeps only those (and the cheap ones);
    - ``pool`` (with statistics): each layer's maps max-pooled to at most ``pool`` cells a side, what a long
      text's heatmaps show (:meth:`attnviz.capture.Capture.layer_view`);
    - the extras: pre-softmax ``scores``, ``value_norms`` (||W_O^h v_j||), the residual stream's
      ``activations`` (norms, top values), the recorded layers' ``qkv``, every layer's ``hidden_states``;
    - ``checkpoints``: that many evenly spaced layers' inputs kept on the host (:func:`checkpoint_layers`),
      from which a region of a long capture resumes its forward (``regions.of_capture``);
    - ``storage_dtype``: of full maps (softmax always in fp32);
    - ``block_bytes``: fp32 scores of one query block; None leaves it to :func:`block_bytes`.
    """

    layers: str | tuple[int, ...] | None = None
    statistics: bool | tuple[str, ...] = False
    pool: int | None = None
    scores: bool = False
    value_norms: bool = False
    activations: bool = False
    qkv: bool = False
    hidden_states: bool = False
    checkpoints: int = 0
    storage_dtype: torch.dtype = torch.float16
    block_bytes: int | None = None

    def __post_init__(self):
        # each argument checked for its type and range here, where it is given, in one line (not deep in a run)
        if isinstance(self.layers, int) and not isinstance(self.layers, bool):
            object.__setattr__(self, "layers", (self.layers,))
        elif self.layers is not None and not isinstance(self.layers, str):
            items = list(self.layers) if isinstance(self.layers, (list, tuple, range)) else None
            if items is None or not all(_integer(x) for x in items):
                raise InputError(f"Keep(layers=...) takes a layer list such as \"0,5,-1\" or \"20-29\", or a sequence of "
                                 f"layer numbers; got {self.layers!r}")
            object.__setattr__(self, "layers", tuple(int(x) for x in items))
        if isinstance(self.statistics, str):
            object.__setattr__(self, "statistics", (self.statistics,))
        if not isinstance(self.statistics, bool):
            if not isinstance(self.statistics, (list, tuple)) or not all(isinstance(x, str) for x in self.statistics):
                raise InputError(f"Keep(statistics=...) takes True, False or statistic names; got {self.statistics!r}")
            object.__setattr__(self, "statistics", tuple(self.statistics))
            unknown = metrics.unknown_statistics(self.statistics)
            if unknown:  # refused here, not late in the engine: a keep names what it keeps
                raise InputError(f"unknown statistics {', '.join(map(repr, unknown))}: "
                                 f"choose from {', '.join(s.name for s in metrics.STATISTICS)}")
        if self.pool is not None and (not _integer(self.pool) or self.pool < 2):
            raise InputError(f"Keep(pool=...) is a map's largest side in cells, an integer of at least 2; got {self.pool!r}")
        if not _integer(self.checkpoints) or self.checkpoints < 0:
            raise InputError(f"Keep(checkpoints=...) is a number of layers, 0 or more; got {self.checkpoints!r}")
        if not isinstance(self.storage_dtype, torch.dtype) or not self.storage_dtype.is_floating_point:
            raise InputError(f"Keep(storage_dtype=...) is a float dtype (torch.float16, torch.bfloat16, torch.float32): "
                             f"probabilities in {self.storage_dtype!r} would round to 0 and 1")
        if self.block_bytes is not None and (not _integer(self.block_bytes) or self.block_bytes < 1):
            raise InputError(f"Keep(block_bytes=...) is a positive number of bytes; got {self.block_bytes!r}")
        for name in ("scores", "value_norms", "activations", "qkv", "hidden_states"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"Keep({name}=...) is True or False; got {getattr(self, name)!r}")
        if self.statistics and self.scores and not self.pool:
            raise InputError("statistics keep pre-softmax scores only as pooled maps: give a pool size as well")

    @classmethod
    def of(cls, extras=(), **fields) -> "Keep":
        """A keep with the named ``extras`` (any of :data:`EXTRAS`) switched on."""
        unknown = set(extras) - set(EXTRAS)
        if unknown:
            raise InputError(f"unknown extra(s) {sorted(unknown)}: choose from {', '.join(EXTRAS)}")
        return cls(**fields, **{name: True for name in extras})

    @property
    def full_maps(self) -> bool:
        return not self.statistics

    def recorded(self, n_layers: int) -> list[int]:
        """The recorded layers of a model of ``n_layers`` (:func:`attnviz.core.spec.syntax.layers`)."""
        return syntax.layers(self.layers, n_layers)

    def host_bytes(self, loaded: "LoadedModel | Shape", n_tokens: int, masks: Masks | None = None) -> int:
        """What the capture will hold (as :func:`ui.lru.nbytes` counts it), before it runs
        (:func:`estimates.held`), under the recipe's ``masks`` (:func:`masks_of`)."""
        shape = Shape.of(loaded)
        return estimates.held(shape, self, int(n_tokens), Masks() if masks is None else masks,
                              self.recorded(shape.n_layers))

    def device_bytes(self, loaded: "LoadedModel | Shape", n_tokens: int, masks: Masks | None = None) -> int:
        """What the capture needs on the model's device beyond the weights, before it runs
        (:func:`estimates.working`), under the recipe's ``masks``."""
        shape = Shape.of(loaded)
        return estimates.working(shape, self, int(n_tokens), Masks() if masks is None else masks,
                                 self.recorded(shape.n_layers))

    def sizes(self) -> Sizes:
        """The sizes a run of this keep works to (:meth:`Sizes.of`)."""
        return Sizes.of(self)

    def recorders(self, tokens: list[str]) -> tuple:
        """The recorders of one capture keeping this (``tokens``: the text's, for the statistics that read
        delimiters), in the order the engine feeds them: value norms first (the pooled value-weighted maps read
        them), q/k/v, then full maps (held packed: docs/methods.md#full-maps-held-packed; and score maps) or the
        statistics block by block, never a full map."""
        from attnviz.core.record import recorders
        from attnviz.core.record.reduce import Summaries

        summaries = (Summaries(tokens, self.pool, None if self.statistics is True else self.statistics)
                     if self.statistics else None)
        return recorders.made(self.storage_dtype, summaries, self.scores, self.value_norms, self.qkv, packed=True)

    def record(self, shape: Shape, tokens: list[str], layers: list[int], on_layer=None, kept=None) -> engine.Record:
        """What the engine records for this keep on a model of ``shape`` over ``tokens``: the recorded ``layers``
        (:meth:`recorded`), its recorders (:meth:`recorders`), the sizes (:meth:`sizes`) and the checkpointed layers
        (``kept`` overrides them: none under a residual variant). What the model or the device cannot give is
        refused before, by :func:`attnviz.capture.prepare`."""
        checkpoints = estimates.checkpoint_layers(shape, self.checkpoints) if kept is None else frozenset(kept)
        return engine.Record(layers=frozenset(layers), recorders=self.recorders(tokens), on_layer=on_layer,
                             sizes=self.sizes(), checkpoints=checkpoints)

    def describe(self) -> str:
        """A short phrase for progress labels: "full maps" or "statistics"."""
        return "full maps" if self.full_maps else "statistics"


def block_bytes(loaded: "LoadedModel | Shape", keep: Keep) -> int:
    """The fp32 scores of one query block of a recorded layer on the model's device (:meth:`Sizes.block_of` the
    device's own, for the keep's :meth:`Keep.sizes`)."""
    return keep.sizes().block_of(Shape.of(loaded).block)


def checkpoint_bytes(loaded: "LoadedModel | Shape", n_tokens: int) -> int:
    """One kept layer input (:func:`estimates.checkpoint_bytes`)."""
    return estimates.checkpoint_bytes(Shape.of(loaded), n_tokens)


def checkpoint_layers(loaded: "LoadedModel | Shape", count: int) -> frozenset[int]:
    """The layers whose inputs ``count`` checkpoints keep (:func:`estimates.checkpoint_layers`)."""
    return estimates.checkpoint_layers(Shape.of(loaded), count)


def checkpoint_count(loaded: "LoadedModel | Shape", n_tokens: int, budget: int, most: int = 8) -> int:
    """How many checkpoints of ``n_tokens`` fit ``budget`` bytes (:func:`estimates.checkpoint_count`)."""
    return estimates.checkpoint_count(Shape.of(loaded), n_tokens, budget, most)


def check_device(loaded: "LoadedModel | Shape", n_tokens: int, keep: Keep, what: str = "this capture",
                 masks: Masks | None = None) -> None:
    """Refuse, before running, a capture whose device working set exceeds the device's free memory, saying what
    would fit (:func:`estimates.check`, under the recipe's ``masks``)."""
    shape = Shape.of(loaded)
    estimates.check(shape, keep, int(n_tokens), Masks() if masks is None else masks, keep.recorded(shape.n_layers),
                    what)


class CaptureTooLarge(InputError):
    """A capture that does not fit its memory budget; the message says what would."""


@dataclass(frozen=True)
class Plan:
    """What :func:`attnviz.capture.capture` is asked to keep (``keep``) and what it will hold (``estimate``)."""

    keep: Keep = field(default_factory=Keep)
    estimate: int = 0
    notes: tuple[str, ...] = ()  # what the user should know about how it runs (a statistic the fused kernel lacks)
    n_tokens: int = 0

    @property
    def full_maps(self) -> bool:
        return self.keep.full_maps


@dataclass(frozen=True)
class Budget:
    """What a capture may take: ``per_capture`` bytes at most for one capture's full maps, ``left`` what the memory
    budget has left for captures, ``checkpoints`` bytes of layer inputs a long capture keeps at most, and
    ``max_tokens`` a cap on the text's tokens below the model's own (None: none)."""

    per_capture: int
    left: int
    checkpoints: int = CHECKPOINT_BYTES
    max_tokens: int | None = None


def plan(loaded: "LoadedModel | Shape", n_tokens: int, per_capture: int, left: int, keep: Keep = Keep(),
         residual: str | None = None, checkpoint_bytes: int = CHECKPOINT_BYTES, masks: Masks | None = None) -> Plan:
    """The plan of a capture of ``n_tokens`` asked to keep ``keep`` (full maps and its extras):
    ``per_capture`` bytes is the most one capture's full maps may take, ``left`` what the memory budget has
    left for captures; a ``residual`` variant needs full maps; ``masks``: the recipe's (:func:`masks_of`), which
    sizes its allow-sets. Raises :class:`CaptureTooLarge` with what would fit."""
    shape = Shape.of(loaded)
    return _plan(shape, int(n_tokens), keep, Masks() if masks is None else masks, keep.recorded(shape.n_layers),
                 Budget(per_capture, left, checkpoint_bytes), residual)


def decide(shape: Shape, n: int, keep: Keep, masks: Masks, recorded: list[int], budget: Budget | None = None,
           residual: str | None = None) -> Plan:
    """The plan of a capture (:func:`plan` under ``budget``; without one, ``keep`` as asked), checked against the
    device (:func:`check_device`): what :func:`attnviz.capture.prepare` asks, once it has read the model's shape,
    the recorded layers and the recipe's masks. Pure arithmetic on them."""
    planned = Plan(keep, estimates.held(shape, keep, n, masks, recorded), n_tokens=n) if budget is None else \
        _plan(shape, n, keep, masks, recorded, budget, residual)
    estimates.check(shape, planned.keep, n, masks, recorded, f"a capture of {len(recorded)} layers")
    return planned


def _plan(shape: Shape, n: int, keep: Keep, masks: Masks, recorded: list[int], budget: Budget,
          residual: str | None) -> Plan:
    held = estimates.held
    left = budget.left
    limit = min(budget.per_capture, left)
    full = held(shape, keep, n, masks, recorded)
    if full <= limit:
        return Plan(keep, full, n_tokens=n)
    extras = {name for name in EXTRAS if getattr(keep, name) and name != "hidden_states"}
    if not extras <= POOLED_EXTRAS or residual:
        what = "a residual variant" if residual else "this view"
        fit = estimates.largest(n, lambda m: held(shape, keep, m, masks, recorded) <= limit)
        one = held(shape, replace(keep, layers=(0,)), n, masks, [0])
        few = max((k for k in range(1, shape.n_layers + 1)
                   if held(shape, replace(keep, layers=tuple(range(k))), n, masks, list(range(k))) <= limit),
                  default=0)
        fewer = (f", fewer recorded layers ({few} of {shape.n_layers} fit at this length: `attnviz capture --layers`)"
                 if few and not residual else "")
        raise CaptureTooLarge(
            f"{what.capitalize()} needs the full maps of every layer: ~{devices.mb(full)} for {n} tokens, more "
            f"than the {devices.mb(limit)} allowed per capture. What would fit: a text of at most ~{fit} tokens{fewer}, "
            f"or the plain attention weights (statistics and pooled maps, any length). One layer alone would take "
            f"~{devices.mb(one)}.")
    # the statistics the caller chose, if it chose some: every statistic only when it asked for full maps
    long = replace(keep, statistics=keep.statistics or True, pool=POOL, hidden_states=False)
    notes = route_notes(None if long.statistics is True else long.statistics)
    stats = held(shape, long, n, masks, recorded)
    if stats > left:
        fit = estimates.largest(n, lambda m: held(shape, long, m, masks, recorded) <= left, step=256)
        raise CaptureTooLarge(
            f"This capture would take ~{devices.mb(stats)} even as statistics only, more than the {devices.mb(left)} "
            f"left for captures. What would fit: a text of at most ~{fit} tokens.")
    # layer inputs to resume a region's forward from (regions.of_capture): they only speed regions up
    long = replace(long, checkpoints=estimates.checkpoint_count(shape, n, min(budget.checkpoints, left - stats)))
    return Plan(long, held(shape, long, n, masks, recorded), notes, n)


def masks_of(loaded: LoadedModel, recipe) -> Masks:
    """What ``recipe`` (a :class:`~attnviz.recipe.Recipe`, an architecture string, or a built recipe) makes a
    capture on ``loaded`` hold (:meth:`Masks.of`)."""
    from attnviz import recipe as recipe_mod

    built = recipe if isinstance(recipe, recipe_mod.Built) else recipe_mod.build(loaded, recipe)
    return Masks.of(Shape.of(loaded), built)
