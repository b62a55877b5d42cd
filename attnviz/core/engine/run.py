"""The run of one forward and what it keeps: what the caller asked (masks, interventions, what to record), what the
pass caches (allow-sets, devices) and what it recorded; :func:`attnviz.core.engine.forward.forward` runs a model under them.

The per-call state lives in a ``ContextVar``, never on the model or in a global, so threads or Streamlit sessions
sharing one loaded model never see each other's masks or maps (:func:`active`). Outside a run the model behaves
exactly as stock (:mod:`attnviz.core.engine.attention`).
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from attnviz.core.record import recorders as recorders_mod
from attnviz.core.spec.allowsets import AllowSet, AllowSets
from attnviz.core.spec.interventions import NONE, Interventions
from attnviz.core.spec.masks import Mask
from attnviz.core.sizing.sizes import Sizes
from attnviz.core.engine import sites
from attnviz.errors import ModelLoadError

_RUN: contextvars.ContextVar["Run | None"] = contextvars.ContextVar("attnviz_run", default=None)


def current() -> "Run | Stacks | None":
    """This thread's active run (:func:`active`), or None outside one: what the attention function and the
    engine's functions at the sites read."""
    return _RUN.get()


@dataclass(frozen=True)
class Computes:
    """What a forward computes, the engine's half of a recipe (:class:`attnviz.recipe.Built` makes one): one
    mask per layer and the interventions (docs/methods.md#interventions). A plain list of masks stands for
    ``Computes(masks)`` wherever the engine takes one."""

    masks: tuple[Mask, ...]
    interventions: Interventions = NONE
    # the attention kind (attnviz.core.spec.kinds, docs/methods.md#attention-kinds); None: the model's own
    kind: object = None

    @classmethod
    def of(cls, value) -> "Computes":
        return value if isinstance(value, Computes) else cls(tuple(value))


@dataclass(frozen=True)
class Record:
    """What a forward records of its recorded layers, and how: the engine's side of a capture's
    :class:`attnviz.plan.Keep` (``Keep.record`` makes one).

    ``layers``: the recorded layers (None: all). ``reducer``: with ``add``/``finish`` (:mod:`attnviz.core.record.reduce`)
    it is fed block by block and no layer's full map ever exists; a plain ``reducer(layer, probs, allow)`` runs on
    each recorded layer's fp32 probabilities and only its result is kept; None keeps full maps in
    ``storage_dtype``. ``scores`` / ``value_norms`` / ``qkv`` also keep, for recorded layers, the pre-softmax
    scores, the value-output norms and the queries, keys and values (only when asked: they cost memory the
    default capture does not pay). ``sizes``: the plan's sizes of the run (:class:`attnviz.core.sizing.sizes.Sizes`: the block
    size on each device, the whole-allow size, which full maps are staged on a device), which the engine reads and
    never computes; None: the plan's defaults, with ``block_bytes`` (one query block's fp32 scores on every device)
    and ``whole_allow_bytes`` where given. ``checkpoints``: the layers whose inputs are kept on the host to resume
    a later forward from (:func:`resume`). ``on_layer(i)`` is called after each layer's attention (progress;
    it may stop the forward by raising). ``keep_graph`` keeps every layer's fp32 probabilities with their
    autograd graph (residual variants). ``recorders``: the recorders themselves, as a capture's ``Keep`` makes
    them (:meth:`attnviz.plan.Keep.recorders`); then ``reducer``, ``storage_dtype``, ``scores``, ``value_norms``
    and ``qkv`` are not read (they are the short form for a caller without a keep)."""

    layers: frozenset[int] | None = None
    storage_dtype: torch.dtype = torch.float16
    reducer: object = None
    on_layer: Callable[[int], None] | None = None
    scores: bool = False
    value_norms: bool = False
    qkv: bool = False
    block_bytes: int | None = None
    checkpoints: frozenset[int] = frozenset()
    keep_graph: bool = False
    recorders: tuple | None = None
    whole_allow_bytes: int | None = None  # allow-sets above it are made a block of rows at a time
    sizes: object = None  # attnviz.core.sizing.sizes.Sizes, as a keep's plan makes them

    @classmethod
    def nothing(cls, **given) -> "Record":
        """Record no layer: the forward's output only (``given``: other fields, ``on_layer`` or ``checkpoints``)."""
        return cls(layers=frozenset(), **given)

    @classmethod
    def every_layer(cls, **given) -> "Record":
        """Record every layer (``given``: other fields, ``recorders`` or ``checkpoints``)."""
        return cls(layers=None, **given)


