"""Run a Hugging Face decoder with one mask per layer and record what every head attends to.

One attention function and one mask builder are registered under the key ``"attnviz"`` in
transformers' ``AttentionInterface`` / ``AttentionMaskInterface``; :func:`prepare` switches a model
to it once. The per-call state (which mask each layer uses, what to record) lives in a
``ContextVar``, never on the model or in a global, so threads or Streamlit sessions sharing one
loaded model never see each other's masks or maps. Outside a :func:`run` the model behaves exactly
as stock (SDPA, or the model's own eager function where SDPA cannot express it).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import inspect
import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from attnviz.core import blocks, devices, kernels
from attnviz.core import recorders as recorders_mod
from attnviz.core.interventions import NONE, Intervention, Interventions
from attnviz.core.masks import Mask, keep_self_if_empty
from attnviz.errors import InputError, ModelLoadError
from attnviz.stats import reduce
from attnviz.stats.reduce import pool_factor

KEY = "attnviz"
# Allow-sets up to this size are made whole, once per mask, and shared by every layer with that mask (at 8,192
# tokens, 64 MB: making each block's rows for every layer instead cost 10 % of a statistics capture on the CPU);
# larger ones (1 GB at 32,768 tokens) are made a block of rows at a time (RowwiseAllow) where the route allows.
WHOLE_ALLOW_BYTES = int(os.environ.get("ATTNVIZ_WHOLE_ALLOW_MB", "256")) * 2**20
_NO_KEY_MASK = Intervention.key_mask
_RUN: contextvars.ContextVar["Run | None"] = contextvars.ContextVar("attnviz_run", default=None)
# The shared server's sessions share one loaded model: hooks are registered on it once, under this lock
_HOOKS = threading.Lock()
_CATCH: contextvars.ContextVar["dict | None"] = contextvars.ContextVar("attnviz_catch", default=None)


class Caught(Exception):
    """Raised by the attention function inside :func:`catching`, once it has recorded what it was given."""


@contextmanager
def catching():
    """Inside, the attention function records what it is called with (queries, keys, scaling, soft-cap, learned
    sink logits) into the dict it yields and raises :class:`Caught` instead of attending: how score attribution
    reads a layer's projections and rotation from the model's own attention module (attnviz.effects.schemes)."""
    caught: dict = {}
    token = _CATCH.set(caught)
    try:
        yield caught
    finally:
        _CATCH.reset(token)


@dataclass(frozen=True)
class Computes:
    """What a forward computes, the engine's half of a recipe (:class:`attnviz.recipe.Built` makes one): one
    mask per layer and the interventions (docs/methods.md#interventions). A plain list of masks stands for
    ``Computes(masks)`` wherever the engine takes one."""

    masks: tuple[Mask, ...]
    interventions: Interventions = NONE

    @classmethod
    def of(cls, value) -> "Computes":
        return value if isinstance(value, Computes) else cls(tuple(value))


@dataclass(frozen=True)
class Record:
    """What a forward records of its recorded layers, and how: the engine's side of a capture's
    :class:`attnviz.plan.Keep` (``Keep.record`` makes one).

    ``layers``: the recorded layers (None: all). ``reducer``: with ``add``/``finish`` (:mod:`attnviz.stats.reduce`)
    it is fed block by block and no layer's full map ever exists; a plain ``reducer(layer, probs, allow)`` runs on
    each recorded layer's fp32 probabilities and only its result is kept; None keeps full maps in
    ``storage_dtype``. ``scores`` / ``value_norms`` / ``qkv`` also keep, for recorded layers, the pre-softmax
    scores, the value-output norms and the queries, keys and values (only when asked: they cost memory the
    default capture does not pay). ``block_bytes`` bounds one query block's fp32 scores (None:
    :func:`devices.block_bytes`). ``checkpoints``: the layers whose inputs are kept on the host to resume a
    later forward from (:func:`resume`). ``on_layer(i)`` is called after each layer's attention (progress;
    it may stop the forward by raising). ``keep_graph`` keeps every layer's fp32 probabilities with their
    autograd graph (residual variants)."""

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


NOTHING = Record(layers=frozenset())  # record no layer: the forward's output only


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
    # what every recorded layer keeps (attnviz.core.recorders): fed by the engine, which never knows which
    recorders: tuple[recorders_mod.Recorder, ...] = ()
    on_layer: Callable[[int], None] | None = None  # progress: called after each layer's attention
    keep_graph: bool = False  # keep every layer's fp32 probabilities, autograd graph and all (residual variants)
    q_positions: torch.Tensor | None = None  # (B, n_q): query positions when queries are not the keys (cross-attention)
    interventions: Interventions = NONE  # docs/methods.md#interventions: applied here, never by patching the model
    # per layer, ``mask(n_q, n_kv, device)`` → an (H, n_q, n_kv) allow-set per head, and-ed with the layer's mask:
    # a compressed KV cache (docs/methods.md#kv-cache-compression), or streaming heads on sink + window
    head_masks: dict[int, Callable[[int, int, torch.device], torch.Tensor]] = field(default_factory=dict)
    block_bytes: int | None = None  # fp32 scores of one query block of a recorded layer; None: devices.block_bytes
    unpadded: bool | None = None  # every key real; None: read from ``valid`` (a host read: the caller may know)
    # layers whose input hidden states (n, d) are kept on the host, to resume a later forward from
    # (:func:`resume`: a long capture's regions); filled by a pre-hook on the decoder layers
    checkpoint_layers: frozenset[int] = frozenset()


@dataclass
class Cached:
    """What the pass computes once and shares between layers: allow-sets, block ranges, device copies."""

    _allow_cache: dict = field(default_factory=dict)
    _device_cache: dict = field(default_factory=dict)
    windows: dict = field(default_factory=dict)  # layer -> the model's own sliding window there (None: none)


@dataclass
class Recorded:
    """What the pass records, by layer."""

    probs: dict[int, torch.Tensor] = field(default_factory=dict)
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    value_norms: dict[int, torch.Tensor] = field(default_factory=dict)
    qkv: dict[int, tuple] = field(default_factory=dict)
    live: dict[int, torch.Tensor] = field(default_factory=dict)  # keep_graph: (B, H, n_q, n_kv) on the device
    allowed: dict[int, torch.Tensor] = field(default_factory=dict)
    reduced: dict[int, object] = field(default_factory=dict)
    checkpoints: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class Run(Recorded, Cached, Asked):
    """Per-forward state, in three parts: what the caller :class:`Asked`, what the pass :class:`Cached`,
    and what it :class:`Recorded`. Active for one forward through :func:`active`."""

    def __post_init__(self):
        if self.unpadded is None:
            self.unpadded = bool(self.valid.all())

    def allow(self, layer: int, n_q: int, n_kv: int, window: int | None, device) -> torch.Tensor:
        """(B, 1, n_q, n_kv) boolean allow-set for a layer, shared by layers with the same mask.

        The model's own sliding window (Mistral, Qwen2, Gemma2 ...) bounds causal-type layers only,
        as in the stock model (``i - j < w``); BIDIR/BACK-type layers see the whole sequence, as in
        seed 000's reference code (docs/methods.md#per-layer-architectures).
        """
        mask = self.masks[layer]
        key = (id(mask), n_q, n_kv, window, torch.device(device))  # a device map puts layers on several devices
        if key not in self._allow_cache:
            self._allow_cache[key] = self.allow_rows(layer, n_q, n_kv, window, device, 0, n_q)
        return self._allow_cache[key]

    def allow_rows(self, layer: int, n_q: int, n_kv: int, window: int | None, device, q0: int,
                   q1: int) -> torch.Tensor:
        """(B, 1, q1 - q0, n_kv): query rows q0 .. q1 - 1 of :meth:`allow`, made alone (a row's allowed keys
        depend on that row only, keep-self included)."""
        mask = self.masks[layer]
        kv_pos = self.positions[:, -n_kv:].to(device)
        q_pos = self.query_positions(n_q, device)[:, q0:q1]
        allow = mask.allow(q_pos[:, None, :, None], kv_pos[:, None, None, :])
        if window and mask.causal_type:
            allow = allow & ((q_pos[:, None, :, None] - kv_pos[:, None, None, :]) < window)
        allow = allow & self.valid[:, -n_kv:].to(device)[:, None, None, :]
        return keep_self_if_empty(allow, n_kv - n_q + q0)

    def rowwise(self, layer: int, n_q: int, n_kv: int, window: int | None, device) -> "RowwiseAllow":
        """The layer's allow-set as a :class:`RowwiseAllow` (made a block of rows at a time, never n_q × n_kv
        at once), shared by layers with the same mask like :meth:`allow`."""
        key = ("rowwise", id(self.masks[layer]), n_q, n_kv, window, torch.device(device))
        if key not in self._allow_cache:
            self._allow_cache[key] = RowwiseAllow(self, layer, n_q, n_kv, window, torch.device(device))
        return self._allow_cache[key]

    def block_rows(self, row_elements: int, device=None) -> int:
        """Query rows per block so that a block's fp32 scores stay within ``block_bytes`` (by default
        16 MB on the CPU and a share of free memory on a GPU, read once per run and device)."""
        budget = self.block_bytes
        if budget is None:
            device = torch.device(device or "cpu")
            if ("block", device) not in self._device_cache:
                self._device_cache["block", device] = devices.block_bytes(device)
            budget = self._device_cache["block", device]
        return max(1, budget // (4 * max(row_elements, 1)))

    def key_ranges(self, layer: int, allow: torch.Tensor, rows: int, narrow: bool) -> list[tuple[int, int]]:
        """[k0, k1) of every block of ``rows`` query rows: the keys its rows may see when ``narrow``,
        else all. Computed on the device and read back in one transfer, shared by layers with one
        allow-set: the block loop itself never waits for the device."""
        n_q, n_kv = allow.shape[-2], allow.shape[-1]
        if not narrow:
            return [(0, n_kv)] * -(-n_q // rows)
        key = ("ranges", id(allow), rows, layer if self.has_head_mask(layer) else None)  # head masks: per layer
        if key not in self._allow_cache:
            self._allow_cache[key] = [tuple(r) for r in _block_ranges(allow, rows).tolist()]
        return self._allow_cache[key]

    def key_range_tensor(self, allow: torch.Tensor, rows: int) -> torch.Tensor:
        """The (blocks, 2) key ranges of :meth:`key_ranges`, left on the device (the fused kernel reads them)."""
        key = ("range tensor", id(allow), rows)
        if key not in self._allow_cache:
            self._allow_cache[key] = _block_ranges(allow, rows).to(torch.int32)
        return self._allow_cache[key]

    def allow_bits(self, allow: torch.Tensor) -> torch.Tensor:
        """A (B, 1, n_q, n_kv) allow-set packed 32 keys to a word for the fused kernel
        (:func:`attnviz.core.kernels.pack_allow`), made once per mask."""
        key = ("bits", id(allow))
        if key not in self._allow_cache:
            self._allow_cache[key] = kernels.pack_allow(allow[0, 0])
        return self._allow_cache[key]

    def valid_on(self, device) -> torch.Tensor:
        """``valid`` on ``device``, copied there once per run."""
        key = ("valid", torch.device(device))
        if key not in self._device_cache:
            self._device_cache[key] = self.valid.to(device)
        return self._device_cache[key]

    def collect(self) -> None:
        """After the forward: wait for the asynchronous host copies of full maps and of every layer's finished
        statistics (:class:`devices.HostCopy`), and keep the host arrays. Nothing during the forward waits."""
        for store in (self.probs, self.scores):
            for layer, maps in store.items():
                if isinstance(maps, recorders_mod.FullMaps):
                    store[layer] = maps.host()
        for layer, values in self.reduced.items():
            self.reduced[layer] = devices.landed(values)

    def query_positions(self, n_q: int, device) -> torch.Tensor:
        source = self.positions if self.q_positions is None else self.q_positions
        return source[:, -n_q:].to(device)

    def sink_key(self, layer: int) -> int:
        """The position of the layer's sink key under its mask and the model's window there (:func:`auto_key`),
        over the run's longest row; once per layer. The window is the one the layer's attention was called
        with (a block's output hook runs after its attention)."""
        key = ("sink key", layer)
        if key not in self._allow_cache:
            n = int(self.positions.max()) + 1
            self._allow_cache[key] = auto_key(self.masks[layer], n, self.windows.get(layer))
        return self._allow_cache[key]

    def has_head_mask(self, layer: int) -> bool:
        """Whether some heads of ``layer`` see fewer keys than its mask allows: a compressed cache's kept keys
        (``head_masks``) or an intervention's per-head key mask (``headwindow``)."""
        return layer in self.head_masks or any(type(a).key_mask is not _NO_KEY_MASK
                                               for a in self.interventions.at(layer))

    def head_mask(self, layer: int, n_heads: int, n_q: int, n_kv: int, device) -> torch.Tensor:
        """The (H, n_q, n_kv) per-head allow-set of ``layer``: every head mask of the layer and-ed together."""
        masks = [self.head_masks[layer](n_q, n_kv, device)] if layer in self.head_masks else []
        kv_pos, q_pos = self.positions[0, -n_kv:].to(device), self.query_positions(n_q, device)[0]
        for intervention in self.interventions.at(layer):
            made = intervention.key_mask(q_pos, kv_pos, n_heads)
            if made is not None:
                masks.append(made)
        out = masks[0]
        for more in masks[1:]:
            out = out & more
        return out

    def recorders_at(self, layer: int) -> tuple:
        """The recorders fed by ``layer``: the run's own for a recorded layer, and the live probabilities of every
        layer when the graph is kept (residual variants)."""
        kept = self.recorders if layer in self.record else ()
        return kept + (recorders_mod.LIVE,) if self.keep_graph else kept

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
    """The runs of an encoder-decoder forward: one per attention kind ("encoder", "decoder",
    "cross"), each attention module routed to its run and layer by identity, since T5 and BART
    number the layers of every stack from 0."""

    runs: dict[str, Run]
    routes: dict[int, tuple[str, int]]  # id(module) -> (kind, layer)

    def route(self, module) -> tuple[Run, int]:
        try:
            kind, layer = self.routes[id(module)]
        except KeyError:
            raise ModelLoadError(f"{type(module).__name__} is an attention module attnviz did not find when it "
                                 "mapped this model's encoder and decoder") from None
        return self.runs[kind], layer


def _stock_eager(module) -> Callable:
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ModelLoadError(f"{type(module).__name__} has no eager attention to fall back on")
    return fn


class Route(str, enum.Enum):
    """How one layer's attention is computed (:func:`choose_route`)."""

    SDPA_CAUSAL = "sdpa-causal"  # nothing to record or change, a plain causal mask: SDPA's fused causal kernel
    SDPA_MASKED = "sdpa-masked"  # nothing to record or change: SDPA with the layer's allow-set
    FUSED = "fused"  # statistics only, on a GPU: the fused Triton kernel (attnviz.core.kernels), SDPA for the output
    BLOCKS = "blocks"  # the explicit fp32 softmax, block of query rows by block (every other case)


@dataclass(frozen=True)
class Facts:
    """What decides a layer's route; every field is a plain fact about the layer and the run."""

    recorded: bool = False  # its probabilities are kept (full maps or a reducer)
    keep_graph: bool = False  # every layer's probabilities with their autograd graph (residual variants)
    stablemask: bool = False  # StableMask's pseudo-slots
    softcap: bool = False  # Gemma 2's score softcap
    sink_logits: bool = False  # gpt-oss's learned sink logits
    reshapes: bool = False  # an intervention changes its scores or probabilities
    head_mask: bool = False  # a per-head key mask (a compressed cache, a headwindow intervention)
    plain_causal: bool = False  # fwd, no window, no padding, self-attention, no position bias
    block_reducer: bool = False  # the recorder takes statistics block by block (attnviz.stats.reduce)
    fused_reducer: bool = False  # ... and can take the fused kernel's outputs
    batch_one: bool = True
    position_bias: bool = False  # T5's relative position bias
    grad: bool = False  # autograd is on
    kernel: bool = False  # the fused kernel can run on this device (kernels.wanted)


def choose_route(f: Facts) -> Route:
    """The one place a layer's route is chosen (tested alone, table-driven: tests/test_routes.py)."""
    explicit = (f.recorded or f.keep_graph or f.stablemask or f.softcap or f.sink_logits or f.reshapes
                or f.head_mask)
    if not explicit:
        return Route.SDPA_CAUSAL if f.plain_causal else Route.SDPA_MASKED
    if (f.recorded and f.block_reducer and f.fused_reducer and f.batch_one and not f.stablemask and not f.softcap
            and not f.sink_logits and not f.position_bias and not f.keep_graph and not f.grad and not f.reshapes
            and not f.head_mask and f.kernel):
        return Route.FUSED
    return Route.BLOCKS


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
              sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """The registered attention function: explicit softmax where we record or must, SDPA elsewhere."""
    caught = _CATCH.get()
    if caught is not None:  # score attribution reading the module's queries and keys (catching)
        caught.update(query=query.detach().float(), key=key.detach().float(),
                      scaling=query.shape[-1] ** -0.5 if scaling is None else scaling, softcap=softcap,
                      s_aux=None if s_aux is None else s_aux.detach())
        raise Caught()
    run = _RUN.get()
    if run is None:  # not inside attnviz: behave as stock
        # SDPA gives no weights: a caller asking for them (output_attentions=True) gets stock eager's, as it
        # would from a model loaded eager (after a capture too)
        if softcap is not None or s_aux is not None or kwargs.get("output_attentions"):
            if attention_mask is not None and attention_mask.dtype == torch.bool:
                attention_mask = torch.where(attention_mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
            return _stock_eager(module)(module, query, key, value, attention_mask, scaling=scaling,
                                        dropout=dropout, sliding_window=sliding_window, softcap=softcap,
                                        s_aux=s_aux, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)

    run, layer = run.route(module)
    run.windows[layer] = sliding_window
    mask = run.masks[layer]
    bias = kwargs.get("position_bias")  # T5's relative position bias: added to the scores
    batch, n_heads, n_q, dim = query.shape
    n_kv_heads, n_kv = key.shape[1], key.shape[2]
    group = n_heads // n_kv_heads
    scaling = dim ** -0.5 if scaling is None else scaling
    reshaped = any(a.changes_probabilities for a in run.interventions.at(layer))  # scores or probabilities
    recorded = layer in run.record
    plain_causal = mask.name == "fwd" and not sliding_window and n_q == n_kv and run.unpadded and bias is None
    recs = run.recorders_at(layer)
    fusable = bool(recs) and all(r.fusable for r in recs)
    route = choose_route(Facts(
        recorded=bool(recs), keep_graph=run.keep_graph, stablemask=mask.stable is not None,
        softcap=softcap is not None, sink_logits=s_aux is not None, reshapes=reshaped,
        head_mask=run.has_head_mask(layer), plain_causal=plain_causal,
        block_reducer=bool(recs) and not any(r.whole_layer for r in recs), fused_reducer=fusable,
        batch_one=batch == 1, position_bias=bias is not None, grad=torch.is_grad_enabled(),
        kernel=fusable and kernels.wanted(query.device)))
    if route is Route.SDPA_CAUSAL:
        # plain causal: let SDPA pick its fused causal kernel instead of reading an n x n mask
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=group > 1)
        return run.finish(layer, out)
    # the fused route under a plain causal mask makes no allow-set: its counts, key ranges and pooled cells
    # are arithmetic (reduce.Layout.causal), and SDPA runs is_causal
    # the block route with recorders that all take the layer a block of rows at a time makes each block's rows
    # of a large allow-set as it goes: nothing n_q x n_kv on the device (a plain causal fused layer makes none)
    rowwise = (route is Route.BLOCKS and batch * n_q * n_kv > WHOLE_ALLOW_BYTES and bool(recs)
               and mask.stable is None and not run.keep_graph
               and not run.has_head_mask(layer) and not torch.is_grad_enabled()
               and not any(r.whole_layer or r.all_keys for r in recs))
    if route is Route.FUSED and plain_causal:
        allow = None
    elif rowwise:
        allow = run.rowwise(layer, n_q, n_kv, sliding_window, query.device)
    else:
        allow = run.allow(layer, n_q, n_kv, sliding_window, query.device)
    if run.has_head_mask(layer):
        allow = keep_self_if_empty(allow & run.head_mask(layer, n_heads, n_q, n_kv, query.device)[None])
    if route is Route.SDPA_MASKED:
        attn_mask = allow if bias is None else bias.to(query.dtype).masked_fill(~allow, float("-inf"))
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scaling,
                                             enable_gqa=group > 1)
        return run.finish(layer, out)

    inputs = recorders_mod.LayerIn(module, query, key, value, scaling)
    for recorder in recs:
        recorder.start(run, layer, inputs)
    kv_pos = run.positions[:, -n_kv:].to(query.device)
    q_pos = run.query_positions(n_q, query.device)
    if route is Route.FUSED:
        try:
            return _fused_layer(run, layer, recs, query, key, value, allow, scaling, plain_causal)
        except Exception as err:  # noqa: BLE001 - a kernel that cannot compile or launch here: the block engine
            if devices.is_out_of_memory(err):
                raise
            kernels.disable(err)
        if allow is None:  # the block engine reads the allow-set
            allow = run.allow(layer, n_q, n_kv, sliding_window, query.device)
    rows = n_q if run.keep_graph or torch.is_grad_enabled() or any(r.whole_layer for r in recs) \
        else run.block_rows(batch * n_heads * n_kv, query.device)
    # Each block computes only the keys some of its rows may see (half the work under a causal mask).
    # Not under StableMask (its pseudo-slots sit on forbidden keys) nor for a recorder that keeps every key.
    narrow = mask.stable is None and not any(r.all_keys for r in recs)
    ranges = run.key_ranges(layer, allow, rows, narrow)  # every block's key range, one host sync per mask
    # Recorders may need only some rows of a layer whose output nobody reads (a region: the forward
    # stops after its layer): the other blocks are skipped, their output left zero.
    wanted = {r.only_rows for r in recs}
    only = next(iter(wanted)) if len(wanted) == 1 else None
    outs = []
    for q0, (k0, k1) in zip(range(0, n_q, rows), ranges):
        q1 = min(q0 + rows, n_q)
        if only is not None and (q1 <= only[0] or q0 >= only[1]):
            outs.append(query.new_zeros(batch, n_heads, q1 - q0, value.shape[-1]))
            continue
        block_allow = _rows(allow, q0, q1)[..., k0:k1]
        probs = _block_probs(run, layer, mask, query[:, :, q0:q1], key[:, :, k0:k1], scaling, block_allow,
                             None if bias is None else bias[:, :, q0:q1, k0:k1], softcap, s_aux, q_pos[:, q0:q1],
                             kv_pos[:, k0:k1], q0, k0, recs)
        for recorder in recs:
            recorder.block(run, layer, q0, k0, probs, block_allow)
        b = q1 - q0
        out = torch.matmul(probs.to(value.dtype).view(batch, n_kv_heads, group * b, k1 - k0), value[:, :, k0:k1])
        outs.append(out.view(batch, n_heads, b, -1))
        del probs
    for recorder in recs:
        recorder.finish(run, layer)
    if recorded:
        run.allowed[layer] = allow
    return run.finish(layer, outs[0] if len(outs) == 1 else torch.cat(outs, dim=2))


