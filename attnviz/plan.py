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

Every size a run works to is decided here, and the engine reads it (:class:`Sizes`): a query block's bytes on
each device, the size above which an allow-set is made a block of rows at a time, and which layers' full maps
are staged on a device. What a recipe's masks make a capture hold is read from the recipe (:class:`Masks`).
``tests/test_sizing.py`` captures with every allocation tracked and holds the estimates to what runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch

from attnviz.core import devices, engine, syntax
from attnviz.core.interventions import Intervention
from attnviz.core.models import LoadedModel
from attnviz.core.pooled import pool_factor
from attnviz.errors import InputError
from attnviz.stats import metrics
from attnviz.tokens import tokenize

POOL = 512  # cells a side of a long capture's pooled maps: what a heatmap image shows anyway
POOLED_EXTRAS = frozenset({"value_norms", "scores"})  # views a long capture serves as pooled maps too
CHECKPOINT_BYTES = 512 * 2**20  # layer inputs a long capture keeps at most (ATTNVIZ_CHECKPOINT_MB in the app)
EXTRAS = ("scores", "value_norms", "activations", "qkv", "hidden_states")
STAGE_SHARE = 4  # a layer's full maps are gathered on an accelerator that has this many times their size free


def whole_allow_bytes() -> int:
    """Allow-sets up to this size are made whole, once per mask, and shared by every layer with that mask (at
    8,192 tokens, 64 MB: making each block's rows for every layer instead cost 10 % of a statistics capture on the
    CPU); larger ones (1 GB at 32,768 tokens) are made a block of rows at a time where the route allows.
    ``ATTNVIZ_WHOLE_ALLOW_MB`` (default 256), read when a run is made."""
    return int(os.environ.get("ATTNVIZ_WHOLE_ALLOW_MB", "256")) * 2**20


@dataclass(frozen=True)
class Sizes:
    """The sizes a run works to, decided here; the engine reads them (``run.sizes``) and computes none of its own.

    - :meth:`block_bytes`: the fp32 scores of one query block of a recorded layer on a device: ``block`` when given,
      else the device's (:func:`devices.block_bytes`: 16 MB on the CPU, a share of free memory on a GPU), a quarter
      of it where ``quarter`` (statistics that also pool value-weighted maps or scores: each block then makes
      padded copies of itself to pool, and a quarter keeps that working set down: 8,177 tokens on the CPU, peak
      1.9 GB above the model with 64 MB blocks, 1.4 GB with 16 MB, and no slower; 4 MB as fast as 16 MB);
    - ``whole_allow``: allow-sets above it are made a block of rows at a time (:func:`whole_allow_bytes`);
    - :meth:`stages`: whether a layer's full maps are gathered on the device before their one copy to the host."""

    block: int | None = None
    quarter: bool = False
    whole_allow: int = field(default_factory=whole_allow_bytes)

    @classmethod
    def given(cls, block: int | None = None, whole_allow: int | None = None) -> "Sizes":
        """The defaults, with a caller's own block size and whole-allow size where given."""
        return cls(block) if whole_allow is None else cls(block, whole_allow=whole_allow)

    def block_bytes(self, device) -> int:
        if self.block is not None:
            return self.block
        whole = devices.block_bytes(device)
        return whole // 4 if self.quarter else whole

    @staticmethod
    def stages(nbytes: int, device) -> bool:
        """Full maps of ``nbytes`` are gathered on ``device`` when it is an accelerator whose free memory holds
        :data:`STAGE_SHARE` times as much; on the CPU the blocks are written straight into the host array."""
        device = torch.device(device)
        free = None if device.type == "cpu" else devices.free_bytes(device)
        return free is not None and nbytes <= free // STAGE_SHARE


