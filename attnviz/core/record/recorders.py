"""Recorders: what a recorded layer keeps. The engine picks a layer's route and feeds every recorder of the
run the same calls; it never knows which recorders it feeds (docs/layout.md#recorders).

One protocol, :class:`Recorder`: a layer's inputs in (:meth:`~Recorder.start`), blocks of probabilities in
(:meth:`~Recorder.block`, with the block's pre-softmax scores for a recorder that asks for them), its finished
layers out (:meth:`~Recorder.finish`, :meth:`~Recorder.result`). Each recorder owns its results, by layer; the run
keeps no store of its own and reads them by what the recorder ``holds`` (``run.probs``, ``run.scores``,
``run.reduced``, ``run.value_norms``, ``run.qkv``, ``run.live``). A recorder declares what it needs of the route, and the engine reads only
those declarations: the whole layer as one block, every key of a block, the scores, some rows only, or
whether it can take a whole layer from the fused kernel's sums (:meth:`~Recorder.fused`) instead of blocks.

:func:`for_record` makes a run's recorders from an :class:`attnviz.core.engine.run.Record`. Adding what a
capture keeps is one recorder here and its line there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from attnviz.core.model import devices
from attnviz.core.record import packed as packed_mod


@dataclass(frozen=True)
class LayerIn:
    """What a recorder may read of a recorded layer before its blocks: the attention module, its queries
    (B, H, n_q, d), keys and values (B, H_kv, n_kv, d) after RoPE, and the score scaling."""

    module: object
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    scaling: float
    allow: object = None  # the layer's allow-set (attnviz.core.spec.allowsets.AllowSet): no probability outside it

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, H, n_q, n_kv) of the layer's maps."""
        return (self.query.shape[0], self.query.shape[1], self.query.shape[2], self.key.shape[2])


class Recorder:
    """One thing a recorded layer keeps. Declarations the route reads (class attributes or properties):

    - ``whole_layer``: the layer's query rows come as one block;
    - ``all_keys``: each block carries every key (else only the keys some of its rows may see);
    - ``scores``: None, "raw" (the block's pre-softmax scores, every key) or "masked" (-inf where forbidden),
      given to :meth:`block_scores`;
    - ``only_rows``: (a, b), the only query rows it needs (the engine may skip the others' blocks when the
      layer's output is not read further: a region's forward stops after its layer);
    - ``fusable``: it can take a whole layer from the fused kernel (:meth:`fused_needs`, :meth:`fused`).
    """

    whole_layer = False
    all_keys = False
    scores: str | None = None
    only_rows: tuple[int, int] | None = None
    fusable = False
    holds = ""  # what the run calls its results: "probs", "scores", "reduced", "value_norms", "qkv", "live"

    @property
    def results(self) -> dict:
        """Its results by layer, as they are made (a recorder owns them; made once per recorder)."""
        return self.__dict__.setdefault("_results", {})

    def result(self) -> dict:
        """Its finished results by layer, on the host where they go there (after the forward)."""
        return self.results

    def start(self, run, layer: int, inputs: LayerIn) -> None:
        """Before the layer's first block (or its fused pass)."""

    def block_scores(self, run, layer: int, q0: int, k0: int, scores: torch.Tensor, allow: torch.Tensor) -> None:
        """A block's pre-softmax scores (B, H, b, w), as :attr:`scores` asked, before the softmax (read them
        now: the engine then computes the softmax in place)."""

    def block(self, run, layer: int, q0: int, k0: int, probs: torch.Tensor, allow: torch.Tensor) -> None:
        """One block: ``probs`` (B, H, b, w) fp32 and ``allow`` (B, 1, b, w) of queries q0.. and keys k0.."""

    def block_sink(self, run, layer: int, q0: int, share: torch.Tensor) -> None:
        """One block's learned-sink share (B, H, b) fp32, for a layer whose model gives each head a learned sink
        logit (gpt-oss): each row's softmax column of that logit, before the engine drops it
        (docs/methods.md#the-learned-sink-as-a-key). Before :meth:`block` of the same rows."""

    def finish(self, run, layer: int) -> None:
        """After the layer's last block: put the finished arrays in the run."""

    def fused_needs(self, run, layer: int) -> dict:
        """What the fused kernel must compute for this recorder (``pool``, ``delim``, ``value_norms``,
        ``scores``), merged over the layer's recorders."""
        return {}

    def fused(self, run, layer: int, raw: dict, layout) -> None:
        """The whole layer from the fused kernel's sums and the mask's layout (:class:`attnviz.core.record.reduce.Layout`)."""


