"""What a capture keeps, and its plan: the one place that sizes a capture.

:class:`Keep` says what a capture keeps (as the :class:`~attnviz.recipe.Recipe` says what its forward
computes): the recorded layers, full maps or statistics (and which ones), the pooled size, the extras,
the checkpoints and the storage dtype. It knows its own host and device bytes (:meth:`Keep.host_bytes`,
:meth:`Keep.device_bytes`) and makes the engine's :class:`~attnviz.core.engine.Record` (:meth:`Keep.record`), checked
against the device first.

:func:`plan` decides, before anything runs, what a capture of n tokens keeps under a memory budget: full maps
of every layer when they fit the per-capture limit, else statistics with max-pooled maps (any length), plus
the layer inputs a long capture keeps so that a region resumes near its layer; or a refusal that says what
would fit. :func:`check_device` checks the device's working set at the block size :func:`block_bytes` picks.
The app asks the plan once and shows the answer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch

from attnviz.core import devices, engine, syntax
from attnviz.core.models import LoadedModel
from attnviz.errors import InputError
from attnviz.stats import metrics
from attnviz.tokens import tokenize

POOL = 512  # cells a side of a long capture's pooled maps: what a heatmap image shows anyway
POOLED_EXTRAS = frozenset({"value_norms", "scores"})  # views a long capture serves as pooled maps too
CHECKPOINT_BYTES = 512 * 2**20  # layer inputs a long capture keeps at most (ATTNVIZ_CHECKPOINT_MB in the app)
EXTRAS = ("scores", "value_norms", "activations", "qkv", "hidden_states")


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
        if isinstance(self.layers, int) and not isinstance(self.layers, bool):
            object.__setattr__(self, "layers", (self.layers,))
        elif self.layers is not None and not isinstance(self.layers, str):
            object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        if isinstance(self.statistics, str):
            object.__setattr__(self, "statistics", (self.statistics,))
        if not isinstance(self.statistics, bool):
            object.__setattr__(self, "statistics", tuple(self.statistics))
            unknown = metrics.unknown_statistics(self.statistics)
            if unknown:  # refused here, not late in the engine: a keep names what it keeps
                raise InputError(f"unknown statistics {', '.join(map(repr, unknown))}: "
                                 f"choose from {', '.join(s.name for s in metrics.STATISTICS)}")
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
        """The recorded layers of a model of ``n_layers`` (:func:`attnviz.core.syntax.layers`)."""
        return syntax.layers(self.layers, n_layers)

    def host_bytes(self, loaded: LoadedModel, n_tokens: int) -> int:
        """What the capture will hold (as :func:`attnviz.core.lru.nbytes` counts it), before it runs.

        Full maps: storage-dtype (H, n, n) per recorded layer plus one n × n allow-set per mask; statistics:
        :func:`metrics.statistic_floats` per head and token per layer, plus the pooled maps (and pooled
        value-weighted maps and scores when ``value_norms`` / ``scores`` ask for them)."""
        n, heads = int(n_tokens), loaded.n_heads
        count = len(self.recorded(loaded.n_layers))
        masks = min(count, 4) * n * n  # allow-sets: one per distinct mask, rarely more than a few
        if self.statistics:
            side = min(n, self.pool) if self.pool else 0
            pooled_maps = 1 + self.value_norms + self.scores  # weights, and value-weighted maps / scores when asked
            per_layer = heads * n * 4 * self._floats() + heads * side * side * 2 * pooled_maps
        else:
            itemsize = torch.empty((), dtype=self.storage_dtype).element_size()
            per_layer = heads * n * n * itemsize * (1 + self.scores)
        per_layer += heads * n * 4 if self.value_norms else 0
        hidden = (loaded.n_layers + 1) * n * _hidden_size(loaded) * 2 if self.hidden_states else 0
        kept = len(checkpoint_layers(loaded, self.checkpoints)) * checkpoint_bytes(loaded, n)
        return count * per_layer + masks + hidden + kept + 4 * loaded.config.vocab_size

    def device_bytes(self, loaded: LoadedModel, n_tokens: int, masks: int = 2) -> int:
        """What the capture needs on the model's device beyond the weights, before it runs:

        - the working set of one query block: about four fp32 copies of its scores (scores/probabilities,
          the entropy's temporary, the pooled copy, the cast for P·V) at :func:`block_bytes`;
        - the allow-sets, one n × n bool per distinct mask (``masks``);
        - one layer's forward activations (hidden, MLP and q/k/v projections, in the model's dtype) and,
          when asked, every layer's hidden states;
        - one layer's statistics and pooled maps (finished layers go to the host);
        - the last position's logits.
        Full maps go to the host as they are made (staged on the device only where there is room), so
        they count against host memory (:meth:`host_bytes`), not here."""
        n, cfg, heads = int(n_tokens), loaded.config, loaded.n_heads
        rows = max(1, block_bytes(loaded, self) // (4 * heads * n))
        working = 4 * 4 * heads * min(rows, n) * n
        itemsize = next(loaded.model.parameters()).element_size()
        hidden = _hidden_size(loaded)
        inner = int(getattr(cfg, "intermediate_size", 0) or 4 * hidden)
        activations = n * (4 * hidden + 3 * inner) * itemsize
        states = (loaded.n_layers + 1) * n * hidden * itemsize if self.hidden_states or self.activations else 0
        stats = heads * n * 4 * self._floats() if self.statistics else 0
        pooled = heads * min(n, self.pool) ** 2 * 4 * (1 + self.value_norms + self.scores) \
            if self.statistics and self.pool else 0
        # an allow-set above the whole-allow size is made a block of rows at a time on the statistics route
        # (an AllowSet of kind "rows"): only a block's rows are ever on the device, not n × n
        rowwise = self.statistics and n * n > whole_allow_bytes()
        allow = masks * (min(rows, n) if rowwise else n) * n
        return working + allow + activations + states + stats + pooled + 4 * cfg.vocab_size

    def _floats(self) -> int:
        """Floats per head and token of the statistics this keep keeps (only the named ones and the cheap ones)."""
        return metrics.statistic_floats(None if self.statistics is True else self.statistics)

    def recorders(self, tokens: list[str]) -> tuple:
        """The recorders of one capture keeping this (``tokens``: the text's, for the statistics that read
        delimiters), in the order the engine feeds them: value norms first (the pooled value-weighted maps read
        them), q/k/v, then full maps (and score maps) or the statistics block by block, never a full map."""
        from attnviz.core import recorders
        from attnviz.core.reduce import Summaries

        summaries = (Summaries(tokens, self.pool, None if self.statistics is True else self.statistics)
                     if self.statistics else None)
        return recorders.made(self.storage_dtype, summaries, self.scores, self.value_norms, self.qkv)

    def record(self, loaded: LoadedModel, tokens: list[str], on_layer=None, kept=None, masks: int = 2) -> engine.Record:
        """What the engine records for this keep on ``loaded`` over ``tokens``: its recorders (:meth:`recorders`),
        the recorded layers, the block size and checkpoints; ``kept`` overrides the checkpointed layers (none under
        a residual variant). Refused first, before anything runs, where the device cannot hold it
        (:func:`check_device`, ``masks`` distinct masks) or where value norms are asked of a model whose output
        projection cannot be read."""
        layers = self.recorded(loaded.n_layers)
        check_device(loaded, len(tokens), self, f"a capture of {len(layers)} layers", masks)
        if self.value_norms:
            for module in engine.attention_modules(loaded.model)[:1]:
                engine.output_projection(module)
        return engine.Record(
            layers=frozenset(layers), recorders=self.recorders(tokens), on_layer=on_layer,
            block_bytes=block_bytes(loaded, self) if self._own_block() else None,  # None: each device's own
            checkpoints=checkpoint_layers(loaded, self.checkpoints) if kept is None else frozenset(kept))

    def _own_block(self) -> bool:
        """Whether the block size is this keep's (given, or the quartered one), not each device's default."""
        return self.block_bytes is not None or bool(self.statistics and (self.value_norms or self.scores))

    def describe(self) -> str:
        """A short phrase for progress labels: "full maps" or "statistics"."""
        return "full maps" if self.full_maps else "statistics"


def _hidden_size(loaded: LoadedModel) -> int:
    return int(getattr(loaded.config, "hidden_size", 0) or 0)


def whole_allow_bytes() -> int:
    """Allow-sets up to this size are made whole, once per mask, and shared by every layer with that mask (at
    8,192 tokens, 64 MB: making each block's rows for every layer instead cost 10 % of a statistics capture on the
    CPU); larger ones (1 GB at 32,768 tokens) are made a block of rows at a time where the route allows.
    ``ATTNVIZ_WHOLE_ALLOW_MB`` (default 256), read when a run is made."""
    return int(os.environ.get("ATTNVIZ_WHOLE_ALLOW_MB", "256")) * 2**20


def block_bytes(loaded: LoadedModel, keep: Keep) -> int:
    """The fp32 scores of one query block of a recorded layer: ``keep.block_bytes`` when given, else the
    device's (:func:`devices.block_bytes`), a quarter of it for statistics that also pool value-weighted
    maps or scores. Each block then also makes value-weighted and masked-score copies of itself to pool:
    a quarter keeps that working set down (8,177 tokens on the CPU: peak 1.9 GB above the model with
    64 MB blocks, 1.4 GB with 16 MB, and no slower; 4 MB as fast as 16 MB)."""
    if keep.block_bytes is not None:
        return keep.block_bytes
    whole = devices.block_bytes(loaded.model.device)
    return whole // 4 if keep._own_block() else whole


def checkpoint_bytes(loaded: LoadedModel, n_tokens: int) -> int:
    """One kept layer input: (n, hidden size) in the model's dtype."""
    itemsize = next(loaded.model.parameters()).element_size()
    return int(n_tokens) * _hidden_size(loaded) * itemsize


