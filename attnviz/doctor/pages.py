"""What the deepest pages run, in the model's own dtype (docs/cli.md#check-attnviz-on-this-machine): score attribution
(the Why page), ``patch`` (its "Test it") and routes (the Routes page), each against an independent computation. Every
activation they read or replace is one of the engine's named sites (:mod:`attnviz.core.engine.sites`)."""

from __future__ import annotations

import numpy as np
import torch

from attnviz.core.model import precision
from attnviz.core.engine import sites
from attnviz.core.loading.models import LoadedModel
from attnviz.doctor.layers import layer_io, stock
from attnviz.doctor.report import Check

ATTRIBUTION_HALF = 0.02  # relative: attribution's sources against the captured score in half precision (docs/methods.md#devices)


def capabilities(loaded: LoadedModel, text: str) -> list[Check]:
    """The three deepest pages' arithmetic in the model's own dtype, on the doctor's short text
    (docs/cli.md#check-attnviz-on-this-machine): score attribution (the Why page), ``patch`` (its "Test it") and
    routes (the Routes page). Each is a PASS or FAIL against a limit that follows the dtype; a capability this
    model does not have (a family attribution cannot split) is a SKIP that says why."""
    from attnviz.errors import AttnvizError

    checks = []
    for check in (attribution_check, patch_check, routes_check):
        try:
            checks.append(check(loaded, text))
        except AttnvizError as err:  # the model's refusal (a family not split, a float16 overflow): not a defect
            checks.append(Check(check.__doc__.split(":")[0], "SKIP", detail=str(err)))
    return checks


def attribution_check(loaded: LoadedModel, text: str) -> Check:
    """score attribution: every head of the top layer, its sink key's score averaged over the queries that see it,
    split by source on the key side; the sources' sum against the score a capture records (pre-softmax, after a
    soft-cap's where the family caps)."""
    from attnviz.capture import capture
    from attnviz.effects.attribution import KeptForward
    from attnviz.plan import Keep
    from attnviz.stats import metrics

    dtype = loaded.model.dtype
    top = loaded.n_layers - 1
    cap = capture(loaded, text, "fwd", Keep(layers=[top], scores=True, storage_dtype=torch.float32))
    run = KeptForward(loaded, text, "fwd", upto=top)
    allowed = run.allowed(top).cpu().numpy()
    key = metrics.auto_key(allowed)
    scores = cap.layer_scores(top)
    worst = 0.0
    for head in range(loaded.n_heads):
        e = run.explain(top, head, "all", key)
        captured = float(scores[head][allowed[:, key], key].mean())
        made = e.softcapped_score if e.softcapped_score is not None else sum(e.key_sources.values())
        size = float(np.abs(scores[head][allowed]).mean())  # a score near 0 is held to the head's typical size
        worst = max(worst, abs(made - captured) / max(abs(captured), size, 1e-6))
    half = precision.half(dtype)
    limit = ATTRIBUTION_HALF if half else 1e-3
    why = (f"{limit:g} relative in {precision.name(dtype)}: the split is computed in float32 from the run's own "
           "activations, the captured score from the run's rounded queries and keys" if half else
           "1e-3 relative in float32: two float32 routes to one score (the split's sum and the engine's product)")
    return Check.against("score attribution: the sources sum to the captured score", worst, limit, why=why,
                         compared=f"the top layer's {loaded.n_heads} heads at their sink key {key}, averaged over every "
                                  "query that sees it: the key side's sources summed, and the engine's pre-softmax "
                                  "score; relative to the score, or to the head's mean |score| where that is larger")


def _zero_first(value: torch.Tensor) -> torch.Tensor:
    value = value.clone()
    value[:, 0] = 0
    return value


def patch_check(loaded: LoadedModel, text: str) -> Check:
    """patch: the MLP's write at the first token removed in the middle layer by attnviz's ``patch`` against the same
    write removed at the site ``mlp_out`` of stock transformers' forward; the last layer's output compared."""
    from attnviz.core import engine
    from attnviz.recipe import build
    from attnviz.tokens import tokenize

    model = loaded.model
    layer = loaded.n_layers // 2
    built = build(loaded, "fwd", intervene=f"patch(block=mlp, tokens=0)@{layer}")
    ids, _ = tokenize(loaded, text)
    built.check_text(len(ids))
    with torch.no_grad():
        _, hidden, _ = built.forward(loaded, torch.tensor([ids]), engine.Record(frozenset()),
                                     engine.Feed(hidden_states=True, last_logits_only=True))
    ours = hidden[-1][0].float().cpu()
    with sites.hooks(model, [(sites.Site("mlp_out", layer), _zero_first)]), torch.inference_mode():
        out = model(torch.tensor([ids], device=model.device), output_hidden_states=True)
    theirs = out.hidden_states[-1][0].float().cpu()
    worst = float((ours - theirs).norm() / theirs.norm().clamp(min=1e-30))
    limit, why = precision.tolerance(model.dtype)
    if precision.half(model.dtype):  # the forward above the patch runs through every layer: drift, not one layer
        limit = precision.decomposition_tolerance(model.dtype)
        why = (f"{limit:.3g} relative in {precision.name(model.dtype)}: four steps, since both forwards run every "
               "layer above the patch through SDPA and may round apart")
    return Check.against("patch: equal to a stock forward hook (relative)", worst, limit, why=why,
                         compared=f"the last hidden state with layer {layer}'s MLP write zeroed at token 0, by attnviz's "
                                  "patch and by a forward hook on stock transformers; relative to its norm")


