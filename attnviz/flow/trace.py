"""One forward under a recipe that measures every layer's contributions (docs/methods.md#contributions): the
capture side of routes. The engine's named sites (docs/methods.md#sites, in the tracing thread only) read each
layer's input, its heads' outputs, its attention's write, the stream after its attention and its output; a recorder
takes the layer's probabilities and values as the engine computed them, the recipe's masks and interventions applied.
Each layer is reduced as soon as its output exists; only its contributions (entries at or above a floor) and the
residual stream stay.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from attnviz.core.model import anatomy as anatomy_mod
from attnviz.core import engine
from attnviz.core.model import precision
from attnviz.core.model.devices import HostCopy
from attnviz.core.engine import sites
from attnviz.core.model.modules import output_projection
from attnviz.core.record.recorders import Recorder
from attnviz.errors import InputError
from attnviz.flow import contributions
from attnviz.flow.contributions import attention_raw, kept_entries, normalised

FLOOR = 0.005  # contributions below it are not kept (a graph's threshold may not go below it)


@dataclass
class LayerFlow:
    """One layer's normalised contributions. Attention: ``attn_residual`` (n,) of the stream before it, and every
    (query, source, head) at or above the floor as ``attn_index`` (K, 3) and ``attn_weight`` (K,); the heads summed
    likewise (``sum_index`` (K', 2), ``sum_weight``). MLP: ``mlp`` (n,) and ``mlp_residual`` (n,)."""

    attn_residual: np.ndarray
    attn_index: np.ndarray
    attn_weight: np.ndarray
    sum_index: np.ndarray
    sum_weight: np.ndarray
    mlp: np.ndarray
    mlp_residual: np.ndarray
    parallel: bool = False  # the MLP reads the layer's input (its edges start below the attention)
    replaced: int = 0  # (query, head) outputs an intervention replaced: no token edges there

    def dense(self, n_heads: int, n: int) -> np.ndarray:
        """(n, n, H) attention contributions, zero below the floor (small texts: tests, the JSON)."""
        out = np.zeros((n, n, n_heads), np.float32)
        i, j, h = self.attn_index.T
        out[i, j, h] = self.attn_weight
        return out


@dataclass
class Flow:
    """A text's contributions under a recipe, every layer: read by :mod:`attnviz.flow.graph` (routes, sink share)
    and :mod:`attnviz.flow.lens` (what a node promotes)."""

    tokens: list[str]
    token_ids: list[int]
    recipe: object  # attnviz.recipe.Recipe
    arch: str
    n_heads: int
    sink_keys: list[int]  # each layer's auto key (docs/methods.md#auto-key)
    layers: list[LayerFlow]
    streams: np.ndarray  # (2 L + 1, n, D) float32: the layer-0 input, then each layer's stream after attention, after MLP
    floor: float = FLOOR
    meta: dict = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def held_bytes(self) -> int:
        arrays = [self.streams] + [a for layer in self.layers for a in vars(layer).values() if isinstance(a, np.ndarray)]
        return sum(a.nbytes for a in arrays)

    def stream(self, layer: int, point: str) -> np.ndarray:
        """(n, D) the stream after ``layer``'s ``point`` ("attn" or "mlp"); layer -1, "mlp": the first layer's input."""
        return self.streams[0 if layer < 0 else 2 * layer + (1 if point == "attn" else 2)]


class _Probs(Recorder):
    """The layer's probabilities (H, n_q, n_kv) and values (H_kv, n_kv, d), float32, of the batch's one text.

    Blocks come as the engine makes them, each with only the keys some of its rows may see (half the work under a
    causal mask); they are written into one layer buffer, reused from layer to layer, whose other entries are zero.
    A block's rows are zeroed first unless the layer before wrote the same block (the same rows and keys)."""

    holds = "reduced"

    def __init__(self, into: dict):
        self.into = into
        self.buffer: torch.Tensor | None = None
        self.written: dict = {}  # q0 -> (q1, k0, k1) of the layer before
        self.writing: dict = {}

    def start(self, run, layer, inputs):
        self.into["value"] = inputs.value[0].float()
        shape = (inputs.query.shape[1], inputs.query.shape[2], inputs.key.shape[2])
        self.written, self.writing = self.writing, {}
        if self.buffer is None or tuple(self.buffer.shape) != shape or self.buffer.device != inputs.query.device:
            self.buffer = torch.zeros(shape, dtype=torch.float32, device=inputs.query.device)
            self.written = {}  # a new buffer: nothing of the layer before is in it
        self.into["probs"] = self.buffer

    def block(self, run, layer, q0, k0, probs, allow):
        rows, keys = probs.shape[-2], probs.shape[-1]
        where = (q0 + rows, k0, k0 + keys)
        if self.written.get(q0) != where:
            self.buffer[:, q0:q0 + rows].zero_()
        self.writing[q0] = where
        self.buffer[:, q0:q0 + rows, k0:k0 + keys] = probs[0]


def _miss(a: torch.Tensor, b: torch.Tensor, slack: "torch.Tensor | None" = None) -> torch.Tensor:
    """Per row (last dimension reduced): how far a is from b, relative to the row's size, less ``slack`` (an absolute
    allowance per row: the rounding of the stream the difference was taken from; none in float32)."""
    scale = torch.maximum(a.abs().amax(-1), b.abs().amax(-1)).clamp(min=1e-6)
    apart = (a - b).abs().amax(-1)
    return (apart if slack is None else (apart - slack).clamp(min=0)) / scale


def _rows(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor, written: torch.Tensor, dtype: torch.dtype):
    """A layer's per-row numbers from its streams (n, D): x before its attention, y after it, ``out`` after its MLP,
    ``written`` its attention's write. Returns how far y − x is from the write (:func:`_miss`; in half precision less
    the rounding of the stream, which is relative to the stream, massive at a sink token, not to the write), the
    stream before's raw contribution to y (:func:`contributions.raw_part`), and the MLP's normalised shares of
    ``out`` (its write, the stream before: :func:`contributions.proximity` with the L1 norms each needs made once)."""
    moved = y - x
    y_abs = y.abs()
    slack = None
    if precision.half(dtype):
        slack = precision.stream_rounding(dtype, torch.maximum(x.abs().amax(-1), y_abs.amax(-1)))
    y_l1 = y_abs.sum(-1)
    residual = (y_l1 - moved.abs().sum(-1)).clamp(min=0)  # ‖y‖₁ − ‖y − x‖₁
    out_l1 = out.abs().sum(-1)
    mlp = torch.stack((out_l1 - y_l1, out_l1 - (out - y).abs().sum(-1))).clamp(min=0)  # out − its write is y
    return _miss(moved, written, slack), residual, normalised(mlp, mlp.sum(0))


DIRECTIONS = 8  # random directions the heads' outputs are compared along when no intervention ran


def _nonzero(mask: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    """The indices of ``mask``'s ``count`` true entries, one tensor a dimension: sized in advance, so the device is
    not waited for a second time (``nonzero`` waits to learn the count); a torch without it for this device, as
    ``nonzero``."""
    try:
        return torch.nonzero_static(mask, size=count).unbind(1)
    except (NotImplementedError, RuntimeError):
        return torch.nonzero(mask, as_tuple=True)


@functools.cache
def _directions(d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, DIRECTIONS) fixed random directions on ``device`` and their largest norm, made once (not a copy to the
    device a layer)."""
    r = torch.randn(d, DIRECTIONS, generator=torch.Generator().manual_seed(0)).to(device)
    return r, r.norm(dim=0).amax()


def _made(probs: torch.Tensor, value: torch.Tensor, z: torch.Tensor, exact: bool) -> torch.Tensor:
    """(n, H): how far each head's output ``z`` (n, H, d) is from its probabilities times its values (H, n_kv, d),
    relative to the output's size (within the tolerance: made so).

    Under an intervention, row by row in every dimension (which (query, head) outputs it replaced). Without one the
    question is only whether the family computes its heads that way at all, so the check runs along
    :data:`DIRECTIONS` fixed random directions: a product with d/8 of the cost, and an output that differs beyond
    the tolerance agrees along all eight only by chance (never seen: each agreement is a few-in-a-thousand event)."""
    if exact:
        return _miss(torch.einsum("hqk,hkd->qhd", probs, value), z)
    r, r_norm = _directions(value.shape[-1], value.device)
    made = torch.einsum("hqk,hkr->qhr", probs, value @ r)
    scale = z.norm(dim=-1).clamp(min=1e-6) * r_norm
    return (z @ r - made).abs().amax(-1) / scale


class _Layer:
    """What one layer's sites keep, and its reduction when its output exists."""

    def __init__(self, tracer: "_Tracer", layer: anatomy_mod.Layer, n_heads: int):
        self.tracer, self.layer, self.n_heads = tracer, layer, n_heads
        self.seen: dict = {}
        self.post = None
        if layer.attn_write is not layer.attn:  # a post-norm: its output is the write (frozen scale per token)
            from attnviz.effects.schemes import norm_form

            self.post = norm_form(layer.attn_write, self._width(), f"layer {layer.index}'s post-attention norm")

    def _width(self) -> int:
        return output_projection(self.layer.attn).shape[0]

    def pairs(self) -> list[tuple[sites.Site, object]]:
        """(site, function) of the layer: its input x, its heads' outputs z, the attention block's own output o (where
        a post-norm follows it), its write as the stream adds it, the stream y after it (not with parallel blocks),
        and its output, which reduces the layer."""
        l, read = self.layer.index, self.read
        pairs = [(sites.Site("resid_pre", l), read("x")), (sites.Site("head_z", l), read("z")),
                 (sites.Site("attn_out", l), read("write")), (sites.Site("resid_post", l), read("out", self.reduce))]
        if self.post is not None:
            pairs.append((sites.Site("attn_block", l), read("o")))
        if not self.layer.parallel:
            pairs.append((sites.Site("resid_mid", l), read("y")))
        return pairs

    def read(self, name: str, then=None):
        def fn(value):
            self.seen[name] = contributions.as_float32(value[0])  # under no_grad (:func:`trace`): nothing to detach
            if name == "x" and self.layer.index == 0:
                self.tracer.streams.append(HostCopy(self.seen["x"][None]))
            if then is not None:
                then()
        return fn

    def check(self, flags) -> None:
        """Refuse the layer, in words, where its write cannot be split by source token: without an intervention,
        its heads' outputs must be their probabilities times their values and the stream after it its input plus
        its write. ``flags`` the device's, read once: (all heads made, all rows close, ..., the heads' largest miss,
        the rows' largest miss)."""
        heads_all, rows_all = flags[:2]
        tracer, L = self.tracer, self.layer
        if tracer.intervened or (heads_all and rows_all):
            return
        what = ("its heads' outputs are not their probabilities times their values (off by {:.3g} of an output's "
                "size along fixed random directions" if not heads_all
                else "the stream after it is not its input plus its write (off by {:.3g} of a row's size")
        missed = flags[-1] if heads_all else flags[-2]
        raise InputError(f"routes: {tracer.family} layer {L.index}: the attention's write is not the sum of its "
                         f"heads' weighted values ({what.format(missed)}, limit "
                         f"{tracer.tolerance:.3g} in {precision.name(tracer.dtype)}), so it cannot be split by "
                         f"source token")

    @torch.no_grad()
    def reduce(self) -> None:
        seen, L, tracer = self.seen, self.layer, self.tracer
        # a GPU's layer before is finished first: this layer's forward is queued behind it, and its contributions are
        # freed before this layer's are made (one layer's (H, n, n) arrays at a time)
        tracer.behind()
        probs, value = tracer.recorded.pop("probs"), tracer.recorded.pop("value")
        x, z, out = seen["x"], seen["z"], seen["out"]
        s = L.scale
        written = seen["write"]  # as the stream adds it: s times the block's write
        y = seen["y"] if "y" in seen else x + written
        w_out = contributions.as_float32(output_projection(L.attn))  # (D, H d)
        if w_out.device != x.device:
            w_out = w_out.to(x.device)
        n_heads, width = self.n_heads, w_out.shape[0]
        d = w_out.shape[1] // n_heads
        if value.shape[-1] != d or probs.shape[0] != n_heads:
            raise InputError(f"routes: {tracer.family} layer {L.index}: its heads' values ({tuple(value.shape)}) do not "
                             f"match its output projection ({width} × {n_heads} heads × {d})")
        per_head = w_out.view(width, n_heads, d).permute(1, 0, 2)  # (H, D, d)
        if self.post is not None:
            inv = self.post.inv(seen["o"])[:, 0]  # (n,)
            gamma = self.post.gamma.to(x.device)
            centred = per_head - per_head.mean(1, keepdim=True) if self.post.centre else per_head
            per_head = gamma[None, :, None] * centred
            c = s * inv
        else:
            c = torch.full((x.shape[0],), s, device=x.device)
        # what the heads output is their probabilities times their values, unless an intervention replaced it
        group = n_heads // value.shape[0]
        tol = tracer.tolerance
        heads_miss = _made(probs, value.repeat_interleave(group, 0), z.view(z.shape[0], n_heads, d),
                           exact=tracer.intervened)  # (n, H)
        heads_ok = heads_miss <= tol
        # the block's write is its heads' (a patch replaces it)
        rows_miss, raw_residual, mlp = _rows(x, y, out, written, tracer.dtype)
        rows_ok = rows_miss <= tol
        keep = heads_ok & rows_ok[:, None]  # (n, H)
        if tracer.intervened:  # (query, head) outputs it replaced take no token edges (all kept: a product by 1)
            probs = probs * keep.T[:, :, None]
        raw = attention_raw(y, probs, value, per_head, c)  # on a GPU one Triton pass, no wait
        total = raw.sum((0, 2)) + raw_residual
        inv = contributions.inverse(total)  # 1 / total, 0 for a zero stream
        residual = raw_residual * inv
        shares = HostCopy(torch.stack((residual, mlp[0], mlp[1])))  # one copy to the host, not three
        streams = HostCopy(torch.stack((y, out)))
        tracer.streams.append(streams)
        self.seen = {}
        missed = (heads_miss.amax(), rows_miss.amax())
        if not contributions.on_gpu(raw):  # on the CPU the compiled pass keeps the entries
            flags = torch.stack((heads_ok.all(), rows_ok.all(), (~keep).sum(), *missed)).tolist()
            self.check(flags)
            tracer.pending.append([kept_entries(raw, inv, tracer.floor), shares, int(flags[2])])
            return
        # the device keeps them; how many it keeps (flags 3 and 4, beside the checks') come to the host a layer late,
        # read while the next layer runs: the host never waits for a device with nothing queued (docs/gpu.md)
        heads, summed, over, sum_over = contributions.scaled_and_kept(raw, inv, tracer.floor)
        counts = (over.sum(dtype=torch.float64), sum_over.sum(dtype=torch.float64))
        flags = HostCopy(torch.stack((heads_ok.all(), rows_ok.all(), (~keep).sum(dtype=torch.float64), *counts,
                                      *missed)))
        entry = [None, shares, 0]
        tracer.pending.append(entry)

        def finish():
            read = flags.result().tolist()
            self.check(read)
            k = int(read[3])
            indices, weights = contributions.joined(heads, summed, _nonzero(over, k), _nonzero(sum_over, int(read[4])))
            entry[0], entry[2] = (HostCopy(indices), HostCopy(weights), k), int(read[2])
        tracer.waiting = finish  # run at the next layer's reduce (:meth:`_Tracer.behind`) or after the forward


class _Tracer:
    def __init__(self, loaded, built, floor: float):
        self.anatomy = anatomy_mod.of(loaded.model)
        self.family = self.anatomy.family
        self.floor = floor
        self.intervened = bool(built.interventions)
        self.dtype = next(loaded.model.parameters()).dtype
        # per row, relative to its largest entry: 1e-3 in float32, the dtype's decomposition limit in half precision
        # (docs/methods.md#devices)
        self.tolerance = max(1e-3, precision.decomposition_tolerance(self.dtype))
        self.recorded: dict = {}
        self.pending: list[list] = []  # each layer's results on their way to the host: [kept, shares, replaced]
        self.waiting = None  # a GPU's layer whose kept entries wait for its counts (:meth:`behind`)
        self.streams: list[HostCopy] = []  # (1, n, D) the first layer's input, then (2, n, D) each layer's streams

    def behind(self) -> None:
        """Run the waiting layer's ``finish``, if any: it reads that layer's counts, a wait for the device to reach
        that layer's end while the layers after it are queued (or, after the forward, for the last layer)."""
        earlier, self.waiting = self.waiting, None
        if earlier is not None:
            earlier()

    def landed(self, parallel: list[bool]) -> tuple[list[LayerFlow], np.ndarray]:
        """Every layer's results on the host, waited for once after the forward."""
        self.behind()
        layers = []
        for (kept, shares, dropped), par in zip(self.pending, parallel):
            if isinstance(kept[0], HostCopy):  # the device's, on their way
                kept = contributions.split_kept(kept[0].result(), kept[1].result(), kept[2])
            index, weight, sum_index, sum_weight = kept
            shares = shares.result()
            layers.append(LayerFlow(shares[0], index, weight, sum_index, sum_weight, shares[1], shares[2], par,
                                    dropped))
        return layers, np.concatenate([s.result() for s in self.streams])


def token_index(token: int, n: int) -> int:
    """``token``'s index among a text's ``n`` tokens (negative counts from the end), refused in one line where the
    text has no such token."""
    if not -n <= token < n:
        raise InputError(f"token {token} does not exist: the text has tokens 0..{n - 1}")
    return token % n


def trace(loaded, text: str, recipe="fwd", max_tokens: int | None = None, on_layer=None,
          floor: float = FLOOR, token: int | None = None) -> Flow:
    """Every layer's contributions of ``text`` under ``recipe`` (an architecture string or a
    :class:`~attnviz.recipe.Recipe`; masks, interventions and a BOS control apply; a residual variant is refused:
    its layer loop has none of the blocks measured here). ``on_layer(done, total)`` reports progress. ``token``: the
    token a graph will be drawn for, refused before the model runs when the text has no such token."""
    from attnviz import recipe as recipe_mod
    from attnviz.tokens import tokenize

    from attnviz.core.loading.models import require

    require(loaded, "routes")
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 <= floor < 1:
        raise InputError(f"floor {floor!r}: the smallest contribution a trace keeps lies in [0, 1) "
                         f"(default {FLOOR})")
    built = recipe_mod.build(loaded, recipe).only("routes", "intervene", "prepend", "kind")
    ids, tokens = tokenize(loaded, text, max_tokens, built.recipe.prepend)
    built.check_text(len(ids))
    if token is not None:
        token_index(token, len(ids))
    tracer = _Tracer(loaded, built, floor)
    layers = [_Layer(tracer, layer, loaded.n_heads) for layer in tracer.anatomy.layers]
    started = time.perf_counter()
    progress = (lambda l: on_layer(l + 1, loaded.n_layers)) if on_layer else None
    # the sites act in this thread only: the shared server's other sessions run the same model
    with torch.no_grad(), sites.hooks(loaded.model, [pair for layer in layers for pair in layer.pairs()]):
        built.forward(loaded, torch.tensor([ids]),
                      engine.Record(recorders=(_Probs(tracer.recorded),), on_layer=progress),
                      engine.Feed(last_logits_only=True))
    n = len(ids)
    windows = [layer.window for layer in tracer.anatomy.layers]
    sinks = engine.sink_keys(built.architecture.layers, n, windows)
    flows, streams = tracer.landed([layer.parallel for layer in tracer.anatomy.layers])
    return Flow(tokens, list(ids), built.recipe, built.architecture.spec, loaded.n_heads, sinks, flows,
                streams, floor, meta={"model": loaded.model_id, "seconds": time.perf_counter() - started,
                                      "n_layers": loaded.n_layers})
