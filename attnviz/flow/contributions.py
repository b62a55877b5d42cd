"""Proximity contributions (docs/methods.md#contributions): how much each part of a sum in the residual stream
makes the sum what it is, as Ferrando & Voita (2024) define it with the L1 distance.

For a sum ``y = Σ_k x_k`` (plus constants that are no part: biases), part k's raw contribution is
``max(‖y‖₁ − ‖y − x_k‖₁, 0)``; the raw contributions of one sum are normalised to add up to 1.

After a layer's attention the parts are the stream before it and every head's write from every source token,
``c_i · A_ij · W̃ v_j`` (``W̃`` the head's slice of the output projection with the post-norm's gain folded in, ``c_i``
the layer's residual scale over the post-norm's frozen scale of query i). Written out, that is an (n, n, H, d)
tensor per layer. It is never made here: with ``s = sign(y)`` (+1 at zero),

    ‖y‖₁ − ‖y − t‖₁ = Σ_d s_d t_d − 2 Σ_d max(s_d t_d − |y_d|, 0),

so the first sum is one matrix product per head, ``c_i A_ij (s_i W̃)·v_j``, and the second is non-zero only on the
few dimensions d where a single part outweighs the whole stream (``s_d t_d > |y_d|``): a row's few heaviest sources
are checked in every dimension, more of them and then all only where a bound (the next weight times the largest
write of any source in d) says one may pass. Both are computed exactly, a block at a time. The result equals the written-out computation to
rounding (tests/test_flow.py checks it against stock transformers' hooks on several families).
"""

from __future__ import annotations

import numpy as np
import torch

from attnviz import settings

CANDIDATES = 1 << 22  # floats of the exact correction made at once on the CPU (16 MB)
# on a GPU, 128 MB at once: each chunk is a dozen kernel launches, and launches, not arithmetic, bound routes there
# (docs/gpu.md); at 1,024 tokens the default model's first tier is then one chunk a layer instead of six
DEVICE_CANDIDATES = 1 << 25
TOP = 4  # a row's heaviest sources, corrected in every (query, dimension) pair
WIDER = (16, 64)  # the next tiers' widths, for the pairs where the bound says a key past the tier before may pass