def _fused_layer(run: Run, layer: int, recs, query, key, value, allow, scaling: float, plain_causal: bool):
    """A recorded layer whose recorders all take the fused route (:mod:`attnviz.core.kernels`): one attention
    kernel gives its output and every row's log-sum-exp, and the Triton kernel the sums and pooled maps the
    recorders ask for (:meth:`~attnviz.core.recorders.Recorder.fused_needs`) from Q, K and that log-sum-exp."""
    batch, n_heads, n_q, _ = query.shape
    n_kv = key.shape[2]
    needs: dict = {}
    for recorder in recs:
        needs.update(recorder.fused_needs(run, layer))
    if plain_causal:  # nothing n_q x n_kv: a block of rows q0.. sees keys 0 .. q0 + BLOCK_M - 1
        ends = torch.arange(kernels.BLOCK_M, n_q + kernels.BLOCK_M, kernels.BLOCK_M, device=query.device)
        ranges = torch.stack([torch.zeros_like(ends), ends.clamp(max=n_kv)], dim=-1).to(torch.int32)
        layout = reduce.Layout.causal(n_q, query.device)
    else:
        ranges = run.key_range_tensor(allow, kernels.BLOCK_M)
        layout = reduce.Layout.of(allow[0, 0])
    factor = pooled_shape = None
    if needs.get("pool"):
        factor = pool_factor(max(n_q, n_kv), needs["pool"])
        pooled_shape = (-(-n_q // factor), -(-n_kv // factor))
    delim = needs["delim"] if needs.get("delim") is not None else torch.zeros(n_kv)
    # the layer's output and every row's log-sum-exp from one attention kernel: the statistics pass once over QK^T
    out, lse = kernels.attention_with_lse(query, key, value, None if plain_causal else allow, scaling, plain_causal)
    raw = kernels.layer_statistics(query[0], key[0], None if plain_causal else run.allow_bits(allow), ranges,
                                   scaling, delim[-n_kv:], factor, pooled_shape,
                                   needs.get("value_norms"), scores=bool(needs.get("scores")), causal=plain_causal,
                                   lse=None if lse is None else lse[0])
    for recorder in recs:
        recorder.fused(run, layer, raw, layout)
        recorder.finish(run, layer)
    run.allowed[layer] = CausalAllow(n_q) if plain_causal else allow
    return run.finish(layer, out)


class RowwiseAllow:
    """A layer's (B, 1, n_q, n_kv) allow-set that is never made whole: :meth:`rows` makes a block of query rows
    on the layer's device (the block route asks for each block's rows as it goes), :meth:`host` the whole set
    on the host, a chunk of rows at a time (what a capture keeps). Used by the block route when every
    recorder takes the layer block by block: nothing n_q × n_kv is then made on the device."""

    def __init__(self, run: "Run", layer: int, n_q: int, n_kv: int, window: int | None, device: torch.device):
        self.run, self.layer, self.window, self.device = run, layer, window, device
        self.shape = (run.valid.shape[0], 1, n_q, n_kv)

    def rows(self, q0: int, q1: int) -> torch.Tensor:
        return self.run.allow_rows(self.layer, self.shape[2], self.shape[3], self.window, self.device, q0, q1)

    def __getitem__(self, index) -> torch.Tensor:
        """Indexing makes the whole set (B, 1, n_q, n_kv) first, as :meth:`Run.allow` would have: for a reader
        of ``run.allowed`` that wants it whole (the capture reads :meth:`host` instead)."""
        return self.rows(0, self.shape[2])[index]

    def host(self):
        import numpy as np

        n_q, n_kv = self.shape[2], self.shape[3]
        out = np.empty((n_q, n_kv), dtype=bool)
        step = max(1, reduce.CHUNK_ELEMENTS // max(n_kv, 1))
        for q0 in range(0, n_q, step):
            out[q0:q0 + step] = self.run.allow_rows(self.layer, n_q, n_kv, self.window, "cpu", q0,
                                                    min(q0 + step, n_q))[0, 0].numpy()
        return out


def _rows(allow, q0: int, q1: int) -> torch.Tensor:
    """Rows q0 .. q1 - 1 of an allow-set, whole (a tensor) or :class:`RowwiseAllow`."""
    return allow.rows(q0, q1) if isinstance(allow, RowwiseAllow) else allow[:, :, q0:q1]


@dataclass(frozen=True)
class CausalAllow:
    """A recorded layer's plain causal allow-set of ``n`` tokens, not made on the device: the fused route
    needs none (:class:`attnviz.stats.reduce.Layout`); the host's copy is made once per length
    (:func:`attnviz.capture.host_allowed`)."""

    n: int

    def host(self):
        import numpy as np

        return np.tri(self.n, dtype=bool)


def _block_ranges(allow: torch.Tensor, rows: int) -> torch.Tensor:
    """(blocks, 2) [first, last + 1) of the keys any row of each block of ``rows`` query rows of a
    (B, 1, n_q, n_kv) allow-set may see (every key for a block that sees none), on allow's device."""
    n_q, n_kv = allow.shape[-2], allow.shape[-1]
    seen = torch.stack([_rows(allow, q0, min(q0 + rows, n_q)).any(2).any(1).any(0)
                        for q0 in range(0, n_q, rows)])  # (blocks, n_kv)
    index = torch.arange(n_kv, device=seen.device)
    first = torch.where(seen, index, n_kv).amin(-1)
    last = torch.where(seen, index, -1).amax(-1) + 1
    none = ~seen.any(-1)
    return torch.stack([torch.where(none, 0, first), torch.where(none, n_kv, last)], dim=-1)


def _block_probs(run: Run, layer: int, mask: Mask, query, key, scaling, allow, bias, softcap, s_aux, q_pos, kv_pos,
                 q0: int = 0, k0: int = 0, recs=()) -> torch.Tensor:
    """(B, H, b, w) fp32 probabilities of one block of b query rows and w keys (the block's first: q0, k0);
    recorders that ask for the block's pre-softmax scores (``recs``) get them before the softmax."""
    batch, n_heads, n_q, dim = query.shape
    n_kv_heads, n_kv = key.shape[1], key.shape[2]
    group = n_heads // n_kv_heads
    # GQA without repeating keys: fold each KV group's query heads into the query axis.
    # Scaling q (b x d) instead of the scores (b x n) saves a full pass over the largest tensor.
    q = (query * scaling).reshape(batch, n_kv_heads, group * n_q, dim)
    scores = torch.matmul(q, key.transpose(-1, -2)).float().view(batch, n_heads, n_q, n_kv)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.float()
    acts = run.interventions.at(layer)
    for intervention in acts:  # temperature: what the softmax sees (and what is recorded as its scores)
        scores = intervention.scores(scores)
    for recorder in recs:  # the scores as the softmax sees them: every key, or -inf where forbidden
        if recorder.scores is not None:
            kept = scores if recorder.scores == "raw" else scores.masked_fill(~allow, float("-inf"))
            recorder.block_scores(run, layer, q0, k0, kept, allow)
    extra = []  # logits that take part in the softmax and are dropped after it
    if mask.stable is not None and mask.horizon is None:  # StableMask: pseudo-logits on the future slots
        future = (kv_pos[:, None, None, :] > q_pos[:, None, :, None]) & run.valid_on(query.device)[:, None, None, -n_kv:]
        pseudo = mask.pseudo_logits(kv_pos[:, None, :], n_heads).to(query.device)  # (H, B, n_kv)
        pseudo = pseudo.permute(1, 0, 2)[:, :, None, :]  # (B, H, 1, n_kv)
        scores = torch.where(allow, scores, torch.where(future, pseudo, float("-inf")))
    else:
        scores.masked_fill_(~allow, float("-inf"))
        if mask.stable is not None:  # SM-I: the future slots up to T folded into one logit per row
            extra.append(mask.inference_logits(q_pos, n_heads).to(query.device))
    if s_aux is not None:  # gpt-oss learned sink logit per head: an extra column, dropped after softmax
        extra.append(s_aux.float().reshape(1, -1, 1, 1).expand(batch, n_heads, n_q, 1))
    for intervention in acts:  # sinklogit: one more logit B per row, dropped after the softmax
        b = intervention.extra_logit()
        if b is not None:
            extra.append(scores.new_full((batch, n_heads, n_q, 1), float(b)))
    if extra:
        scores = torch.cat([scores, *extra], dim=-1)
        scores = scores - scores.amax(-1, keepdim=True)
        probs = torch.softmax(scores, dim=-1)[..., :n_kv]
    elif torch.is_grad_enabled() and scores.requires_grad:  # training: autograd needs the out-of-place softmax
        probs = torch.softmax(scores, dim=-1)
    else:  # softmax in place: one b x n fp32 buffer instead of two (peak memory)
        probs = scores.sub_(scores.amax(-1, keepdim=True)).exp_()
        probs = probs.div_(probs.sum(-1, keepdim=True))
    if mask.stable is not None and mask.horizon is None:  # zeroed after the softmax, not renormalised
        probs = probs * allow if probs.requires_grad else probs.mul_(allow)
    for intervention in acts:  # sinkscale: after the softmax
        probs = intervention.probabilities(probs, k0)  # the block's first key
    return probs


def output_linear(module) -> torch.nn.Module:
    """The attention's output projection: a Linear whose weight is (hidden, heads * head_dim), or GPT-2's Conv1D
    ``c_proj`` (its weight transposed); or a clear refusal."""
    for name in ("o_proj", "out_proj", "dense", "o", "c_proj"):
        proj = getattr(module, name, None)
        if isinstance(proj, torch.nn.Linear) or (type(proj).__name__ == "Conv1D" and hasattr(proj, "weight")):
            return proj
    raise ModelLoadError(
        f"cannot read the output projection of {type(module).__name__} (no o_proj/out_proj/dense/o/c_proj), so the "
        "value-weighted view is not available for this model"
    )


def _weight(proj) -> torch.Tensor:
    """W_O as (hidden, heads * head_dim) of a Linear or a Conv1D (which stores it transposed)."""
    return proj.weight if isinstance(proj, torch.nn.Linear) else proj.weight.T


def output_projection(module) -> torch.Tensor:
    """The attention's output projection W_O as (hidden, heads * head_dim)."""
    return _weight(output_linear(module))


def attention_modules(model) -> list:
    """The model's self-attention modules, bottom layer first: the anatomy's (:mod:`attnviz.core.anatomy`), or by
    name (``self_attn``, ``.attn``) for a model it does not map (an encoder-decoder)."""
    from attnviz.core import anatomy

    if not getattr(model.config, "is_encoder_decoder", False):
        try:
            return [layer.attn for layer in anatomy.of(model).layers]
        except InputError:
            pass
    return [m for name, m in model.named_modules() if name.endswith(("self_attn", ".attn"))]


def value_norms(module, value: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, H, n_kv) norms ||W_O^h v_j^h||: what each key can add to the output through head h
    (Kobayashi et al. 2020, "Attention is not only a weight"; the shared bias is left out)."""
    from accelerate.utils import align_module_device

    proj = output_linear(module)
    with align_module_device(proj):  # a layer offloaded by a device map holds its weights only while in use
        weight = _weight(proj).to(value.device, torch.float32)
    batch, n_kv_heads, n_kv, dim = value.shape
    per_head = weight.view(weight.shape[0], n_heads, dim)  # (hidden, H, d)
    v = value.float().repeat_interleave(n_heads // n_kv_heads, dim=1)  # (B, H, n, d)
    return torch.einsum("bhnd,ohd->bhno", v, per_head).norm(dim=-1)


def mask_builder(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, **kwargs):
    """Registered mask builder: during a run the attention function builds per-layer masks itself."""
    if _RUN.get() is not None:
        return None
    kwargs["allow_is_causal_skip"] = False  # stock path may need an explicit mask (eager fallback)
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(KEY, attention)
AttentionMaskInterface.register(KEY, mask_builder)


def prepare(model) -> None:
    """Switch a model to the attnviz attention, refusing models whose attention bypasses it.

    Decoders must declare ``_supports_attention_backend``. T5, BART and Marian do not, but their
    attention calls ``ALL_ATTENTION_FUNCTIONS.get_interface``, which transformers itself detects
    (``_can_set_attn_implementation``); :mod:`attnviz.seq2seq` also checks that every attention
    module was routed.
    """
    if getattr(model.config, "_attn_implementation", None) == KEY:
        return
    if getattr(model.config, "is_encoder_decoder", False):
        if not type(model)._can_set_attn_implementation():
            raise ModelLoadError(
                f"{type(model).__name__} ({model.config.model_type}) computes attention in its own code, not "
                "through transformers' AttentionInterface, so attnviz cannot change or record its masks"
            )
        model.set_attn_implementation(KEY)
        return
    if not getattr(type(model), "_supports_attention_backend", False):
        raise ModelLoadError(
            f"{type(model).__name__} ({model.config.model_type}) computes attention in its own code, not "
            "through transformers' AttentionInterface, so attnviz cannot change or record its masks"
        )
    model.set_attn_implementation(KEY)


def decoder_layers(model) -> "torch.nn.ModuleList | None":
    """The decoder layers a forward can resume from (:func:`resume`), or None for a model that must run from its
    embeddings (its anatomy says why: :attr:`attnviz.core.anatomy.Anatomy.resumable`)."""
    from attnviz.core import anatomy

    if getattr(model.config, "is_encoder_decoder", False):
        return None
    try:
        found = anatomy.of(model)
    except InputError:
        return None
    return None if found.resumable else found.layer_list


def _patch_block(layer: int, kind: str, module, args, out):
    """A forward hook on a block's output module (:mod:`attnviz.core.blocks`): the active run's ``patch``
    interventions of that layer and block replace the output where the residual stream adds it."""
    run = _RUN.get()
    if not isinstance(run, Run):
        return None
    acts = [a for a in run.interventions.at(layer) if a.patches(kind)]
    if not acts:
        return None
    value = blocks.output_tensor(out)
    n = value.shape[1]
    positions = run.positions[:, -n:].to(value.device)
    valid = run.valid_on(value.device)[:, -n:]
    for intervention in acts:
        value = intervention.block_output(value, positions, valid, run.sink_key(layer))
    return blocks.with_output(out, value)


def _hook_blocks(model) -> None:
    """Hook every layer's attention and MLP output modules once, so that a run's ``patch`` interventions
    apply; the hooks read the active run, so runs of other sessions on the same model are untouched. A family
    whose blocks are not mapped is refused here, with one line (:func:`attnviz.core.blocks.family`)."""
    with _HOOKS:  # once, however many sessions ask at the same time
        if getattr(model, "_attnviz_patches_blocks", False):
            return
        for index in range(n_layers(model)):
            for kind, module in zip(blocks.KINDS, blocks.source_modules(model, index)):
                module.register_forward_hook(functools.partial(_patch_block, index, kind))
        model._attnviz_patches_blocks = True


def auto_key(mask: Mask, n: int, window: int | None = None) -> int:
    """The sink key's position under ``mask`` (and the model's own sliding ``window`` on causal-type layers, as the
    attention applies it) over a text of ``n`` tokens: :func:`attnviz.stats.metrics.auto_key`, the one
    definition (docs/methods.md#auto-key), read from the allow-set's first columns only (n × 64 at most, nothing
    n × n). A position counted from a row's first real token, as ``patch`` compares it: in a left-padded batch
    it is the same token of every row."""
    from attnviz.stats import metrics

    columns = metrics.auto_key_limit(n)
    i, j = torch.arange(n)[:, None], torch.arange(columns)[None, :]
    allow = mask.allow(i[None, None], j[None, None])[0, 0]
    if window and mask.causal_type:
        allow = allow & ((i - j) < window)
    return metrics.auto_key(allow.numpy())


def _keep_input(index: int, module, args, kwargs) -> None:
    run = _RUN.get()
    if isinstance(run, Run) and index in run.checkpoint_layers:
        hidden = args[0] if args else kwargs["hidden_states"]
        run.checkpoints[index] = hidden[0].detach().to("cpu", copy=True)  # one copy a kept layer


def _resumable_layers(model) -> torch.nn.ModuleList:
    layers = decoder_layers(model)
    if layers is None:
        from attnviz.core import anatomy

        raise ValueError(anatomy.of(model).resumable if not getattr(model.config, "is_encoder_decoder", False)
                         else f"{model.config.model_type} models cannot resume a forward from a layer's input")
    return layers


def _keep_layer_inputs(model) -> None:
    """Hook every decoder layer once, so that a run asking for ``checkpoint_layers`` keeps their inputs;
    the hook reads the active run, so runs of other sessions on the same model are untouched."""
    layers = _resumable_layers(model)
    with _HOOKS:  # once, however many sessions ask at the same time
        if not getattr(model, "_attnviz_keeps_inputs", False):
            for index, layer in enumerate(layers):
                layer.register_forward_pre_hook(functools.partial(_keep_input, index), with_kwargs=True)
            model._attnviz_keeps_inputs = True


def resume(model, hidden: torch.Tensor, start: int, input_ids: torch.Tensor, computes,
           record: Record = Record()) -> Run:
    """Layers ``start``.. of :func:`forward` of ``input_ids`` (1, n), run from ``hidden`` (n, d): the
    input of layer ``start`` that an earlier forward of the same tokens, masks and interventions kept
    (``Run.checkpoints``). The layers below are not run again; like :func:`forward`, ``record.on_layer`` may
    stop it after any layer. Returns the run (what it recorded)."""
    from attnviz.core import anatomy

    _resumable_layers(model)
    found = anatomy.of(model)
    run = make_run(model, input_ids, computes, record)
    with active(run), torch.inference_mode():
        h = hidden[None].to(model.device)
        positions = run.positions.to(model.device)
        # the keyword arguments the base model calls a layer with (the anatomy's probe saw them), made again;
        # the masks come from the run, so the attention mask is None as in every attnviz forward
        made = {"position_ids": positions, "use_cache": False, "output_attentions": False,
                "cache_position": torch.arange(positions.shape[-1], device=positions.device)}
        for layer in found.layers[start:n_layers(model)]:
            kwargs = {name: made.get(name) for name in found.layer_kwargs}
            if "position_embeddings" in kwargs:
                kwargs["position_embeddings"] = found.position_embeddings(h, positions, layer)
            out = layer.module(h, **kwargs)
            h = out[0] if isinstance(out, tuple) else out
    return run


def n_layers(model) -> int:
    return int(model.config.get_text_config().num_hidden_layers)


def forward(model, input_ids: torch.Tensor, computes, record: Record = Record(), feed: Feed = Feed()):
    """One forward pass under per-layer masks and interventions (``computes``: a :class:`Computes` or a list
    of masks), recording what ``record`` asks; returns ``(model_output, run)``. Recorded layers compute
    their softmax in blocks of query rows (``record.block_bytes``)."""
    with contextlib.nullcontext() if feed.grad else torch.inference_mode():
        run = make_run(model, input_ids, computes, record, feed)
        cached = feed.past_key_values is not None
        if cached != (feed.kv_positions is not None):
            raise ValueError("a cached forward takes past_key_values and kv_positions together")
        new_positions = run.positions[:, -input_ids.shape[1]:] if cached else run.positions
        target = model if feed.lm_head else model.base_model
        keep = {"logits_to_keep": 1} if feed.last_logits_only and feed.lm_head and "logits_to_keep" in \
            inspect.signature(model.forward).parameters else {}
        if run.checkpoint_layers:
            _keep_layer_inputs(model)
        with active(run):
            output = target(input_ids=input_ids.to(model.device), position_ids=new_positions.to(model.device),
                            attention_mask=None if cached else run.valid.long().to(model.device),
                            past_key_values=feed.past_key_values, use_cache=cached,
                            output_hidden_states=feed.hidden_states, **keep)
    return output, run


def make_run(model, input_ids: torch.Tensor, computes, record: Record = Record(), feed: Feed = Feed()) -> Run:
    """The per-call state of :func:`forward` (positions, masks, what to record), checked.

    Code that runs the layers itself (residual variants) makes one and enters :func:`active`.
    """
    if getattr(model.config, "is_encoder_decoder", False):
        raise InputError(f"{type(model).__name__} is an encoder-decoder model: this view takes decoder-only models "
                         "(encoder-decoders are captured on the heatmaps page or with `attnviz capture`)")
    prepare(model)
    computes = Computes.of(computes)
    masks, total = list(computes.masks), n_layers(model)
    if len(masks) != total:
        raise ValueError(f"{len(masks)} masks for a model with {total} layers")
    attention_mask, kv_positions = feed.attention_mask, feed.kv_positions
    if kv_positions is not None:
        if attention_mask is not None:
            raise ValueError("a cached forward takes kv_positions and no attention_mask")
        positions = kv_positions.long()
        valid = torch.ones_like(positions, dtype=torch.bool)
    else:
        valid = (torch.ones_like(input_ids) if attention_mask is None else attention_mask).bool()
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    if any(a.patches(block) for a in computes.interventions.items for block in blocks.KINDS):
        _hook_blocks(model)
    for mask in {id(m): m for m in masks}.values():
        if mask.horizon is not None and int(positions.max()) + 1 > mask.horizon:
            raise InputError(f"{mask.name} was set for at most T={mask.horizon} tokens but the text reaches "
                             f"{int(positions.max()) + 1}: raise T or shorten the text")
    return Run(masks, frozenset(range(total) if record.layers is None else record.layers), positions, valid,
               recorders=recorders_mod.for_record(record), on_layer=record.on_layer,
               keep_graph=record.keep_graph, interventions=computes.interventions, block_bytes=record.block_bytes,
               unpadded=True if kv_positions is not None or attention_mask is None else None,
               checkpoint_layers=frozenset(record.checkpoints))


@contextmanager
def active(run: Run):
    """Make ``run`` the attnviz run of this thread/context while the block runs."""
    token = _RUN.set(run)
    try:
        yield run
    finally:
        _RUN.reset(token)
        for each in getattr(run, "runs", {"": run}).values():
            each.collect()
