"""A model's attention modules and their output projection, read from the model anatomy
(:mod:`attnviz.core.model.anatomy`): what the value-weighted view and the head classes need."""

from __future__ import annotations

import torch

from attnviz.errors import InputError, ModelLoadError


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


def projection(module, which: str) -> torch.nn.Module:
    """The attention's own query or key projection (``which``: "q" or "k"), a Linear that computes that alone
    (``q_proj`` / ``k_proj``); or a clear refusal where the family computes them together with the values
    (``qkv_proj``, ``query_key_value``, ``c_attn``, a low-rank ``kv_a_proj``): its input is then not the
    queries' or the keys' alone."""
    proj = getattr(module, f"{which}_proj", None)
    if isinstance(proj, torch.nn.Linear):
        return proj
    fused = [name for name, _ in module.named_children() if name.endswith(("qkv_proj", "query_key_value", "c_attn",
                                                                             "kv_a_proj_with_mqa", "q_a_proj"))]
    how = f" ({', '.join(fused)})" if fused else ""
    raise InputError(f"{type(module).__name__} has no projection of the {'queries' if which == 'q' else 'keys'} "
                     f"alone{how}: what it reads is shared with the values, so it is not a site of its own")


def _weight(proj) -> torch.Tensor:
    """W_O as (hidden, heads * head_dim) of a Linear or a Conv1D (which stores it transposed)."""
    return proj.weight if isinstance(proj, torch.nn.Linear) else proj.weight.T


def output_projection(module) -> torch.Tensor:
    """The attention's output projection W_O as (hidden, heads * head_dim)."""
    return _weight(output_linear(module))


def attention_modules(model) -> list:
    """The model's self-attention modules, bottom layer first: the anatomy's (:mod:`attnviz.core.model.anatomy`), or by
    name (``self_attn``, ``.attn``) for a model it does not map (an encoder-decoder)."""
    from attnviz.core.model import anatomy

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
    # ||W v||² = vᵀ (WᵀW) v: each head's d × d Gram matrix instead of every key's (hidden,) output, so the
    # temporary is (B, H, n, d), not (B, H, n, hidden) (680 MB at 32k tokens on the default model)
    gram = torch.einsum("ohd,ohe->hde", per_head, per_head)  # (H, d, d)
    v = value.float().repeat_interleave(n_heads // n_kv_heads, dim=1)  # (B, H, n, d)
    return torch.einsum("bhnd,hde,bhne->bhn", v, gram, v).clamp(min=0).sqrt()
