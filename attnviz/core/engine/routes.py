"""How one layer's attention is computed: the route table (:func:`choose_route`), a caller's choice of the fused route
for its own calls (:func:`forcing`), the fused route's layer and the block route's probabilities, a block of query
rows at a time."""

from __future__ import annotations

import contextvars
import enum
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from attnviz.core.kernel import kernels
from attnviz.core.kernel.lse import attention_with_lse
from attnviz.core.engine import lean
from attnviz.core.spec.masks import Mask
from attnviz.core.record.reduce import Summaries, pool_factor
from attnviz.stats.metrics import RowSum


class Route(str, enum.Enum):
    """How one layer's attention is computed (:func:`choose_route`)."""

    SDPA_CAUSAL = "sdpa-causal"  # nothing to record or change, a plain causal mask: SDPA's fused causal kernel
    SDPA_MASKED = "sdpa-masked"  # nothing to record or change: SDPA with the layer's allow-set
    FUSED = "fused"  # statistics only, on a GPU: the fused Triton kernel (attnviz.core.kernel.kernels), SDPA for the output
    BLOCKS = "blocks"  # the explicit fp32 softmax, block of query rows by block (every other case)
    # training under a sink logit (a learned one, or sink(logit=s)) with nothing else to record or change: SDPA's
    # output times σ(lse − s), lse every row's log-sum-exp (attnviz.core.kernel.lse.sink_attention)
    SDPA_SINK = "sdpa-sink"
    # the block route whose allow-set is made a block of rows at a time (RowwiseAllow): nothing n_q × n_kv on the
    # device, for a large allow-set whose recorders all take the layer block by block with the keys its rows see
    ROWWISE = "blocks-rowwise"


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
    block_reducer: bool = False  # the recorder takes statistics block by block (attnviz.core.record.reduce)
    fused_reducer: bool = False  # ... and can take the fused kernel's outputs
    batch_one: bool = True
    position_bias: bool = False  # T5's relative position bias
    grad: bool = False  # autograd is on
    kernel: bool = False  # the fused kernel can run on this device (kernels.wanted, with forced_fused)
    large_allow: bool = False  # the layer's allow-set is above what is made whole (the plan's Sizes.whole_allow)
    streamed: bool = False  # every recorder takes the layer block by block, each block with the keys its rows see


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
    if (f.sink_logits and f.grad and not (f.recorded or f.keep_graph or f.stablemask or f.softcap or f.reshapes
                                          or f.head_mask or f.position_bias)):
        return Route.SDPA_SINK
    if (f.recorded and f.large_allow and f.streamed and not f.stablemask and not f.keep_graph and not f.head_mask
            and not f.grad):
        return Route.ROWWISE
    return Route.BLOCKS


# (the thread that forced it, the choice): a context copied into another thread does not carry the choice there
_FORCED: contextvars.ContextVar["tuple[int, bool] | None"] = contextvars.ContextVar("attnviz_forced", default=None)


@contextmanager
def forcing(fused: bool | None = None):
    """Inside, this thread's forwards take the fused route wherever a layer's recorders can (``fused=True``: on any
    device where Triton is installed, in its interpreter on a CPU with ``TRITON_INTERPRET=1``) or never
    (``fused=False``: the block engine), whatever the settings' ``fused`` (``ATTNVIZ_FUSED``, the user's setting)
    says; None changes nothing. Other threads and the settings are untouched: a shared server's sessions, and
    ``attnviz doctor``'s checks of each route (docs/cli.md#check-attnviz-on-this-machine). The innermost wins; a
    launch that failed stays off for its device and shape in its run only
    (:func:`attnviz.core.kernel.kernels.failure`)."""
    if fused is None:
        yield
        return
    token = _FORCED.set((threading.get_ident(), bool(fused)))
    try:
        yield
    finally:
        _FORCED.reset(token)


def forced_fused() -> bool | None:
    """This thread's choice of the fused route (:func:`forcing`), or None where the settings' ``fused`` decide."""
    held = _FORCED.get()
    return held[1] if held is not None and held[0] == threading.get_ident() else None