@dataclass(frozen=True)
class Masks:
    """What a recipe's masks make a capture hold, read from the recipe (:meth:`of`) before anything runs.

    ``layers``: per layer, the allow-set it shares with every layer of the same mask and model window (a
    hashable key), or None where its heads have masks of their own (a ``headwindow`` intervention: such a layer
    keeps each head's (H, n, n) allow-set and the (n, n) cells some head may see, its own, not shared).
    ``device``: the allow-sets made on the device, one n × n bool each. ``causal``: no layer's query sees a later
    key (and none has StableMask's pseudo-slots), so a block of query rows computes only the keys up to its last
    row. ``softmax``: fp32 copies of a block made beside its scores while the softmax is computed: StableMask's
    pseudo-slots (two), logits added to the softmax (SM-I, ``sinklogit``) or scores an intervention changes
    (``temperature``) (one), probabilities an intervention changes (``sinkscale``, two). The defaults stand for a
    recipe not known: up to four shared allow-sets among the recorded layers, none per head, two on the device,
    every key in every block, nothing beside the scores."""

    layers: tuple = ()
    device: int = 2
    causal: bool = False
    softmax: float = 0.0

    @classmethod
    def of(cls, loaded: LoadedModel, recipe) -> "Masks":
        """The masks of ``recipe`` (a :class:`~attnviz.recipe.Recipe`, an architecture string, or a built recipe)
        on ``loaded``."""
        from attnviz import recipe as recipe_mod

        built = recipe if isinstance(recipe, recipe_mod.Built) else recipe_mod.build(loaded, recipe)
        windows = _windows(loaded)
        keys = tuple((mask, windows[i]) for i, mask in enumerate(built.architecture.layers))
        own = tuple(None if built.interventions.masks_heads(i) else key for i, key in enumerate(keys))
        causal = all(mask.causal_compatible and mask.stable is None for mask in built.architecture.layers)
        beside = [0.0] + [2.0 if mask.horizon is None else 1.0 for mask in built.architecture.layers if mask.stable]
        for act in built.interventions.items:
            kind = type(act)
            logits = kind.scores is not Intervention.scores or kind.extra_logit is not Intervention.extra_logit
            beside.append(1.0 if logits else 2.0 if kind.probabilities is not Intervention.probabilities else 0.0)
        return cls(own, len(set(keys)), causal, max(beside))

    def host_bytes(self, recorded: list[int], n: int, heads: int) -> int:
        """The recorded layers' allow-sets on the host: one n × n per shared allow-set, and (H + 1) n × n per layer
        whose heads have masks of their own."""
        if not self.layers:
            return min(len(recorded), 4) * n * n
        own = [self.layers[layer] for layer in recorded]
        return (len(set(own) - {None}) + own.count(None) * (heads + 1)) * n * n

    def per_head(self, recorded: list[int]) -> bool:
        return bool(self.layers) and any(self.layers[layer] is None for layer in recorded)

    def largest_block(self, n: int, rows: int, every_key: bool = False) -> int:
        """Cells of the largest block of ``rows`` query rows over n keys: every key (``every_key``: a recorder keeps
        them all), or under causal masks only the keys up to its last row (the last block, or the one before it)."""
        if every_key or not self.causal or rows >= n:
            return min(rows, n) * n
        last = n - (-(-n // rows) - 1) * rows  # rows of the last block
        return max(last * n, rows * (n - last))


def _windows(loaded: LoadedModel) -> list:
    """The model's own sliding window of every layer (None: none), from its anatomy; none where it has none."""
    from attnviz.core import anatomy

    try:
        return [layer.window for layer in anatomy.of(loaded.model).layers]
    except InputError:
        return [None] * loaded.n_layers


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

    def host_bytes(self, loaded: LoadedModel, n_tokens: int, masks: Masks | None = None) -> int:
        """What the capture will hold (as :func:`attnviz.core.lru.nbytes` counts it), before it runs.

        Full maps: storage-dtype (H, n, n) per recorded layer; statistics: :func:`metrics.statistic_floats` per
        head and token per layer, plus the fp16 pooled maps (and pooled value-weighted maps and scores when
        ``value_norms`` / ``scores`` ask for them) at the side :func:`pool_factor` gives; the recorded layers'
        allow-sets as the recipe's ``masks`` make them (:meth:`Masks.host_bytes`); the extras; the checkpoints."""
        n, heads = int(n_tokens), loaded.n_heads
        recorded = self.recorded(loaded.n_layers)
        if self.statistics:
            pooled_maps = 1 + self.value_norms + self.scores  # weights, and value-weighted maps / scores when asked
            per_layer = heads * n * 4 * self._floats() + heads * pooled_side(n, self.pool) ** 2 * 2 * pooled_maps
        else:
            per_layer = heads * n * n * self.storage_dtype.itemsize * (1 + self.scores)
        per_layer += heads * n * 4 if self.value_norms else 0
        per_layer += (heads + 2 * loaded.n_kv_heads) * n * _head_dim(loaded) * 4 if self.qkv else 0  # fp32 q, k, v
        boundaries = loaded.n_layers + 1  # the embeddings and every layer's output
        hidden = boundaries * n * _hidden_size(loaded) * 2 if self.hidden_states else 0
        activations = boundaries * (n + 40) * 4 if self.activations else 0  # norms, and a few top values each
        kept = len(checkpoint_layers(loaded, self.checkpoints)) * checkpoint_bytes(loaded, n)
        allow = (Masks() if masks is None else masks).host_bytes(recorded, n, heads)
        return len(recorded) * per_layer + allow + hidden + activations + kept + 4 * loaded.config.vocab_size

    def device_bytes(self, loaded: LoadedModel, n_tokens: int, masks: Masks | None = None) -> int:
        """What the capture needs on the model's device beyond the weights, before it runs (on the block route:
        the fused one needs less): the layer in flight, in the model's dtype, which holds the embeddings, its input
        and its normed input, then the larger of

        - its attention: queries, keys, values, the output gathered block by block, one query block's working set
          (:meth:`block_copies` fp32 copies of a block of :func:`block_bytes`), the layer's statistics and pooled
          maps while they are made (fp32; finished layers go to the host), its full maps where they are staged on
          the device (:meth:`Sizes.stages`);
        - its MLP: three n × intermediate activations, beside the sum after attention;

        and, for the whole forward: the allow-sets, one n × n bool each (``masks.device``), or a block's rows of
        each where a statistics capture makes them a block of rows at a time (above the whole-allow size); every
        recorded layer's value norms; every layer's hidden states when asked, and after the forward what is made of
        them (their stack, the activations' fp32 copies) where that is more; the last position's logits.
        Full maps go to the host as they are made, so they count against host memory (:meth:`host_bytes`), not
        here; on the CPU the two are one memory, and a capture's peak there is at most their sum."""
        n, cfg, heads = int(n_tokens), loaded.config, loaded.n_heads
        masks, sizes, device = Masks() if masks is None else masks, self.sizes(), loaded.model.device
        rows = min(n, max(1, sizes.block_bytes(device) // (4 * heads * n)))
        recorded = self.recorded(loaded.n_layers)
        itemsize = next(loaded.model.parameters()).element_size()
        hidden, dim = _hidden_size(loaded), _head_dim(loaded)
        inner = int(getattr(cfg, "intermediate_size", 0) or 4 * hidden)
        cells = masks.largest_block(n, rows, every_key=self.full_maps and self.scores)
        block = 4 * heads * cells * self.block_copies(loaded, masks, recorded)
        made = 0
        if self.statistics:
            made = heads * n * 4 * self._floats() + heads * pooled_side(n, self.pool) ** 2 * 4 * (
                1 + self.value_norms + self.scores)
        maps = heads * n * n * self.storage_dtype.itemsize * (1 + self.scores) if self.full_maps else 0
        staged = maps if maps and sizes.stages(maps, device) else 0
        attention = n * (2 * heads + 2 * loaded.n_kv_heads) * dim * itemsize + int(block) + made + staged
        layer = 3 * n * hidden * itemsize + max(attention, n * (hidden + 3 * inner) * itemsize)
        cells = (loaded.n_layers + 1) * n * hidden  # every layer's hidden states, the embeddings first
        states = cells * itemsize if self.hidden_states or self.activations else 0
        # after the forward, beside them: their stack (and its fp16 copy on an accelerator), two fp32 copies
        # for the activations' norms and top values
        half = 0 if device.type == "cpu" or next(loaded.model.parameters()).dtype == torch.float16 else cells * 2
        after = states + max(states + half if self.hidden_states else 0, 2 * cells * 4 if self.activations else 0)
        norms = len(recorded) * heads * n * 4 if self.value_norms else 0
        # an allow-set above the whole-allow size is made a block of rows at a time on the statistics route
        # (an AllowSet of kind "rows"): only a block's rows are ever on the device, not n × n
        rowwise = self.statistics and n * n > sizes.whole_allow and not masks.per_head(recorded)
        allow = masks.device * (rows if rowwise else n) * n
        return max(layer + states, after) + norms + allow + 4 * cfg.vocab_size

    def block_copies(self, loaded: LoadedModel, masks: Masks | None = None, recorded=()) -> float:
        """fp32 copies of one query block alive at once on the block route, the most of three moments:

        - the softmax being made: the scores (it runs in place) and what the recipe makes beside them
          (``masks.softmax``); in a half-precision model, the matmul's own scores beside their fp32 copy;
        - the recorders: the probabilities and the largest of what a recorder makes of them: a pooled map's padded
          copy, the value-weighted block and its padded copy, the masked scores and their padded copy, a
          statistic's own row sum, the entropy's temporary (one head's rows at a time);
        - in a half-precision model, the probabilities cast for P·V (half a copy).

        Where the ``recorded`` layers' heads have masks of their own, the block's per-head allow-set (bools: a
        quarter of a copy) is there throughout, and its complement while the scores are masked."""
        masks = Masks() if masks is None else masks
        itemsize = next(loaded.model.parameters()).element_size()
        half = itemsize / 4 if itemsize < 4 else 0.0
        temps = [half]
        if self.statistics:
            needed = metrics.needed_sums(metrics.kept_statistics(None if self.statistics is True else self.statistics))
            temps.append(1 / loaded.n_heads if "plogp" in needed else 0.0)
            temps.append(float(any(isinstance(x, metrics.RowSum) for x in needed)))
            temps += [float(bool(self.pool)), 2.0 * bool(self.pool and self.value_norms), 2.0 * bool(self.scores)]
        allow = 0.25 if masks.per_head(recorded) else 0.0
        return allow + 1 + max(max(masks.softmax, half) + allow, max(temps))

    def sizes(self) -> Sizes:
        """The sizes a run of this keep works to: its own block size where given, each device's otherwise, a
        quarter of it for statistics that also pool value-weighted maps or scores."""
        return Sizes(self.block_bytes, quarter=bool(self.statistics and (self.value_norms or self.scores)))

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

    def record(self, loaded: LoadedModel, tokens: list[str], on_layer=None, kept=None,
               masks: Masks | None = None) -> engine.Record:
        """What the engine records for this keep on ``loaded`` over ``tokens``: its recorders (:meth:`recorders`),
        the recorded layers, the sizes (:meth:`sizes`) and checkpoints; ``kept`` overrides the checkpointed layers
        (none under a residual variant). Refused first, before anything runs, where the device cannot hold it
        (:func:`check_device`, under the recipe's ``masks``) or where value norms are asked of a model whose output
        projection cannot be read."""
        layers = self.recorded(loaded.n_layers)
        check_device(loaded, len(tokens), self, f"a capture of {len(layers)} layers", masks)
        if self.value_norms:
            for module in engine.attention_modules(loaded.model)[:1]:
                engine.output_projection(module)
        return engine.Record(
            layers=frozenset(layers), recorders=self.recorders(tokens), on_layer=on_layer, sizes=self.sizes(),
            checkpoints=checkpoint_layers(loaded, self.checkpoints) if kept is None else frozenset(kept))

    def describe(self) -> str:
        """A short phrase for progress labels: "full maps" or "statistics"."""
        return "full maps" if self.full_maps else "statistics"


def _hidden_size(loaded: LoadedModel) -> int:
    return int(getattr(loaded.config, "hidden_size", 0) or 0)


def _head_dim(loaded: LoadedModel) -> int:
    return int(getattr(loaded.config, "head_dim", 0) or _hidden_size(loaded) // max(loaded.n_heads, 1))


def pooled_side(n: int, pool: int | None) -> int:
    """Cells a side of the pooled maps of ``n`` tokens at most ``pool`` cells a side (0 without a pool): ceil(n / f)
    for the factor :func:`pool_factor` rounds up to, between pool / 2 and pool."""
    return -(-int(n) // pool_factor(n, pool)) if pool else 0


def block_bytes(loaded: LoadedModel, keep: Keep) -> int:
    """The fp32 scores of one query block of a recorded layer on the model's device (:meth:`Sizes.block_bytes`
    of the keep's :meth:`Keep.sizes`)."""
    return keep.sizes().block_bytes(loaded.model.device)


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


def check_device(loaded: LoadedModel, n_tokens: int, keep: Keep, what: str = "this capture",
                 masks: Masks | None = None) -> None:
    """Refuse, before running, a capture whose device working set (:meth:`Keep.device_bytes` under the recipe's
    ``masks``) exceeds the device's free memory (``torch.cuda.mem_get_info``, or ``ATTNVIZ_DEVICE_MB``), saying
    what would fit."""
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
         residual: str | None = None, checkpoint_bytes: int = CHECKPOINT_BYTES, masks: Masks | None = None) -> Plan:
    """The plan of a capture of ``n_tokens`` asked to keep ``keep`` (full maps and its extras):
    ``per_capture`` bytes is the most one capture's full maps may take, ``left`` what the memory budget has
    left for captures; a ``residual`` variant needs full maps; ``masks``: the recipe's (:meth:`Masks.of`), which
    sizes its allow-sets. Raises :class:`CaptureTooLarge` with what would fit."""
    limit = min(per_capture, left)
    full = keep.host_bytes(loaded, n_tokens, masks)
    if full <= limit:
        return Plan(keep, full, n_tokens=n_tokens)
    extras = {name for name in EXTRAS if getattr(keep, name) and name != "hidden_states"}
    if not extras <= POOLED_EXTRAS or residual:
        what = "a residual variant" if residual else "this view"
        fit = devices.largest(n_tokens, lambda n: keep.host_bytes(loaded, n, masks) <= limit)
        one = replace(keep, layers=(0,)).host_bytes(loaded, n_tokens, masks)
        few = max((k for k in range(1, loaded.n_layers + 1)
                   if replace(keep, layers=tuple(range(k))).host_bytes(loaded, n_tokens, masks) <= limit), default=0)
        fewer = (f", fewer recorded layers ({few} of {loaded.n_layers} fit at this length: `attnviz capture --layers`)"
                 if few and not residual else "")
        raise CaptureTooLarge(
            f"{what.capitalize()} needs the full maps of every layer: ~{devices.mb(full)} for {n_tokens} tokens, more "
            f"than the {devices.mb(limit)} allowed per capture. What would fit: a text of at most ~{fit} tokens{fewer}, "
            f"or the plain attention weights (statistics and pooled maps, any length). One layer alone would take "
            f"~{devices.mb(one)}.")
    # the statistics the caller chose, if it chose some: every statistic only when it asked for full maps
    long = replace(keep, statistics=keep.statistics or True, pool=POOL, hidden_states=False)
    stats = long.host_bytes(loaded, n_tokens, masks)
    if stats > left:
        fit = devices.largest(n_tokens, lambda n: long.host_bytes(loaded, n, masks) <= left, step=256)
        raise CaptureTooLarge(
            f"This capture would take ~{devices.mb(stats)} even as statistics only, more than the {devices.mb(left)} "
            f"left for captures. What would fit: a text of at most ~{fit} tokens.")
    # layer inputs to resume a region's forward from (regions.of_capture): they only speed regions up
    long = replace(long, checkpoints=checkpoint_count(loaded, n_tokens, min(checkpoint_bytes, left - stats)))
    return Plan(long, long.host_bytes(loaded, n_tokens, masks),
                route_notes(None if long.statistics is True else long.statistics), n_tokens)


def for_text(loaded: LoadedModel, text: str, recipe, per_capture: int, left: int, keep: Keep = Keep(),
             checkpoint_bytes: int = CHECKPOINT_BYTES, max_tokens: int | None = None) -> Plan:
    """:func:`plan` of a capture of ``text`` under ``recipe`` (a :class:`~attnviz.recipe.Recipe`: its BOS control
    counts tokens, its residual variant needs full maps, its masks size the allow-sets): the text is tokenized
    here, once for the plan and the capture that follows (:func:`attnviz.tokens.tokenize` remembers it). Refusals
    of the text (empty, too long) are :class:`~attnviz.errors.InputError` too."""
    n_tokens = len(tokenize(loaded, text, max_tokens, recipe.prepend)[0])
    masks = Masks.of(loaded, recipe)
    return plan(loaded, n_tokens, per_capture, left, keep, recipe.residual, checkpoint_bytes, masks)


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