class ValueNorms(Recorder):
    """||W_O^h v_j^h|| of every key (Kobayashi et al. 2020), on the layer's device (``run.value_norms``); read by
    the statistics' pooled value-weighted maps and the fused kernel."""

    fusable = True
    holds = "value_norms"

    def start(self, run, layer, inputs):
        from attnviz.core.model.modules import value_norms

        self.results[layer] = value_norms(inputs.module, inputs.value, inputs.query.shape[1])

    def fused_needs(self, run, layer):
        return {"value_norms": self.results[layer][0]}


class QKVRecorder(Recorder):
    """The layer's queries, keys and values on the host, float32, with the scaling (``run.qkv``)."""

    fusable = True
    holds = "qkv"

    def start(self, run, layer, inputs):
        self.results[layer] = (inputs.query.float().cpu(), inputs.key.float().cpu(), inputs.value.float().cpu(),
                               inputs.scaling)


class Maps(Recorder):
    """Full maps in ``dtype`` (``run.probs``, or ``run.scores`` for the pre-softmax scores), filled block by block
    (:class:`FullMaps`) and copied to the host once per layer."""

    def __init__(self, dtype: torch.dtype, of_scores: bool = False, packed: bool = False):
        self.dtype, self.of_scores, self.packed = dtype, of_scores, packed and not of_scores
        self.holds = "scores" if of_scores else "probs"
        self.scores = "raw" if of_scores else None
        self.all_keys = of_scores  # scores are kept for every key, the masked ones included
        self.current: FullMaps | None = None
        self.indices: dict = {}  # a staged layer's gather index on its device, made once a mask (FullMaps.index)

    def start(self, run, layer, inputs):
        shape, device = inputs.shape, inputs.query.device
        layer_bytes = shape[0] * shape[1] * shape[2] * shape[3] * self.dtype.itemsize
        spans = inputs.allow.spans() if self.packed and shape[0] == 1 and inputs.allow is not None else None
        self.current = FullMaps(shape, self.dtype, device, stage=run.sizes.stages(layer_bytes, device), spans=spans,
                                indices=self.indices)
        self.results[layer] = self.current

    def block_scores(self, run, layer, q0, k0, scores, allow):
        self.current.put(q0, k0, scores)

    def block(self, run, layer, q0, k0, probs, allow):
        if not self.of_scores:
            self.current.put(q0, k0, probs)

    def finish(self, run, layer):
        self.current.finish()
        self.current = None

    def result(self):
        """The host arrays, once every layer's copy to them has landed (the forward never waits for one)."""
        for layer, maps in self.results.items():
            if isinstance(maps, FullMaps):
                self.results[layer] = maps.host()
        return self.results


class Streamed(Recorder):
    """A block reducer (:class:`attnviz.core.record.reduce.BlockReducer`: statistics, pooled maps, a region's crop) fed
    block by block; its finished result goes to ``run.reduced``. With ``pooled_scores`` it also takes the masked
    pre-softmax scores of each block. A reducer that can take the fused kernel's sums makes the layer fusable."""

    holds = "reduced"

    def __init__(self, reducer, pooled_scores: bool = False):
        from attnviz.core.record.reduce import FusedReducer

        self.reducer = reducer
        self.scores = "masked" if pooled_scores else None
        self.only_rows = getattr(reducer, "only_rows", None)
        self.fusable = isinstance(reducer, FusedReducer) and reducer.fusable()
        self.shape: tuple[int, int] = (0, 0)

    def start(self, run, layer, inputs):
        self.shape = inputs.shape[2:]

    def block_scores(self, run, layer, q0, k0, scores, allow):
        self.reducer.add_scores(layer, q0, scores, allow, *self.shape, k0)

    def block(self, run, layer, q0, k0, probs, allow):
        n_q, n_kv = self.shape
        norms = run.value_norms.get(layer)  # the value norms recorder's, fed before this one
        self.reducer.add(layer, q0, probs, allow, n_q=n_q, k0=k0, n_kv=n_kv,
                         **({} if norms is None else {"value_norms": norms}))

    def finish(self, run, layer):
        self.results[layer] = self.reducer.finish(layer)  # on its way to the host (devices.HostCopy)

    def result(self):
        """Every layer's finished results on the host, the asynchronous copies waited for."""
        for layer, values in self.results.items():
            self.results[layer] = devices.landed(values)
        return self.results

    def fused_needs(self, run, layer):
        return {"pool": self.reducer.pool, "delim": self.reducer.delim, "scores": self.scores is not None}

    def fused(self, run, layer, raw, layout):
        self.reducer.add_fused(layer, raw, layout)