def fused_layer(run, layer: int, recs, query, key, value, allow, scaling: float, plain_causal: bool):
    """A recorded layer whose recorders all take the fused route (:mod:`attnviz.core.kernel.kernels`): one attention
    kernel gives its output and every row's log-sum-exp, and the Triton kernel the sums and pooled maps the
    recorders ask for (:meth:`~attnviz.core.record.recorders.Recorder.fused_needs`) from Q, K and that log-sum-exp."""
    batch, n_heads, n_q, _ = query.shape
    n_kv = key.shape[2]
    needs: dict = {}
    for recorder in recs:
        needs.update(recorder.fused_needs(run, layer))
    # what this GPU runs best for what is asked (pooling A·||W_O v|| or the scores takes more registers), asked once
    tile = kernels.launch(query.device, query.dtype == torch.float32,
                          heavy=needs.get("value_norms") is not None or bool(needs.get("scores")))
    bm = tile[0]
    # nothing n_q x n_kv for a plain causal mask: a block of rows q0.. sees keys 0 .. q0 + bm - 1
    ranges = allow.causal_ranges(bm) if plain_causal else allow.range_tensor(bm)
    layout = allow.layout()
    factor = pooled_shape = None
    if needs.get("pool"):
        factor = pool_factor(max(n_q, n_kv), needs["pool"])
        pooled_shape = (-(-n_q // factor), -(-n_kv // factor))
    # no delimiters asked: zeros made on the device once (zeros made on the host would be copied there a layer)
    delim = needs["delim"] if needs.get("delim") is not None else kernels.zeros(query.device, n_kv)
    # the layer's output and every row's log-sum-exp from one attention kernel: the statistics pass once over QK^T
    out, lse = attention_with_lse(query, key, value, None if plain_causal else allow.whole(), scaling, plain_causal)
    raw = kernels.layer_statistics(query[0], key[0], None if plain_causal else allow.bits(), ranges,
                                   scaling, delim[-n_kv:], factor, pooled_shape,
                                   needs.get("value_norms"), scores=bool(needs.get("scores")), causal=plain_causal,
                                   lse=None if lse is None else lse[0], block=tile)
    for recorder in recs:
        recorder.fused(run, layer, raw, layout)
        recorder.finish(run, layer)
    run.allowed[layer] = allow
    return run.finish(layer, out)


def block_probs(run, layer: int, mask: Mask, query, key, scaling, allow, bias, softcap, s_aux, q_pos, kv_pos,
                 q0: int = 0, k0: int = 0, recs=(), causal: bool = False, weigh=None) -> torch.Tensor:
    """(B, H, b, w) fp32 probabilities of one block of b query rows and w keys (the block's first: q0, k0);
    recorders that ask for the block's pre-softmax scores (``recs``) get them before the softmax. ``weigh``: an
    attention kind's weights where a row is not a softmax (:func:`attnviz.core.spec.kinds.weigher`), given the row's
    logits with −inf on forbidden keys and any dropped columns (pseudo-logits, a sink logit) after the keys."""
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
        pseudo = mask.pseudo_logits(kv_pos, n_heads).to(query.device)  # (H, B, n_kv)
        pseudo = pseudo.permute(1, 0, 2)[:, :, None, :]  # (B, H, 1, n_kv)
        scores = torch.where(allow, scores, torch.where(future, pseudo, float("-inf")))
    else:
        scores = _forbid(scores, allow, q0, k0, causal)
        if mask.stable is not None:  # SM-I: the future slots up to T folded into one logit per row
            extra.append(mask.inference_logits(q_pos, n_heads).to(query.device))
    sink_at = None  # the learned sink's column among the dropped ones
    if s_aux is not None:  # gpt-oss learned sink logit per head: an extra column, dropped after softmax
        sink_at = n_kv + len(extra)
        extra.append(s_aux.float().reshape(1, -1, 1, 1).expand(batch, n_heads, n_q, 1))
    for intervention in acts:  # sinklogit: one more logit B per row, dropped after the softmax
        b = intervention.extra_logit()
        if b is not None:
            extra.append(scores.new_full((batch, n_heads, n_q, 1), float(b)))
    if weigh is not None:  # softpick, sigmoid: the kind's own weights over the row, its extra columns dropped after
        probs = weigh(torch.cat([scores, *extra], dim=-1) if extra else scores)[..., :n_kv]
    elif extra:
        scores = torch.cat([scores, *extra], dim=-1)
        scores = scores - scores.amax(-1, keepdim=True)
        probs = torch.softmax(scores, dim=-1)
        if sink_at is not None:  # the learned sink's share of each row: its own softmax column, from the logits
            for recorder in recs:  # (docs/methods.md#the-learned-sink-as-a-key)
                recorder.block_sink(run, layer, q0, probs[..., sink_at])
        probs = probs[..., :n_kv]
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


def _forbid(scores: torch.Tensor, allow: torch.Tensor, q0: int, k0: int, causal: bool) -> torch.Tensor:
    """-inf in ``scores`` wherever ``allow`` is False. Under a plain causal mask (no window, no padding, no head's
    own mask: ``causal``) the block's rows q0.. see every key up to q0, so only the columns past it can hold a
    forbidden cell: the same cells, a fraction of the pass (bench/long.py), with no read of the allow-set. Under
    autograd (training) the mask is added out of place (:func:`attnviz.core.engine.lean.masked`): the same numbers,
    and a backward that passes the gradient on instead of masking a copy of it."""
    if scores.requires_grad:
        return lean.masked(scores, allow)
    start = max(q0 + 1 - k0, 0) if causal else 0
    if start < scores.shape[-1]:
        scores[..., start:].masked_fill_(~allow[..., start:], float("-inf"))
    return scores


def route_notes(statistics=None) -> tuple[str, ...]:
    """What a statistics capture's route will be, where it matters: statistics finished from sums the fused
    kernel does not compute take the block engine on every device (slower on a GPU, never a statistic left
    at zero)."""
    reducer = Summaries(["."], statistics=statistics)
    missing = reducer.missing_sums(kernels.SUMS)
    if not missing:
        return ()
    names = sorted(s.name for s in reducer.statistics
                   if any((x.name if isinstance(x, RowSum) else x) in missing for x in s.sums))
    return (f"{', '.join(names)} need{'s' if len(names) == 1 else ''} {', '.join(missing)}, which the fused kernel "
            "does not compute: statistics captures take the block engine",)