NOTHING = Record.nothing()  # record no layer: the forward's output only


@dataclass(frozen=True)
class Feed:
    """What a forward is fed besides its tokens, and what it gives back besides the run.

    ``attention_mask`` (B, n): padding of a batch. With ``past_key_values`` (a transformers ``Cache``) the
    inputs are new tokens appended to that cache, and ``kv_positions`` (B, n_cached + n_new) gives the position
    every cache entry was encoded at, the new tokens' last: masks then follow positions, not cache slots, so a
    cache that dropped entries (StreamingLLM) keeps every mask exact. ``lm_head=False`` runs only the base
    model (``last_hidden_state``, after the final norm). ``last_logits_only`` projects only the last position
    onto the vocabulary (``logits_to_keep=1``: 800 MB less at 4,096 tokens on a 49k vocabulary).
    ``hidden_states`` returns every layer's hidden states; ``grad`` keeps the autograd graph (fine-tuning)."""

    attention_mask: torch.Tensor | None = None
    past_key_values: object = None
    kv_positions: torch.Tensor | None = None
    lm_head: bool = True
    hidden_states: bool = False
    last_logits_only: bool = False
    grad: bool = False


@dataclass
class Asked:
    """What the caller of a forward asked for: masks, what to record, and how."""

    masks: list[Mask]
    record: frozenset[int]
    positions: torch.Tensor  # (B, n_kv) long, counted from each row's first real token: padding never shifts a mask
    valid: torch.Tensor  # (B, n_kv) bool: real (non-padding) keys
    # what every recorded layer keeps (attnviz.core.record.recorders): fed by the engine, which never knows which
    recorders: tuple[recorders_mod.Recorder, ...] = ()
    on_layer: Callable[[int], None] | None = None  # progress: called after each layer's attention
    keep_graph: bool = False  # keep every layer's fp32 probabilities, autograd graph and all (residual variants)
    q_positions: torch.Tensor | None = None  # (B, n_q): query positions when queries are not the keys (cross-attention)
    interventions: Interventions = NONE  # docs/methods.md#interventions: applied here, never by patching the model
    kind: object = None  # the attention kind (attnviz.core.spec.kinds.Kind); None: each layer's own
    # per layer, ``mask(n_q, n_kv, device)`` → an (H, n_q, n_kv) allow-set per head, and-ed with the layer's mask:
    # a compressed KV cache (docs/methods.md#kv-cache-compression), or streaming heads on sink + window
    head_masks: dict[int, Callable[[int, int, torch.device], torch.Tensor]] = field(default_factory=dict)
    sizes: object = None  # the plan's (attnviz.core.sizing.sizes.Sizes): block bytes per device, whole-allow size, staging
    unpadded: bool | None = None  # every key real; None: read from ``valid`` (a host read: the caller may know)
    # layers whose input hidden states (n, d) are kept on the host, to resume a later forward from
    # (:func:`attnviz.core.engine.forward.resume`: a long capture's regions); filled by a pre-hook on the decoder layers
    checkpoint_layers: frozenset[int] = frozenset()


@dataclass
class Cached:
    """What the pass computes once and shares between layers: allow-sets, block ranges, device copies."""

    _allow_cache: dict = field(default_factory=dict)
    _device_cache: dict = field(default_factory=dict)
    windows: dict = field(default_factory=dict)  # layer -> the model's own sliding window there (None: none)
    # layer -> the model's own window from its anatomy, for a sink key read before the layer's attention has run
    # (an embedding patch): asked only then, so a run on a model the anatomy does not map costs nothing
    model_window: Callable[[int], int | None] | None = None


@dataclass
class Recorded:
    """What the pass records, by layer, beside what its recorders own (:meth:`Run.results`)."""

    allowed: dict[int, AllowSet] = field(default_factory=dict)
    checkpoints: dict[int, torch.Tensor] = field(default_factory=dict)
    # where the fused route failed in this run: (device, dtype, query shape, key shape) -> the reason; those layers
    # take the block engine, in this run only (attnviz.core.kernel.kernels.failure)
    fused_failed: dict[tuple, str] = field(default_factory=dict)

    def host_allowed(self, layers) -> dict:
        """The (n_q, n_kv) allow-set of each of ``layers`` on the host, the cells some head may see
        (:meth:`AllowSet.host`): one copy from the device per mask, not per layer (1 GB each at 32k tokens), shared
        by the layers with that mask; one never made whole (plain causal, or a block of rows at a time) is made
        on the host."""
        return {layer: self.allowed[layer].host() for layer in layers}

    def head_allowed(self, layers) -> dict:
        """The (H, n_q, n_kv) allow-set of each of ``layers`` whose heads have masks of their own (a headwindow
        intervention, a compressed cache) on the host: what each head may see. Other layers are not here."""
        return {layer: self.allowed[layer].head_host() for layer in layers if self.allowed[layer].per_head}


