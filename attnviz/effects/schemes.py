"""How each family makes a head's score, for score attribution (docs/methods.md#score-attribution).

A score is q_i · k_j · scaling with q = R_i (W_Q n(x_i) + b_Q) and k likewise; what differs between
families is the norm n, where the weights live, the rotation R and what the softmax sees of the score:

=========  ==========================  ====================  ============================================
family     norm n (scale frozen)       position              what else
=========  ==========================  ====================  ============================================
llama      γ ⊙ x / rms(x)              rotary, rotate_half   (SmolLM2 is one); Mistral and Qwen2 (q/k
mistral                                                      bias) alike
qwen2
phi3       γ ⊙ x / rms(x)              rotary (full only)    q and k are rows of the fused ``qkv_proj``
gemma2     (1 + γ) ⊙ x / rms(x)        rotary                the sources are the blocks' outputs after
                                                             their post-norms; the softmax sees
                                                             cap · tanh(s / cap) (logit soft-capping)
gpt_oss    γ ⊙ x / rms(x)              rotary, two halves    a learned sink logit per head joins each
                                       (the same pairing)    row's softmax; the MoE block is one source
gpt2       γ ⊙ (x − mean x) / σ(x) + β learned absolute      the position embedding is its own source,
                                                             "pos"; β's projection joins the bias
=========  ==========================  ====================  ============================================

Each scheme is read from the model's own modules; nothing is patched. A family not in the table,
or a variant of one whose scheme differs (a partial rotary dimension), is refused with one line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnviz.core import blocks as core_blocks
from attnviz.errors import InputError

ROTARY = ("llama", "mistral", "qwen2", "phi3", "gemma2", "gpt_oss")
FAMILIES = core_blocks.FAMILIES


@dataclass(frozen=True)
class Scheme:
    family: str

    @property
    def rotary(self) -> bool:
        """Rotary positions (else learned absolute positions, a source of their own)."""
        return self.family in ROTARY

    @property
    def position(self) -> str:
        return "rotary" if self.rotary else "learned absolute"


def scheme(loaded) -> Scheme:
    """The model's scheme, or an :class:`InputError` naming what is not supported."""
    config = loaded.model.config
    family = getattr(config, "model_type", "?")
    if family not in FAMILIES:
        raise InputError(f"score attribution supports {', '.join(FAMILIES)} models; {loaded.model_id} is {family}, "
                         "whose norm and position scheme is not worked out here")
    if family in ROTARY and float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise InputError(f"score attribution needs the rotation on every head dimension; {loaded.model_id} rotates "
                         f"only {config.partial_rotary_factor:.0%} of them (partial rotary), which is not worked out here")
    return Scheme(family)


def blocks(model, s: Scheme) -> torch.nn.ModuleList:
    return core_blocks.layers(model)


