"""The attention function and mask builder registered under ``"attnviz"`` in transformers'
``AttentionInterface`` / ``AttentionMaskInterface``: :func:`prepare` switches a model to them once. Inside a run
(:mod:`attnviz.core.engine.run`) each layer takes its route (:mod:`attnviz.core.engine.routes`); outside one the model behaves
exactly as stock (SDPA, or the model's own eager function where SDPA cannot express it or weights are asked for).
"""

from __future__ import annotations

import contextvars
import sys
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from attnviz.core.model import devices
from attnviz.core.kernel import kernels
from attnviz.core.kernel.lse import sink_attention
from attnviz.core.engine import lean, routes
from attnviz.core.record import recorders as recorders_mod
from attnviz.core.engine.run import current
from attnviz.core.spec import kinds
from attnviz.errors import ModelLoadError

KEY = "attnviz"
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


def _stock_eager(module) -> Callable:
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ModelLoadError(f"{type(module).__name__} has no eager attention to fall back on")
    return fn


def _overflowed(module, layer: int):
    """A float16 forward whose residual stream passed float16's largest value (65504) below ``layer``: its queries
    are infinite or NaN, and so is everything after. Stock transformers computes the same NaN (Gemma 3 270M does
    at layer 8 on an English sentence); a refusal says so instead of NaN statistics."""
    family = getattr(getattr(module, "config", None), "model_type", "this model")
    raise ModelLoadError(f"{family} overflows float16 before layer {layer}'s attention (its residual stream passes "
                         "float16's largest value, 65504, as in stock transformers): load it in bfloat16 or float32")


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
              sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """The registered attention function: explicit softmax where we record or must, SDPA elsewhere."""
    caught = _CATCH.get()
    if caught is not None:  # score attribution reading the module's queries and keys (catching)
        caught.update(query=query.detach().float(), key=key.detach().float(),
                      scaling=query.shape[-1] ** -0.5 if scaling is None else scaling, softcap=softcap,
                      s_aux=None if s_aux is None else s_aux.detach())
        raise Caught()
    run = current()
    if run is None:  # not inside attnviz: behave as stock
        own = kinds.own(getattr(module, "config", None))
        if kinds.weigher(own) is not None or (isinstance(own, kinds.Sink) and own.logit is not None):
            # a lab model trained with a kind transformers does not have: its own forward, written out
            return kinds.eager(own, query, key, value, attention_mask, scaling or query.shape[-1] ** -0.5, s_aux)
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
    if query.dtype == torch.float16 and not bool(torch.isfinite(query).all()):
        _overflowed(module, layer)
    mask = run.masks[layer]
    bias = kwargs.get("position_bias")  # T5's relative position bias: added to the scores
    batch, n_heads, n_q, dim = query.shape
    n_kv_heads, n_kv = key.shape[1], key.shape[2]
    group = n_heads // n_kv_heads
    scaling = dim ** -0.5 if scaling is None else scaling
    kind = run.kind if run.kind is not None else kinds.own(getattr(module, "config", None))
    s_aux = kinds.sink_logits(kind, s_aux, n_heads, query.device)  # the learned sink, a fixed one, or none
    weigh = kinds.weigher(kind)  # a row that is not a softmax (softpick, sigmoid)
    reshaped = any(a.changes_probabilities for a in run.interventions.at(layer))  # scores or probabilities
    recorded = layer in run.record
    plain_causal = mask.name == "fwd" and not sliding_window and n_q == n_kv and run.unpadded and bias is None
    recs = run.recorders_at(layer)
    fusable = bool(recs) and all(r.fusable for r in recs)
    head_mask = run.has_head_mask(layer)
    # a fused launch that failed in this run, on this device and shape, is not tried again in it
    shape = (str(query.device), str(query.dtype).replace("torch.", ""), tuple(query.shape), tuple(key.shape))
    route = routes.choose_route(routes.Facts(
        recorded=bool(recs), keep_graph=run.keep_graph, stablemask=mask.stable is not None,
        softcap=softcap is not None, sink_logits=s_aux is not None, reshapes=reshaped or weigh is not None,
        head_mask=head_mask, plain_causal=plain_causal,
        block_reducer=bool(recs) and not any(r.whole_layer for r in recs), fused_reducer=fusable,
        batch_one=batch == 1, position_bias=bias is not None, grad=torch.is_grad_enabled(),
        kernel=fusable and shape not in run.fused_failed and kernels.wanted(query.device, routes.forced_fused()),
        large_allow=batch * n_q * n_kv > run.sizes.whole_allow,
        streamed=not any(r.whole_layer or r.all_keys for r in recs)))
    if route is routes.Route.SDPA_CAUSAL:
        # plain causal: let SDPA pick its fused causal kernel instead of reading an n x n mask
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=group > 1)
        return run.finish(layer, out)
    if route is routes.Route.SDPA_SINK:  # training under a sink logit: SDPA's output times σ(lse − s)
        allow = None if plain_causal else run.allow_set(layer, n_q, n_kv, sliding_window, query.device).whole()
        return run.finish(layer, sink_attention(query, key, value, s_aux, allow, scaling, plain_causal))
    # the fused route under a plain causal mask makes no allow-set: its counts, key ranges and pooled cells
    # are arithmetic (reduce.Layout.causal), and SDPA runs is_causal; the rowwise route makes each block's rows
    # of a large allow-set as it goes: nothing n_q x n_kv on the device. Nor does the block route of a layer nobody
    # records under a plain causal mask (training under softpick or sigmoid): its rows and key ranges are arithmetic
    form = ("causal" if plain_causal and (route is routes.Route.FUSED or not (recs or recorded or head_mask))
            else "rows" if route is routes.Route.ROWWISE else "whole")
    allow = run.allow_set(layer, n_q, n_kv, sliding_window, query.device, form, n_heads)
    if route is routes.Route.SDPA_MASKED:
        whole = allow.whole()
        attn_mask = whole if bias is None else bias.to(query.dtype).masked_fill(~whole, float("-inf"))
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scaling,
                                             enable_gqa=group > 1)
        return run.finish(layer, out)

    inputs = recorders_mod.LayerIn(module, query, key, value, scaling, allow)
    for recorder in recs:
        recorder.start(run, layer, inputs)
    if route is routes.Route.FUSED:
        try:
            return routes.fused_layer(run, layer, recs, query, key, value, allow, scaling, plain_causal)
        except Exception as err:  # noqa: BLE001 - a kernel that cannot compile or launch here: the block engine
            if devices.is_out_of_memory(err):
                raise
            run.fused_failed[shape] = kernels.failure(err, f"{shape[0]} {shape[1]} queries {shape[2]}")
        if allow.form == "causal":  # the block engine reads the allow-set
            allow = run.allow_set(layer, n_q, n_kv, sliding_window, query.device, "whole", n_heads)
    kv_pos = run.positions_on(query.device)[:, -n_kv:]
    q_pos = run.query_positions(n_q, query.device)
    rows = n_q if run.keep_graph or torch.is_grad_enabled() or any(r.whole_layer for r in recs) \
        else run.block_rows(batch * n_heads * n_kv, query.device)
    # Each block computes only the keys some of its rows may see (half the work under a causal mask).
    # Not under StableMask (its pseudo-slots sit on forbidden keys) nor for a recorder that keeps every key.
    narrow = mask.stable is None and not any(r.all_keys for r in recs)
    ranges = allow.ranges(rows, narrow)  # every block's key range, one host sync per mask
    # training, nobody recording: softpick's and sigmoid's weights in lean passes, the same numbers (engine.lean)
    fast = lean.weigher(kind) if (weigh is not None and torch.is_grad_enabled() and not recs and mask.stable is None
                                  and not run.interventions.at(layer)) else None
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
        block_allow = allow.rows(q0, q1)[..., k0:k1]
        probs = routes.block_probs(run, layer, mask, query[:, :, q0:q1], key[:, :, k0:k1], scaling, block_allow,
                             None if bias is None else bias[:, :, q0:q1, k0:k1], softcap, s_aux, q_pos[:, q0:q1],
                             kv_pos[:, k0:k1], q0, k0, recs, plain_causal and not head_mask,
                             weigh if fast is None else fast(block_allow))
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


def mask_builder(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, **kwargs):
    """Registered mask builder: during a run the attention function builds per-layer masks itself."""
    if current() is not None:
        return None
    kwargs["allow_is_causal_skip"] = False  # stock path may need an explicit mask (eager fallback)
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(KEY, attention)
AttentionMaskInterface.register(KEY, mask_builder)


def _all_full_attention(model) -> bool:
    """Qwen3-Next (its gated attention, docs/methods.md#attention-kinds) declares no attention backend because of its
    linear-attention layers; with every layer full attention, each one calls transformers' AttentionInterface."""
    config = model.config.get_text_config()
    return config.model_type == "qwen3_next" and set(getattr(config, "layer_types", None) or ()) == {"full_attention"}


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
    if not getattr(type(model), "_supports_attention_backend", False) and not _all_full_attention(model):
        raise ModelLoadError(
            f"{type(model).__name__} ({model.config.model_type}) computes attention in its own code, not "
            "through transformers' AttentionInterface, so attnviz cannot change or record its masks"
        )
    model.set_attn_implementation(KEY)
