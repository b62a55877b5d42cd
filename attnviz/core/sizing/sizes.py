"""The sizes a run works to (:class:`Sizes`): a query block's bytes on each device, the size above which an
allow-set is made a block of rows at a time, and which layers' full maps are staged on a device. The engine reads
them and computes none of its own; the plan decides them (:meth:`attnviz.plan.Keep.sizes`) and sizes a capture
with the same rules (:mod:`attnviz.plan`), from what it reads here once: the model's :class:`Shape` and what a
recipe's masks make a capture hold (:class:`Masks`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnviz import settings
from attnviz.core.model import anatomy, devices
from attnviz.core.spec.interventions import Intervention
from attnviz.errors import InputError

STAGE_SHARE = 4  # a layer's full maps are gathered on an accelerator that has this many times their size free


def whole_allow_bytes() -> int:
    """Allow-sets up to this size are made whole, once per mask, and shared by every layer with that mask (at
    8,192 tokens, 64 MB: making each block's rows for every layer instead cost 10 % of a statistics capture on the
    CPU); larger ones (1 GB at 32,768 tokens) are made a block of rows at a time where the route allows.
    The settings' ``whole_allow_mb`` (``ATTNVIZ_WHOLE_ALLOW_MB``, default 256), read when a run is made."""
    return settings.active().whole_allow_mb * 2**20


@dataclass(frozen=True)
class Sizes:
    """The sizes a run works to, decided by the plan; the engine reads them (``run.sizes``) and computes none.

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
    def of(cls, keep) -> "Sizes":
        """The sizes a run of ``keep`` (an :class:`attnviz.plan.Keep`) works to: its own block size where given, each
        device's otherwise, a quarter of it for statistics that also pool value-weighted maps or scores."""
        return cls(keep.block_bytes, quarter=bool(keep.statistics and (keep.value_norms or keep.scores)))

    @classmethod
    def given(cls, block: int | None = None, whole_allow: int | None = None) -> "Sizes":
        """The defaults, with a caller's own block size and whole-allow size where given."""
        return cls(block) if whole_allow is None else cls(block, whole_allow=whole_allow)

    def block_bytes(self, device) -> int:
        """The block size on ``device`` (:meth:`block_of` the device's own, :func:`devices.block_bytes`)."""
        return self.block_of(devices.block_bytes(device) if self.block is None else self.block)

    def block_of(self, whole: int) -> int:
        """The block size on a device whose own is ``whole``: this run's own where given, a quarter where asked."""
        if self.block is not None:
            return self.block
        return whole // 4 if self.quarter else whole

    @staticmethod
    def stages(nbytes: int, device) -> bool:
        """Full maps of ``nbytes`` are gathered on ``device`` when it is an accelerator with :meth:`room` for them; on
        the CPU the blocks are written straight into the host array."""
        device = torch.device(device)
        return device.type != "cpu" and Sizes.room(nbytes, devices.free_bytes(device))

    @staticmethod
    def room(nbytes: int, free: int | None) -> bool:
        """``free`` bytes hold :data:`STAGE_SHARE` times ``nbytes`` (None: free memory unknown, no room)."""
        return free is not None and nbytes <= free // STAGE_SHARE


@dataclass(frozen=True)
class Shape:
    """What the plan reads of a loaded model, read once (:meth:`of`): its sizes, its dtype, its device and the
    memory free there, the device's query block, whether a forward can resume from a layer's input, and each
    layer's own sliding window. Every estimate of :mod:`attnviz.plan` is arithmetic on these numbers, so a plan
    depends on nothing read again while it is made (and a test can size a model it never loads)."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden: int
    head_dim: int
    inner: int  # the MLP's intermediate size
    vocab: int
    dtype: torch.dtype  # the model's
    device: str
    free: int | None  # bytes free on the device when read (:func:`devices.free_bytes`); None: no limit known
    block: int  # the device's own query block (:func:`devices.block_bytes`)
    resumable: bool  # a forward can resume from a layer's input (:func:`anatomy.decoder_layers`)
    windows: tuple = ()  # each layer's own sliding window (None: none)

    @classmethod
    def of(cls, loaded) -> "Shape":
        """The shape of ``loaded`` (a :class:`~attnviz.core.loading.models.LoadedModel`; a shape is its own)."""
        if isinstance(loaded, Shape):
            return loaded
        cfg, device = loaded.config, loaded.model.device
        hidden = int(getattr(cfg, "hidden_size", 0) or 0)
        return cls(
            n_layers=loaded.n_layers, n_heads=loaded.n_heads, n_kv_heads=loaded.n_kv_heads, hidden=hidden,
            head_dim=int(getattr(cfg, "head_dim", 0) or hidden // max(loaded.n_heads, 1)),
            inner=int(getattr(cfg, "intermediate_size", 0) or 4 * hidden), vocab=int(cfg.vocab_size),
            dtype=loaded.model.dtype, device=str(device), free=devices.free_bytes(device),
            block=devices.block_bytes(device), resumable=anatomy.decoder_layers(loaded.model) is not None,
            windows=tuple(_windows(loaded)))

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def on_cpu(self) -> bool:
        return torch.device(self.device).type == "cpu"


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
    def of(cls, shape: Shape, built) -> "Masks":
        """The masks of ``built`` (a recipe made real, :func:`attnviz.recipe.build`) on a model of ``shape``
        (:func:`attnviz.plan.masks_of` takes a recipe not yet made real)."""
        windows = shape.windows
        keys = tuple((mask, windows[i]) for i, mask in enumerate(built.architecture.layers))
        own = tuple(None if built.interventions.masks_heads(i) else key for i, key in enumerate(keys))
        causal = all(mask.causal_compatible and mask.stable is None for mask in built.architecture.layers)
        beside = [0.0] + [2.0 if mask.horizon is None else 1.0 for mask in built.architecture.layers if mask.stable]
        for act in built.interventions.items:
            hooks = type(act)  # the hooks its class overrides
            logits = hooks.scores is not Intervention.scores or hooks.extra_logit is not Intervention.extra_logit
            beside.append(1.0 if logits else 2.0 if hooks.probabilities is not Intervention.probabilities else 0.0)
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


def _windows(loaded) -> list:
    """The model's own sliding window of every layer (None: none), from its anatomy; none where it has none."""
    try:
        return [layer.window for layer in anatomy.of(loaded.model).layers]
    except InputError:
        return [None] * loaded.n_layers