def source_modules(model, s: Scheme, layer: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The modules whose outputs are the attention and the MLP source of ``layer``: what the layer adds
    to the residual stream (:func:`attnviz.core.blocks.source_modules`)."""
    return core_blocks.source_modules(model, layer)


def first_row(out) -> torch.Tensor:
    """A hooked module's output for the batch's one text: attention and MoE blocks return tuples."""
    return core_blocks.output_tensor(out)[0].detach().float()


@torch.no_grad()
def embeddings(model, s: Scheme, ids: list[int], hidden0: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sources the residual stream starts from: the (scaled) token embedding, and for learned
    positions the token and the position embeddings apart (they sum to ``hidden0``)."""
    if s.family != "gpt2":
        return {"embed": hidden0}
    wte, wpe = model.transformer.wte, model.transformer.wpe
    device = wte.weight.device
    return {"embed": wte(torch.tensor(ids, device=device)).float(),
            "pos": wpe(torch.arange(len(ids), device=device)).float()}


@torch.no_grad()
def head_parts(model, s: Scheme, layer: int, head: int, n_heads: int, n_kv_heads: int, x: torch.Tensor) -> dict:
    """One head's weights and the layer's norm at its input ``x`` (n, hidden), float32:
    ``w_q``/``w_k`` (D, hidden), ``b_q``/``b_k`` (D or None), ``gamma``, ``beta`` (None but for LayerNorm),
    ``centre`` (LayerNorm subtracts each vector's mean), ``inv`` (n, 1) the norm's frozen 1/scale,
    ``scale`` the score's scaling, ``softcap`` (or None) and ``sink`` (the head's learned sink logit or None)."""
    block = blocks(model, s)[layer]
    part = {"softcap": None, "sink": None, "beta": None, "centre": False}
    if s.family == "gpt2":
        attn, norm = block.attn, block.ln_1
        d = attn.head_dim
        w, b = attn.c_attn.weight.float(), attn.c_attn.bias.float()  # Conv1D: (hidden, 3·hidden), y = x W + b
        hidden = w.shape[0]
        q_cols, k_cols = slice(head * d, (head + 1) * d), slice(hidden + head * d, hidden + (head + 1) * d)
        part.update(w_q=w[:, q_cols].T, w_k=w[:, k_cols].T, b_q=b[q_cols], b_k=b[k_cols],
                    gamma=norm.weight.float(), beta=norm.bias.float(), centre=True)
        scale = d ** -0.5 if attn.scale_attn_weights else 1.0
        if attn.scale_attn_by_inverse_layer_idx:
            scale /= float(layer + 1)
        part["scale"] = scale
        centred = x - x.mean(-1, keepdim=True)
        part["inv"] = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + norm.eps)
    else:
        attn, norm = block.self_attn, block.input_layernorm
        d = attn.head_dim
        kv = head // (n_heads // n_kv_heads)
        rows_q, rows_k = slice(head * d, (head + 1) * d), slice(kv * d, (kv + 1) * d)
        if s.family == "phi3":
            w = attn.qkv_proj.weight.float()
            w_q, w_k = w[:n_heads * d][rows_q], w[n_heads * d:(n_heads + n_kv_heads) * d][rows_k]
            b_q = b_k = None
        else:
            w_q, w_k = attn.q_proj.weight[rows_q].float(), attn.k_proj.weight[rows_k].float()
            b_q = attn.q_proj.bias[rows_q].float() if attn.q_proj.bias is not None else None
            b_k = attn.k_proj.bias[rows_k].float() if attn.k_proj.bias is not None else None
        gamma = norm.weight.float() + (1.0 if s.family == "gemma2" else 0.0)
        part.update(w_q=w_q, w_k=w_k, b_q=b_q, b_k=b_k, gamma=gamma, scale=float(getattr(attn, "scaling", d ** -0.5)))
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        part["inv"] = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        if s.family == "gemma2":
            part["softcap"] = getattr(attn, "attn_logit_softcapping", None)
        if s.family == "gpt_oss":
            part["sink"] = float(attn.sinks[head].detach())
    part["d"] = d
    return part


def normed(part: dict, v: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """The norm's linear part applied to a source ``v`` with the run's frozen scale ``inv`` (β not added:
    it is a constant, attributed to the bias)."""
    if part["centre"]:
        v = v - v.mean(-1, keepdim=True)
    return part["gamma"] * v * inv


def effective_bias(part: dict, side: str) -> torch.Tensor | None:
    """The constant of q (``side`` "q") or k: the projection's bias plus the projected norm bias β."""
    w, b = part[f"w_{side}"], part[f"b_{side}"]
    if part["beta"] is not None:
        b = w @ part["beta"] + (b if b is not None else 0)
    return b


@torch.no_grad()
def rotation(model, s: Scheme, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(cos, sin), each (n, D), in the ``rotate_half`` convention (gpt-oss's two-halves form has the same
    pairing: its (n, D/2) tables are repeated), or None for learned positions."""
    if not s.rotary:
        return None
    cos, sin = model.model.rotary_emb(x[None], torch.arange(n, device=x.device)[None])
    cos, sin = cos[0].float(), sin[0].float()
    if s.family == "gpt_oss":
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    return cos, sin


def frequencies(model, s: Scheme, half: int) -> list[float]:
    """θ_p of each rotary pair (radians per token, after the model's rope scaling); none for learned positions."""
    if not s.rotary:
        return []
    inv_freq = getattr(model.model.rotary_emb, "inv_freq", None)
    return inv_freq.float().tolist()[:half] if inv_freq is not None else [float("nan")] * half


def softmax_logits(part: dict, scores: torch.Tensor) -> torch.Tensor:
    """What the softmax sees of the scores: soft-capped where the family caps them."""
    cap = part["softcap"]
    return cap * torch.tanh(scores / cap) if cap else scores
