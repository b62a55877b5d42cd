"""A layer's attention output and every row's log-sum-exp from one attention kernel, the one the forward runs
anyway: what the fused statistics kernel (:mod:`attnviz.core.kernel.kernels`) reads so that it passes over QKᵀ
once. Which kernel gives them, and when cuDNN's are trusted (:func:`cudnn_agrees`), is decided here."""

from __future__ import annotations

import functools

import torch

from attnviz import settings
from attnviz.core.model import devices


def attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allow: torch.Tensor | None,
                       scaling: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's attention output (B, H, n_q, d) and every row's log-sum-exp (B, H, n_q) from one attention kernel,
    the one the forward runs anyway: on the CPU ``_scaled_dot_product_flash_attention_for_cpu``; on CUDA cuDNN's or
    flash attention (causal, half precision) or the memory-efficient kernel (any mask, any dtype), which compute the
    log-sum-exp for their backward: the statistics kernel then passes over QKᵀ once. ``allow`` (B, 1, n_q, n_kv)
    bool, or None with ``causal``. Where no such kernel runs (another device, a shape it refuses) or
    the settings say no (``fused_lse``, ``ATTNVIZ_FUSED_LSE=0``), the output comes from SDPA and the log-sum-exp is None (the kernel finds it itself)."""
    import torch.nn.functional as F

    heads, kv_heads, n_q = query.shape[1], key.shape[1], query.shape[2]

    def plain():
        mask = None if causal else allow
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal, scale=scaling,
                                              enable_gqa=heads != kv_heads), None

    # ROCm reports "cuda" too, and whether its kernels' log-sum-exp is natural was not checked: two passes there
    if (not settings.active().fused_lse or query.device.type not in ("cpu", "cuda")
            or getattr(torch.version, "hip", None)):
        return plain()
    if heads != kv_heads:  # these kernels take one key head per query head
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    bias = None
    if not causal:  # an additive mask, one row of keys per query, expanded (not copied) over the heads
        n_kv = allow.shape[-1]
        bias = torch.zeros(allow.shape[0], 1, n_q, n_kv + (-n_kv % 16), dtype=query.dtype, device=query.device)
        bias[..., n_kv:] = float("-inf")  # rows padded to 16 keys: the memory-efficient kernel reads aligned rows
        bias = bias[..., :n_kv].masked_fill_(~allow, float("-inf")).expand(-1, heads, -1, -1)
    ops = torch.ops.aten
    if query.device.type == "cpu":
        tries = [lambda: ops._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, attn_mask=bias,
                                                                         scale=scaling)]
    else:
        tries = []
        if causal and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256:
            # what SDPA itself runs on Hopper: the forward's own cost
            if settings.active().cudnn and cudnn_agrees(query.device, query.dtype):
                tries.append(lambda: ops._scaled_dot_product_cudnn_attention(query, key, value, None, True, 0.0, True,
                                                                            False, scale=scaling))
            tries.append(lambda: ops._scaled_dot_product_flash_attention(query, key, value, 0.0, True, False,
                                                                        scale=scaling))
        tries.append(lambda: ops._scaled_dot_product_efficient_attention(query, key, value, bias, True, 0.0, causal,
                                                                        scale=scaling))
    for attempt in tries:  # flash where it applies, else (or where this GPU refuses it) memory-efficient attention
        try:
            out, lse = attempt()[:2]
        except (RuntimeError, NotImplementedError) as err:  # a shape, dtype or GPU this build's kernels refuse
            if devices.is_out_of_memory(err):
                raise
            continue
        lse = lse if lse.dim() == 3 else lse.reshape(lse.shape[0], lse.shape[1], -1)  # cuDNN's: (B, H, n, 1)
        return out, (lse if lse.shape[-1] == n_q else lse[..., :n_q]).float()
    return plain()


@functools.cache
def cudnn_agrees(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether cuDNN's attention runs here and gives what flash attention gives, the output and every row's natural
    log-sum-exp, on two small causal cases, one with a key of massive scores, head dims 64 and 128 (once a process,
    per device and dtype; cuDNN before 9.3 got large scores wrong): only then does a layer take its
    log-sum-exp from cuDNN. Nothing documents the layout and base of cuDNN's statistics as flash attention's are,
    so they are checked where they are used. The settings' ``cudnn`` (``ATTNVIZ_CUDNN=0``) says no at the call."""
    if device.type != "cuda" or getattr(torch.version, "hip", None):
        return False
    ops = torch.ops.aten
    gen = torch.Generator(device=device).manual_seed(0)
    try:
        # a plain case, and one with a sink: a key whose scores are massive (the activations this project measures)
        for n, d, sink in ((80, 64, 0.0), (200, 128, 40.0)):
            q, k, v = (torch.randn(1, 2, n, d, device=device, generator=gen) for _ in range(3))
            k[:, :, 0] *= 1.0 + sink
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            scale = d ** -0.5
            out, lse = ops._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)[:2]
            ref_out, ref_lse = ops._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[:2]
            lse = lse.reshape(1, 2, -1)[..., :n].float()
            if not (torch.allclose(lse, ref_lse[..., :n].float(), atol=1e-3, rtol=1e-3)
                    and torch.allclose(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)):
                return False
        return True
    except (RuntimeError, NotImplementedError):
        return False


def sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sink: torch.Tensor,
                   allow: torch.Tensor | None, scaling: float, causal: bool) -> torch.Tensor:
    """Softmax attention with one more logit per head outside the keys (a learned sink, or ``sink(logit=s)``), its
    autograd graph kept: (B, H, n_q, d). A row's weights exp(z_j) / (exp(s) + Σ_k exp(z_k)) are the softmax's times
    Σ exp(z) / (exp(s) + Σ exp(z)) = σ(lse − s), lse the row's log-sum-exp over the keys it may see, so the output
    is SDPA's times σ(lse − s) (docs/methods.md#learned-sinks), exact: no n_q × n_kv weights are made. ``sink``
    (H,) the logits (a parameter: its gradient is computed), ``allow`` (B, 1, n_q, n_kv) bool, or None with
    ``causal``. On the CPU in float32 and float64 the output and lse come from one flash kernel, the gradient from its
    backward (:class:`_SinkAttention`); elsewhere the output from SDPA and lse from the scores (one b × n pass)."""
    import torch.nn.functional as F

    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads:  # the CPU's kernels take one key head per query head
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    s = sink.reshape(1, -1, 1, 1)
    if query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64):
        bias = None if causal else torch.zeros(allow.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~allow, float("-inf")).expand(-1, heads, -1, -1)
        try:
            return _SinkAttention.apply(query, key, value, s.to(query.dtype), bias, scaling, causal)
        except (RuntimeError, NotImplementedError):  # a build whose CPU kernel refuses it: the plain way below
            pass
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=None if causal else allow, is_causal=causal,
                                         scale=scaling)
    wide = torch.promote_types(query.dtype, torch.float32)  # lse in float32 at least
    z = torch.matmul(query.to(wide) * scaling, key.to(wide).transpose(-1, -2))
    if causal:
        n_q, n_kv = z.shape[-2:]
        allow = torch.ones(n_q, n_kv, dtype=torch.bool, device=z.device).tril(n_kv - n_q)
    lse = z.masked_fill(~allow, float("-inf")).logsumexp(-1, keepdim=True)
    return out * torch.sigmoid(lse - s.to(wide)).to(out.dtype)


class _SinkAttention(torch.autograd.Function):
    """:func:`sink_attention` on the CPU: the output and lse from ``_scaled_dot_product_flash_attention_for_cpu``,
    whose lse carries no gradient of its own; the backward adds it. With y = o·g, g = σ(lse − s) a row's scalar:
    ∂L/∂o = ∂L/∂y·g, ∂L/∂lse = (∂L/∂y · o)·g(1 − g) = −∂L/∂s per row. The flash backward computes a score's gradient
    as P_ij (dO_i·v_j − D_i) with D_i = dO_i·O_i read from the output it is given; lse's adds P_ij ∂L/∂lse_i, so each
    of dO, O, Q, K and V gets one more column (∂L/∂lse_i, −1, 0, 0, 0): D_i becomes D_i − ∂L/∂lse_i and nothing else
    changes (tests/test_routes.py checks every gradient against the explicit softmax's, in float64)."""

    @staticmethod
    def forward(ctx, query, key, value, s, bias, scaling, causal):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, attn_mask=bias, scale=scaling)[:2]
        gate = torch.sigmoid(lse.unsqueeze(-1) - s)
        ctx.save_for_backward(query, key, value, out, lse, gate, bias)
        ctx.scaling, ctx.causal = scaling, causal
        return out * gate

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse, gate, bias = ctx.saved_tensors
        d_lse = (grad * out).sum(-1, keepdim=True) * gate * (1 - gate)

        def column(t, value):  # t with one more column of ``value`` (a number or a (..., 1) tensor)
            return torch.cat([t, t.new_full(t.shape[:-1] + (1,), value) if isinstance(value, float) else value], -1)

        d_q, d_k, d_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            column(grad * gate, d_lse), column(query, 0.0), column(key, 0.0), column(value, 0.0), column(out, -1.0),
            lse, 0.0, ctx.causal, attn_mask=bias, scale=ctx.scaling)
        d_s = -d_lse.sum((0, 2), keepdim=True) if ctx.needs_input_grad[3] else None
        return d_q[..., :-1], d_k[..., :-1], d_v[..., :-1], d_s, None, None, None