def checkpoint_layers(loaded: LoadedModel, count: int) -> frozenset[int]:
    """The layers whose inputs ``count`` checkpoints keep: evenly spaced above layer 0 (whose input is the
    embeddings, cheap to recompute), so a region of any layer resumes at most ceil(L / (count + 1)) - 1
    layers below it. Empty where the family cannot resume (:func:`engine.decoder_layers`); a capture keeps
    none under a residual variant (its own layer loop)."""
    if count <= 0 or engine.decoder_layers(loaded.model) is None:
        return frozenset()
    stride = -(-loaded.n_layers // (min(count, loaded.n_layers - 1) + 1))
    return frozenset(range(stride, loaded.n_layers, stride))


def checkpoint_count(loaded: LoadedModel, n_tokens: int, budget: int, most: int = 8) -> int:
    """How many checkpoints of ``n_tokens`` fit ``budget`` bytes (at most ``most``: eight put every
    region within ceil(L / 9) layers of one)."""
    one = checkpoint_bytes(loaded, n_tokens)
    return 0 if one <= 0 else max(0, min(most, budget // one))


def check_device(loaded: LoadedModel, n_tokens: int, keep: Keep, what: str = "this capture", masks: int = 2) -> None:
    """Refuse, before running, a capture whose device working set (:meth:`Keep.device_bytes`) exceeds the
    device's free memory (``torch.cuda.mem_get_info``, or ``ATTNVIZ_DEVICE_MB``), saying what would fit."""
    free = devices.free_bytes(loaded.model.device)
    need = keep.device_bytes(loaded, n_tokens, masks)
    if free is None or need <= free:
        return
    fit = devices.largest(n_tokens, lambda n: keep.device_bytes(loaded, n, masks) <= free)
    smaller = replace(keep, block_bytes=4 * devices.MB).device_bytes(loaded, n_tokens, masks)
    hint = f"; with ATTNVIZ_BLOCK_MB=4, ~{devices.mb(smaller)}" if smaller < need else ""
    raise devices.DeviceMemoryError(
        f"{what} needs ~{devices.mb(need)} on {loaded.model.device} for {n_tokens} tokens, more than the "
        f"{devices.mb(free)} free there{hint}. What would fit: "
        + (f"a text of at most ~{fit} tokens" if fit else "nothing until memory is freed on that device")
        + ("" if keep.statistics else ", or statistics only (`attnviz sinks`, a lower ATTNVIZ_FULL_MAPS_MB)"))


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


def plan(loaded: LoadedModel, n_tokens: int, per_capture: int, left: int, keep: Keep = Keep(),
         residual: str | None = None, checkpoint_bytes: int = CHECKPOINT_BYTES) -> Plan:
    """The plan of a capture of ``n_tokens`` asked to keep ``keep`` (full maps and its extras):
    ``per_capture`` bytes is the most one capture's full maps may take, ``left`` what the memory budget has
    left for captures; a ``residual`` variant needs full maps. Raises :class:`CaptureTooLarge` with what
    would fit."""
    limit = min(per_capture, left)
    full = keep.host_bytes(loaded, n_tokens)
    if full <= limit:
        return Plan(keep, full, n_tokens=n_tokens)
    extras = {name for name in EXTRAS if getattr(keep, name) and name != "hidden_states"}
    if not extras <= POOLED_EXTRAS or residual:
        what = "a residual variant" if residual else "this view"
        fit = devices.largest(n_tokens, lambda n: keep.host_bytes(loaded, n) <= limit)
        one = replace(keep, layers=(0,)).host_bytes(loaded, n_tokens)
        few = max((k for k in range(1, loaded.n_layers + 1)
                   if replace(keep, layers=tuple(range(k))).host_bytes(loaded, n_tokens) <= limit), default=0)
        fewer = (f", fewer recorded layers ({few} of {loaded.n_layers} fit at this length: `attnviz capture --layers`)"
                 if few and not residual else "")
        raise CaptureTooLarge(
            f"{what.capitalize()} needs the full maps of every layer: ~{devices.mb(full)} for {n_tokens} tokens, more "
            f"than the {devices.mb(limit)} allowed per capture. What would fit: a text of at most ~{fit} tokens{fewer}, "
            f"or the plain attention weights (statistics and pooled maps, any length). One layer alone would take "
            f"~{devices.mb(one)}.")
    # the statistics the caller chose, if it chose some: every statistic only when it asked for full maps
    long = replace(keep, statistics=keep.statistics or True, pool=POOL, hidden_states=False)
    stats = long.host_bytes(loaded, n_tokens)
    if stats > left:
        fit = devices.largest(n_tokens, lambda n: long.host_bytes(loaded, n) <= left, step=256)
        raise CaptureTooLarge(
            f"This capture would take ~{devices.mb(stats)} even as statistics only, more than the {devices.mb(left)} "
            f"left for captures. What would fit: a text of at most ~{fit} tokens.")
    # layer inputs to resume a region's forward from (regions.of_capture): they only speed regions up
    long = replace(long, checkpoints=checkpoint_count(loaded, n_tokens, min(checkpoint_bytes, left - stats)))
    return Plan(long, long.host_bytes(loaded, n_tokens),
                route_notes(None if long.statistics is True else long.statistics), n_tokens)


def for_text(loaded: LoadedModel, text: str, recipe, per_capture: int, left: int, keep: Keep = Keep(),
             checkpoint_bytes: int = CHECKPOINT_BYTES, max_tokens: int | None = None) -> Plan:
    """:func:`plan` of a capture of ``text`` under ``recipe`` (a :class:`~attnviz.recipe.Recipe`: its BOS control
    counts tokens, its residual variant needs full maps): the text is tokenized here, once for the plan and the
    capture that follows (:func:`attnviz.tokens.tokenize` remembers it). Refusals of the text (empty, too long)
    are :class:`~attnviz.errors.InputError` too."""
    n_tokens = len(tokenize(loaded, text, max_tokens, recipe.prepend)[0])
    return plan(loaded, n_tokens, per_capture, left, keep, recipe.residual, checkpoint_bytes)


def route_notes(statistics=None) -> tuple[str, ...]:
    """What a statistics capture's route will be, where it matters: statistics finished from sums the fused
    kernel does not compute take the block engine on every device (slower on a GPU, never a statistic left
    at zero)."""
    from attnviz.core import kernels
    from attnviz.stats.metrics import RowSum
    from attnviz.core.reduce import Summaries

    reducer = Summaries(["."], statistics=statistics)
    missing = reducer.missing_sums(kernels.SUMS)
    if not missing:
        return ()
    names = sorted(s.name for s in reducer.statistics
                   if any((x.name if isinstance(x, RowSum) else x) in missing for x in s.sums))
    return (f"{', '.join(names)} need{'s' if len(names) == 1 else ''} {', '.join(missing)}, which the fused kernel "
            "does not compute: statistics captures take the block engine",)