class LearnedSink(Recorder):
    """Each row's learned-sink share per head (B, H, n_q) fp32 (``run.results("learned_sink")``), for layers whose
    model gives each head a learned sink logit (:meth:`Recorder.block_sink`); nothing for the others. Fusable: the
    route table never takes the fused route for such a layer (its kernel has no sink logit), so it gets its blocks."""

    holds = "learned_sink"
    fusable = True

    def __init__(self, only_rows: tuple[int, int] | None = None):
        self.only_rows = only_rows  # a region's rows: the engine may skip the others' blocks
        self.n_q = 0

    def start(self, run, layer, inputs):
        self.n_q = inputs.shape[2]

    def block_sink(self, run, layer, q0, share):
        if layer not in self.results:
            self.results[layer] = share.new_zeros(share.shape[0], share.shape[1], self.n_q)
        self.results[layer][:, :, q0:q0 + share.shape[2]] = share.detach()

    def finish(self, run, layer):
        if layer in self.results:
            self.results[layer] = devices.HostCopy(self.results[layer])

    def result(self):
        """Every such layer's (B, H, n_q) shares on the host as numpy, the asynchronous copies waited for."""
        for layer, share in self.results.items():
            self.results[layer] = devices.landed(share)
        return self.results


class Whole(Recorder):
    """``fn(layer, probs, allow)`` on the layer's whole (B, H, n_q, n_kv) probabilities; its result goes to
    ``run.reduced`` (a caller's own reduction: a dataset's moments, a cache's kept keys)."""

    whole_layer = True
    all_keys = True
    holds = "reduced"

    def __init__(self, fn: Callable):
        self.fn = fn

    def block(self, run, layer, q0, k0, probs, allow):
        self.results[layer] = self.fn(layer, probs, allow)


class Live(Recorder):
    """Every layer's fp32 probabilities with their autograd graph, on the device (``run.live``): the residual
    variants' own layer loop reads them."""

    whole_layer = True
    all_keys = True
    holds = "live"

    def block(self, run, layer, q0, k0, probs, allow):
        self.results[layer] = probs


def _numpy_dtype(dtype: torch.dtype):
    """The numpy dtype a host array of ``dtype`` is held in: its own, float32 for bfloat16 (numpy has none)."""
    return torch.empty(0, dtype=torch.float32 if dtype == torch.bfloat16 else dtype).numpy().dtype


def on_host(tensor: torch.Tensor):
    """A host tensor as numpy, bfloat16 values held in float32 (:func:`_numpy_dtype`)."""
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def made(storage_dtype: torch.dtype, reducer=None, scores: bool = False, value_norms: bool = False,
         qkv: bool = False, packed: bool = False) -> tuple[Recorder, ...]:
    """A recorded layer's recorders, in the order they are fed (value norms first: the statistics' pooled
    value-weighted maps read them): full maps in ``storage_dtype`` (and score maps) without a ``reducer``, a block
    reducer (:class:`Streamed`) or a whole-layer function (:class:`Whole`) with one; beside maps or a block reducer, the
    learned sink's share of each row (:class:`LearnedSink`: nothing where the model has no learned sink). ``packed``:
    each full probability map is held as its rows' spans (:class:`attnviz.core.record.packed.Packed`), what a
    capture keeps.
    ``Keep.recorders`` and :func:`for_record` both make them here."""
    out: list[Recorder] = ([ValueNorms()] if value_norms else []) + ([QKVRecorder()] if qkv else [])
    if reducer is None:
        out.append(Maps(storage_dtype, packed=packed))
        if scores:
            out.append(Maps(storage_dtype, of_scores=True))
    elif callable(getattr(reducer, "add", None)):
        out.append(Streamed(reducer, pooled_scores=scores))
    else:
        return tuple(out) + (Whole(reducer),)
    return tuple(out) + (LearnedSink(getattr(reducer, "only_rows", None)),)  # kept where the model has one