def routes_check(loaded: LoadedModel, text: str) -> Check:
    """routes: one layer's contributions (every query, source token and head) from a trace against their written-out
    definition (docs/methods.md#contributions), made from stock eager's probabilities, the layer's values and
    streams, each write W_O·A_ij·v_j written out in full."""
    from attnviz.capture import capture
    from attnviz.core.model import anatomy
    from attnviz.core.model.modules import output_projection
    from attnviz.effects.schemes import norm_form
    from attnviz.flow import contributions
    from attnviz.flow.trace import trace
    from attnviz.plan import Keep

    model = loaded.model
    layer = loaded.n_layers // 2
    L = anatomy.of(model)[layer]
    with layer_io(model) as ours:
        flow = trace(loaded, text, "fwd", floor=0.0)
    feed = {layer: ours.inputs[layer]}
    seen: dict = {}

    def read(name: str):
        return sites.save(seen, name, first_row=True, host=True, dtype=torch.float32)

    post_norm = L.attn_write is not L.attn
    kept = [(sites.Site("attn_out", layer), read("write"))]  # the write as the stream adds it (L.scale included)
    if post_norm:
        kept.append((sites.Site("attn_block", layer), read("o")))  # what the post-norm reads
    if not L.parallel:
        kept.append((sites.Site("resid_mid", layer), read("y")))
    with sites.hooks(model, kept):
        maps, io = stock(loaded, flow.token_ids, feed=feed)
    with layer_io(model, feed=feed):
        qkv = capture(loaded, text, "fwd", Keep(layers=[layer], qkv=True, storage_dtype=torch.float32)).layer_qkv(layer)
    x, out = io.inputs[layer][0].float().cpu(), io.outputs[layer][0].float().cpu()
    y = seen["y"] if "y" in seen else x + seen["write"]
    probs = torch.from_numpy(maps[layer])  # (H, n, n)
    n_heads, n = probs.shape[0], probs.shape[-1]
    v = torch.from_numpy(qkv.v).float()  # (H_kv, n, d)
    w = output_projection(L.attn).detach().float().cpu()  # (D, H d)
    width, d = w.shape[0], v.shape[-1]
    w = w.view(width, n_heads, d)
    c = torch.full((n,), float(L.scale))
    if post_norm:  # a post-norm: its gain folded in, its scale frozen per token
        post = norm_form(L.attn_write, width, f"layer {layer}'s post-attention norm")
        c = c * post.inv(seen["o"])[:, 0].cpu()
        w = w * post.gamma.cpu()[:, None, None]
        if post.centre:
            w = w - w.mean(0, keepdim=True)
    writes = torch.einsum("hqk,q,hkd,xhd->hqkx", probs, c, v.repeat_interleave(n_heads // v.shape[0], 0), w)
    parts = torch.cat([x[None], writes.permute(0, 2, 1, 3).reshape(-1, n, width)])
    expected = contributions.proximity(parts, y)[1:].view(n_heads, n, n).permute(2, 1, 0).numpy()  # (q, k, h)
    got = flow.layers[layer].dense(n_heads, n)
    worst = float(np.abs(got - expected).max())
    dtype = model.dtype
    limit = max(1e-4, precision.decomposition_tolerance(dtype))
    why = ("1e-4 in float32 (docs/methods.md#devices)" if not precision.half(dtype) else
           f"{limit:.3g} in {precision.name(dtype)}: four steps, since the trace's probabilities and stock eager's "
           "round apart by up to two")
    return Check.against("routes: equal to the written-out definition on one layer", worst, limit, why=why,
                         compared=f"layer {layer}'s contribution of every (query, source token, head), from a trace and "
                                  "written out in full from stock eager's probabilities, fed the same layer input")