def proximity(parts: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The written-out definition: ``parts`` (P, ..., d) of ``whole`` (..., d) → normalised (P, ...) contributions.
    The reference the fast paths are tested against (and the MLP's two parts use: nothing n² there)."""
    raw = (whole.abs().sum(-1) - (whole - parts).abs().sum(-1)).clamp(min=0)
    return normalised(raw, raw.sum(0))


def normalised(raw: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``raw / total``, 0 where nothing contributes (a zero stream)."""
    return torch.where(total > 0, raw / total.clamp(min=torch.finfo(raw.dtype).tiny), 0.0)


def inverse(total: torch.Tensor) -> torch.Tensor:
    """``1 / total``, 0 where nothing contributes: :func:`normalised` of ones, in fewer operations."""
    return torch.where(total > 0, total.clamp(min=torch.finfo(total.dtype).tiny).reciprocal(), 0.0)


def as_float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32, without a call where it is already (on a GPU each call is the host's work)."""
    return tensor if tensor.dtype == torch.float32 else tensor.float()


def kept_entries(raw: torch.Tensor, inv: torch.Tensor, floor: float):
    """A layer's normalised attention contributions at or above ``floor``: ``raw`` (H, n, n_kv) times ``inv`` (n,)
    (1 / each query's total). Returns numpy ``(index (K, 3) as (query, source, head), weight (K,), sum_index (K', 2)
    as (query, source), sum_weight (K',))``, the second pair for the heads summed; entries in (head, query, source)
    and (query, source) order. On the CPU in float32 one compiled pass (:mod:`attnviz.flow.kernel`), else torch."""
    kernel = _compiled(raw)
    if kernel is not None:
        index, weight, sum_index, sum_weight = kernel.kept(raw.contiguous().numpy(), inv.float().contiguous().numpy(),
                                                           floor)
        return index[:, [1, 2, 0]].astype(np.int32), weight, sum_index.astype(np.int32), sum_weight
    return kept_entries_torch(raw, inv, floor)


def kept_entries_torch(raw: torch.Tensor, inv: torch.Tensor, floor: float):
    """:func:`kept_entries` in torch operations (any device); ``raw`` is scaled in place."""
    heads, summed, over, sum_over = scaled_and_kept(raw, inv, floor)
    h, i, j = torch.nonzero(over, as_tuple=True)
    indices, weights = joined(heads, summed, (h, i, j), torch.nonzero(sum_over, as_tuple=True))
    # two copies to the host (each waits for the device), not four: the indices together, the weights together
    return split_kept(indices.cpu().numpy(), weights.cpu().numpy(), h.numel())


def scaled_and_kept(raw: torch.Tensor, inv: torch.Tensor, floor: float):
    """A layer's normalised contributions ``raw`` (H, n, n_kv) times ``inv`` (n,), in place (one pass over the
    layer), their sum over heads, and where each is at or above ``floor``."""
    heads = raw.mul_(inv[None, :, None])
    summed = heads.sum(0)
    return heads, summed, heads >= floor, summed >= floor


def joined(heads: torch.Tensor, summed: torch.Tensor, hij, sij) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept entries at ``hij`` (head, query, source) and, heads summed, at ``sij`` (query, source), as two
    tensors for the host: every index (query, source, head, then query, source) in one int32 tensor, every weight in
    one. :func:`split_kept` takes them apart."""
    h, i, j = hij
    si, sj = sij
    indices = torch.cat((torch.stack((i, j, h), 1).flatten(), torch.stack((si, sj), 1).flatten())).int()
    return indices, torch.cat((heads[h, i, j], summed[si, sj]))


def split_kept(indices: np.ndarray, weights: np.ndarray, k: int):
    """:func:`joined`'s arrays on the host, ``k`` of them per head: (index (k, 3), weight (k,), sum_index (K', 2),
    sum_weight (K',)), as :func:`kept_entries` returns them."""
    return indices[:3 * k].reshape(k, 3), weights[:k], indices[3 * k:].reshape(-1, 2), weights[k:]


def raw_part(part: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """One part's raw contribution, ``max(‖y‖₁ − ‖y − x‖₁, 0)`` over the last dimension."""
    return (whole.abs().sum(-1) - (whole - part).abs().sum(-1)).clamp(min=0)


@torch.no_grad()
def attention_raw(y: torch.Tensor, probs: torch.Tensor, value: torch.Tensor, w_out: torch.Tensor,
                  c: torch.Tensor) -> torch.Tensor:
    """Raw contributions (H, n_q, n_kv) of every head's write from every source token to the stream ``y``.

    ``y`` (n_q, D) the stream after the attention, ``probs`` (H, n_q, n_kv), ``value`` (H_kv, n_kv, d),
    ``w_out`` (H, D, d) each head's output projection (post-norm gain folded in), ``c`` (n_q,) the per-query factor.
    Everything float32 on one device; nothing (n_q, n_kv, D) is made. On the CPU the correction runs as one
    compiled loop (:mod:`attnviz.flow.kernel`) where numba is installed; elsewhere, :func:`attention_raw_torch`."""
    if on_gpu(y):  # looked up at the call: the tests route a CPU tensor here, through Triton's interpreter
        return attention_raw_triton(y, probs, value, w_out, c)
    if _compiled(y) is not None:
        return attention_raw_compiled(y, probs, value, w_out, c)
    return attention_raw_torch(y, probs, value, w_out, c)


def on_gpu(tensor: torch.Tensor) -> bool:
    """Whether routes take the GPU's one-pass route for ``tensor``: a CUDA tensor with Triton installed (ROCm and
    other devices keep the torch path), unless the kernels are switched off: by the thread's choice
    (:func:`attnviz.core.engine.routes.forcing`, which wins) or else by the settings' ``fused``
    (``ATTNVIZ_FUSED=0``), as for the statistics kernel (:func:`attnviz.core.kernel.kernels.wanted`)."""
    from attnviz.core.engine.routes import forced_fused
    from attnviz.core.kernel import kernels

    forced = forced_fused()
    return (tensor.device.type == "cuda" and not getattr(torch.version, "hip", None) and kernels.available()
            and (forced if forced is not None else settings.active().fused is not False))


ROUTE_TILE = (64, 64, 16)  # queries and keys a program of the routes kernel takes, stream dimensions a bound tests
ROUTE_WARPS = 8  # at 4, a 64 x 64 tile takes every register a thread has (255; 8: no spill either way)
ROUTE_SKIP = True  # skip the blocks of dimensions no key can pass (off: the cost on any weights, bench/routes.py)


#: what :func:`attnviz.core.kernel.kernels.compiled_resources` compiles for a variant that names it (``build``)
RESOURCES = "attnviz.flow.contributions:kernel_resources"


def kernel_resources(capability: int = 90) -> dict:
    """The routes kernel (:mod:`attnviz.flow._triton_routes`) compiled ahead of time for an NVIDIA GPU of
    ``capability``, at its launch's tile: what ptxas allocates (:func:`attnviz.core.kernel._kernel_build.read`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from attnviz.core.kernel._kernel_build import read
    from attnviz.flow._triton_routes import raw_tile

    bm, bn, bd = ROUTE_TILE
    constants = {"BM": bm, "BN": bn, "BD": bd, "SKIP": ROUTE_SKIP}
    signature = {name: "constexpr" if name in constants else "*fp32" if name.endswith("_ptr") else "i32"
                 for name in raw_tile.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(raw_tile.arg_names) if name.endswith("_ptr")}
    compiled = triton.compile(ASTSource(raw_tile, signature, constants, attrs), target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": ROUTE_WARPS})
    return read(compiled, capability, ROUTE_WARPS)



@torch.no_grad()
def attention_raw_triton(y, probs, value, w_out, c) -> torch.Tensor:
    """:func:`attention_raw` as one Triton pass over the layer (:mod:`attnviz.flow._triton_routes`): the linear part
    is one batched matrix product, then each (head, query, key) tile is weighted and corrected in registers, no
    host wait and nothing (n_q, n_kv, D) in memory. A CUDA device's route; on a CPU it runs in Triton's interpreter
    (the tests)."""
    from attnviz.flow._triton_routes import raw_tile

    n_heads, n_q, n_kv = probs.shape
    group = n_heads // value.shape[0]
    v = as_float32(value.repeat_interleave(group, 0) if group > 1 else value)  # (H, n_kv, d)
    w_out = as_float32(w_out)
    sign = as_float32(torch.where(y >= 0, 1.0, -1.0))  # torch's default dtype, float32 unless a user changed it
    raw = torch.matmul(torch.matmul(sign, w_out), v.transpose(1, 2)).contiguous()  # (s_i · W̃ v_j), then in place
    written = torch.matmul(w_out, v.transpose(1, 2)).contiguous()  # (H, D, n_kv): W̃ v_j by dimension
    hi, lo = written.amax(2).contiguous(), written.amin(2).contiguous()
    bm, bn, bd = ROUTE_TILE
    raw_tile[(n_heads, -(-n_q // bm), -(-n_kv // bn))](
        raw, raw, as_float32(probs).contiguous(), as_float32(c).contiguous(), written, sign.t().contiguous(),
        as_float32(y).abs().t().contiguous(), hi, lo, n_q, n_kv, y.shape[1], BM=bm, BN=bn, BD=bd, SKIP=ROUTE_SKIP,
        num_warps=ROUTE_WARPS)
    return raw


def _kernel():
    """:mod:`attnviz.flow.kernel`, or None where numba cannot be imported."""
    try:
        from attnviz.flow import kernel
    except ImportError:  # no numba wheel for this platform: the torch path, same numbers
        return None
    return kernel


def _compiled(tensor: torch.Tensor):
    """The compiled loops' module where they take ``tensor`` (float32 on the CPU, numba installed), else None."""
    return _kernel() if tensor.device.type == "cpu" and tensor.dtype == torch.float32 else None


@torch.no_grad()
def attention_raw_compiled(y, probs, value, w_out, c) -> torch.Tensor:
    """:func:`attention_raw` with the correction as the compiled loop (CPU, float32): the linear part is one batched
    matrix product, the rest one pass per (head, query) row."""
    n_heads = probs.shape[0]
    group = n_heads // value.shape[0]
    v = (value.repeat_interleave(group, 0) if group > 1 else value).float()  # (H, n_kv, d)
    w_out = w_out.float()
    sign = torch.where(y >= 0, 1.0, -1.0)
    out = torch.matmul(torch.matmul(sign * c[:, None], w_out), v.transpose(1, 2)).contiguous()  # c_i s_i · W̃ v_j
    rows = torch.matmul(v, w_out.transpose(1, 2)).contiguous()  # (H, n_kv, D): each source's write before its weight
    hi, lo = rows.amax(1).contiguous(), rows.amin(1).contiguous()
    _kernel().raw_contributions(out.numpy(), probs.float().contiguous().numpy(), c.float().contiguous().numpy(),
                                rows.numpy(), hi.numpy(), lo.numpy(), y.float().contiguous().numpy())
    return out


@torch.no_grad()
def attention_raw_torch(y: torch.Tensor, probs: torch.Tensor, value: torch.Tensor, w_out: torch.Tensor,
                        c: torch.Tensor) -> torch.Tensor:
    """:func:`attention_raw` in torch operations on any device: every head at once (batched products), the
    correction in tiers of gathers over all heads' rows together (:func:`_correct`), so a layer waits for the device
    once a tier, not once a head (profiled on an H200, docs/gpu.md: each ``nonzero`` a device sync, 0.08 s of
    0.45 s at 1,024 tokens)."""
    n_heads = probs.shape[0]
    group = n_heads // value.shape[0]
    v = value.repeat_interleave(group, 0) if group > 1 else value  # (H, n_kv, d)
    sign = torch.where(y >= 0, 1.0, -1.0)
    size = y.abs()
    a = probs * c[None, :, None]  # (H, n_q, n_kv): c_i A_ij
    raw = torch.matmul(torch.matmul(sign[None], w_out), v.transpose(1, 2)).mul_(a)  # c_i A_ij (s_i · W̃ v_j)
    _correct(raw, a, torch.matmul(w_out, v.transpose(1, 2)), sign, size)  # (H, D, n_kv): W̃ v_j by dimension
    return raw.clamp_(min=0)


def chunk_floats(device: torch.device) -> int:
    """How many floats of the correction :func:`_correct` makes at once on ``device`` (see :data:`CANDIDATES`)."""
    return CANDIDATES if device.type == "cpu" else DEVICE_CANDIDATES


def _correct(raw: torch.Tensor, a: torch.Tensor, written: torch.Tensor, sign: torch.Tensor, size: torch.Tensor) -> None:
    """Subtract 2 Σ_d max(s_d t_d − |y_d|, 0) from ``raw`` (H, n_q, n_kv) in place, t = a_ij · written_j (``written``
    (H, D, n_kv): each head's writes by dimension), every head's rows at once.

    In tiers, each exact, each adding the keys the one before left out. First, every (row, dimension) pair with the
    row's :data:`TOP` heaviest keys. Then only the pairs where the next weight times the largest write of any source
    along the stream's sign may still pass the stream (a few in a hundred): the row's next heaviest keys, up to each
    width of :data:`WIDER`, while that bound says a key past them may pass; after the last, every other key. A row r
    is head r // n_q's query r % n_q."""
    n_heads, n_q, n_kv = a.shape
    width = written.shape[1]
    rows_all = n_heads * n_q
    raw, a = raw.view(rows_all, n_kv), a.reshape(rows_all, n_kv)
    index = torch.arange(rows_all, device=a.device)
    head, query = index // n_q, index % n_q
    sign, size = sign[query], size[query]  # (R, D): each row's stream
    bound = torch.where(sign > 0, written.amax(2)[head], written.amin(2).neg_()[head])  # (R, D): the largest write
    rows_of = written.transpose(1, 2).reshape(n_heads * n_kv, width)  # (H n_kv, D): each head's sources' writes
    offset = (head * n_kv)[:, None]  # a row's sources in ``rows_of``
    tiers = [t for t in (TOP, *WIDER) if t < n_kv]
    first = tiers[0] if tiers else n_kv
    weights, keys = a.topk(tiers[-1] + 1 if tiers else n_kv, dim=1)  # each row's heaviest keys, once
    candidates = chunk_floats(a.device)
    step = max(1, candidates // (first * width))
    for q0 in range(0, rows_all, step):  # the row's heaviest keys, in every dimension
        q = slice(q0, q0 + step)
        over = rows_of[keys[q, :first] + offset[q]]  # (rows, first, D), made once and worked in place
        over.mul_(weights[q, :first, None]).mul_(sign[q, None, :]).sub_(size[q, None, :]).clamp_(min=0)
        raw[q].scatter_add_(1, keys[q, :first], over.sum(-1).mul_(-2.0))
    if not tiers:
        return
    rows, dims = torch.nonzero(weights[:, first, None] * bound > size, as_tuple=True)  # a key past them may pass
    flat, flat_raw, done = rows_of.view(-1), raw.view(-1), first
    for take in tiers[1:] + [None]:
        if rows.numel() == 0:
            return
        step = max(1, candidates // ((take or n_kv) - done))
        for s in range(0, rows.numel(), step):
            r, d = rows[s:s + step], dims[s:s + step]
            if take is None:  # every key the tiers before left out
                over = a[r].mul_(written[head[r], d]).mul_(sign[r, d, None]).sub_(size[r, d, None]).clamp_(min=0)
                raw.index_add_(0, r, over.scatter_(1, keys[r, :done], 0.0), alpha=-2.0)
            else:  # the row's next heaviest keys
                ks = keys[r, done:take]  # (pairs, take - done)
                over = flat[(ks + offset[r]) * width + d[:, None]]
                over.mul_(weights[r, done:take]).mul_(sign[r, d, None]).sub_(size[r, d, None]).clamp_(min=0)
                flat_raw.index_add_(0, (r[:, None] * n_kv + ks).flatten(), over.flatten(), alpha=-2.0)
        if take is not None:
            later = weights[rows, take] * bound[rows, dims] > size[rows, dims]  # a key past these may pass
            rows, dims, done = rows[later], dims[later], take