@dataclass
class Run(Recorded, Cached, AllowSets, Asked):
    """Per-forward state, in three parts: what the caller :class:`Asked`, what the pass :class:`Cached`,
    and what it :class:`Recorded`. Active for one forward through :func:`active`."""

    def __post_init__(self):
        if self.unpadded is None:
            self.unpadded = bool(self.valid.all())
        if self.sizes is None:
            self.sizes = Sizes()  # the plan's defaults
        self._live = recorders_mod.Live()  # the run's own: it holds this run's live probabilities

    def release(self) -> None:
        """Let go of what the pass made and shared (its allow-sets, an n × n bool a batch row each at a long text):
        each refers to the run, so without this they live until the collector finds the cycle, and a loop of
        batched forwards would hold every batch's."""
        self._allow_cache.clear()
        self._device_cache.clear()
        self.allowed.clear()

    def collect(self) -> None:
        """After the forward: wait for the asynchronous host copies of full maps and of every layer's finished
        statistics (:class:`devices.HostCopy`), and keep the host arrays. Nothing during the forward waits."""
        for recorder in self._every_recorder():
            recorder.result()

    def _every_recorder(self) -> tuple:
        return self.recorders + ((self._live,) if self.keep_graph else ())

    def results(self, holds: str) -> dict:
        """What the recorders that hold ``holds`` hold, by layer (the recorders own it; the run keeps no store of its
        own). One recorder's own dict where it alone holds that, so the residual variants may take from ``live``."""
        owners = [r for r in self._every_recorder() if r.holds == holds]
        if len(owners) == 1:
            return owners[0].results
        merged: dict = {}
        for recorder in owners:
            merged.update(recorder.results)
        return merged

    probs = property(lambda self: self.results("probs"), doc="Full maps by layer (B, H, n_q, n_kv).")
    scores = property(lambda self: self.results("scores"), doc="Pre-softmax scores by layer.")
    reduced = property(lambda self: self.results("reduced"), doc="A reducer's finished results by layer.")
    value_norms = property(lambda self: self.results("value_norms"), doc="||W_O^h v_j^h|| by layer.")
    qkv = property(lambda self: self.results("qkv"), doc="(q, k, v, scaling) on the host by layer.")
    live = property(lambda self: self.results("live"), doc="keep_graph: every layer's fp32 probabilities.")

    def recorders_at(self, layer: int) -> tuple:
        """The recorders fed by ``layer``: the run's own for a recorded layer, and the live probabilities of every
        layer when the graph is kept (residual variants)."""
        kept = self.recorders if layer in self.record else ()
        return kept + (self._live,) if self.keep_graph else kept

    def route(self, module) -> tuple["Run", int]:
        """The run and layer index an attention module belongs to (see :class:`Stacks`)."""
        return self, module.layer_idx

    def finish(self, layer: int, out: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Apply the layer's output interventions (ablation), report progress and return the attention
        output in the layout the models expect."""
        for intervention in self.interventions.at(layer):
            out = intervention.output(out)
        if self.on_layer:
            self.on_layer(layer)
        return out.transpose(1, 2).contiguous(), None


@dataclass
class Stacks:
    """The runs of an encoder-decoder forward: one per attention stack ("encoder", "decoder",
    "cross"), each attention module routed to its run and layer by identity, since T5 and BART
    number the layers of every stack from 0."""

    runs: dict[str, Run]
    routes: dict[int, tuple[str, int]]  # id(module) -> (stack, layer)

    def route(self, module) -> tuple[Run, int]:
        try:
            stack, layer = self.routes[id(module)]
        except KeyError:
            raise ModelLoadError(f"{type(module).__name__} is an attention module attnviz did not find when it "
                                 "mapped this model's encoder and decoder") from None
        return self.runs[stack], layer


def n_layers(model) -> int:
    return int(model.config.get_text_config().num_hidden_layers)


@contextmanager
def active(run: Run):
    """Make ``run`` the attnviz run of this thread/context while the block runs."""
    token = _RUN.set(run)
    try:
        with sites.unmasked():  # another thread's hooks changing during torch's clean-up: the error itself
            yield run
    finally:
        _RUN.reset(token)
        for each in getattr(run, "runs", {"": run}).values():
            each.collect()