def for_record(record) -> tuple[Recorder, ...]:
    """The recorders of an :class:`attnviz.core.engine.run.Record` given by its flags (:func:`made`)."""
    return made(record.storage_dtype, record.reducer, record.scores, record.value_norms, record.qkv)


class FullMaps:
    """A recorded layer's full (B, H, n_q, n_kv) maps in the storage dtype, filled block by block.

    The blocks are written straight into the host array, or, where ``stage`` (the plan's choice,
    :meth:`attnviz.core.sizing.sizes.Sizes.stages`: on an accelerator with room for the layer), gathered on the device
    and sent to pinned host memory in one asynchronous copy per layer, not one small synchronous copy per
    block; the forward waits for the copies before it returns (``Run.collect``). :meth:`host` is the host array, or
    with ``spans`` (one map, B = 1: each query row's first and one past its last key the layer's mask allows) the
    layer held packed on them (:class:`attnviz.core.record.packed.Packed`), where that pays: blocks are written
    straight into it, so nothing whole is made on the host; a staged layer is packed on the device (one gather,
    its index made once a mask: ``indices``) and only the packed cells are copied to the host."""

    def __init__(self, shape, dtype: torch.dtype, device: torch.device, stage: bool = False, spans=None,
                 indices: dict | None = None):
        if spans is not None and not packed_mod.worth(*spans, shape[3]):
            spans = None
        self.shape, self.spans = tuple(shape), spans
        self.stage = torch.zeros(shape, dtype=dtype, device=device) if stage else None
        self.filling = (packed_mod.Packed.empty(shape[1:], *spans, _numpy_dtype(dtype))
                        if spans is not None and self.stage is None else None)
        # whole on the host only where not packed (a packed staged layer's host array is made at finish, its size)
        self.host_array = devices.host_buffer(shape, dtype, device) if spans is None else None
        self.device, self.dtype, self.copying = device, dtype, False
        self.indices = {} if indices is None else indices

    def put(self, q0: int, k0: int, block: torch.Tensor) -> None:
        if self.filling is not None:
            self.filling.put(q0, k0, on_host(block[0].to(self.dtype).cpu()))
            return
        target = self.host_array if self.stage is None else self.stage
        target[:, :, q0:q0 + block.shape[2], k0:k0 + block.shape[3]] = block

    def finish(self) -> None:
        if self.stage is not None:
            source = self.stage
            if self.spans is not None:  # only the spans' cells cross to the host
                source = self.stage[0].reshape(self.shape[1], -1).index_select(1, self.index())
                if self.dtype == torch.bfloat16:  # numpy has no bfloat16: its values, held in float32
                    source = source.float()
                self.host_array = devices.host_buffer(tuple(source.shape), source.dtype, self.device)
            self.host_array.copy_(source, non_blocking=True)
            self.stage, self.copying = None, True

    def index(self) -> torch.Tensor:
        """The spans' :func:`~attnviz.core.record.packed.flat_index` on the layer's device, made once a set of spans
        (named by their values: a layer whose heads have masks of their own has an allow-set of its own, whose
        spans are most often the layer mask's)."""
        lo, hi = self.spans
        key = (lo.tobytes(), hi.tobytes(), self.shape[3], str(self.device))
        if key not in self.indices:
            self.indices[key] = torch.from_numpy(packed_mod.flat_index(lo, hi, self.shape[3])).to(self.device)
        return self.indices[key]

    def host(self) -> "torch.Tensor | packed_mod.Packed":
        """The host array (or the layer held packed), once the copy to it has landed."""
        if self.filling is not None:
            return self.filling
        if self.copying:
            devices.synchronize(self.device)
            self.copying = False
            if self.spans is not None:
                self.filling = packed_mod.Packed.of(self.shape[1:], *self.spans, self.host_array.numpy())
                self.host_array = None
                return self.filling
        return self.host_array
