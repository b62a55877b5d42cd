"""How a head makes its score, for score attribution (docs/methods.md#score-attribution), read from the model.

A score is q_i · k_j · scaling with, on each side,

    q_i = R_i( g_q ⊙ inv_q(i) ⊙ (W_q · n(x_i) + b_q) + β_q )         n(x) = γ ⊙ c(x) · inv(i) + β

where n is the layer's input norm (RMS, Gemma's 1 + w, or LayerNorm with its centring c; none in OLMo 2 and
Exaone 4), W_q, b_q the head's rows of the query projection (whatever its layout: separate, fused as Phi-3's
``qkv_proj`` or GPT-NeoX's ``query_key_value``, a Conv1D as GPT-2's), g_q, β_q a q/k norm (Qwen3, Gemma 3,
OLMo 2 over all heads) and R_i the rotation at position i (full, partial, interleaved, or none in a NoPE layer).
With the norms' scales inv and inv_q frozen at their values in the run (direct attribution, as TransformerLens'
``decompose_resid``), q is linear in the residual stream's sources plus a constant: each source's part and the
bias sum to q_i exactly. Nothing of this is a table of families:

- W and b are read by running the layer's own attention module once on the identity (and on zero), with its
  q/k norms passed through and its rotation set to the identity, while the attention function records the
  queries and keys it is given (:func:`attnviz.core.engine.catching`);
- a norm's form (which of RMS, 1 + w, LayerNorm) is read by applying it to test vectors;
- the rotation is the family's own ``apply_rotary_pos_emb`` on the rotated dimensions;
- the scaling, soft-cap and learned sink logits are what the attention function is called with.

Then the parts are checked against the queries and keys the module makes on the run's own input: a layer
whose pieces do not give back its queries and keys within 1e-4 relative (four steps of the dtype in half
precision, where the module rounds what the float32 pieces do not: :mod:`attnviz.core.model.precision`) is refused with
one line naming the difference and the limit (a low-rank attention such as DeepSeek's latent attention, whose
projections have a norm between them, is one).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from attnviz.core.model import anatomy as anatomy_mod
from attnviz.core.model import precision
from attnviz.core.engine import sites
from attnviz.errors import InputError

TOLERANCE = precision.FP32_TOLERANCE  # relative, in float32: the pieces must give back the module's own q and k


@dataclass(frozen=True)
class Scheme:
    family: str
    anatomy: object  # attnviz.core.model.anatomy.Anatomy
    rotary: bool  # rotary positions; else learned absolute positions, a source of their own ("pos")

    @property
    def position(self) -> str:
        return "rotary" if self.rotary else "learned absolute"


def scheme(loaded) -> Scheme:
    """The model's scheme, or an :class:`InputError` naming what cannot be attributed."""
    from attnviz.core import engine

    engine.prepare(loaded.model)  # the attention function reads the module's queries and keys (catching)
    found = anatomy_mod.of(loaded.model)
    if _position_embedding(found) is None and found.rotary is None:
        raise InputError(f"score attribution needs rotary or learned absolute positions; {loaded.model_id} "
                         f"({found.family}) has neither that attnviz can read")
    return Scheme(found.family, found, found.rotary is not None)


def _position_embedding(found) -> torch.nn.Module | None:
    """A learned absolute position table (GPT-2's ``wpe``): an embedding of the base model other than the token
    table, where there is no rotary embedding."""
    if found.rotary is not None:
        return None
    tables = [m for m in found.base.children() if isinstance(m, torch.nn.Embedding) and m is not found.embed]
    return tables[0] if len(tables) == 1 else None


@torch.no_grad()
def embeddings(model, s: Scheme, ids: list[int], hidden0: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sources the residual stream starts from: the (scaled) token embedding, and for learned
    positions the token and the position embeddings apart (they sum to ``hidden0``)."""
    table = _position_embedding(s.anatomy)
    if table is None:
        return {"embed": hidden0}
    device = table.weight.device
    pos = table(torch.arange(len(ids), device=device)).float().to(hidden0.device)
    return {"embed": hidden0 - pos, "pos": pos}


# --- a norm's form -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NormForm:
    """A norm as γ ⊙ c(v) / sqrt(mean(c(v)²) + eps) + β, c the centring where ``centre``."""

    gamma: torch.Tensor
    beta: torch.Tensor | None
    centre: bool
    eps: float

    def inv(self, v: torch.Tensor) -> torch.Tensor:
        """1 / scale of each row of ``v`` (..., width): what attribution freezes."""
        c = v - v.mean(-1, keepdim=True) if self.centre else v
        return torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + self.eps)

    def linear(self, v: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        """The norm's linear part with a frozen scale (β left out: a constant)."""
        return self.gamma * (v - v.mean(-1, keepdim=True) if self.centre else v) * inv


@torch.no_grad()
def norm_form(module: torch.nn.Module, width: int, where: str) -> NormForm:
    """Which of RMSNorm (γ or Gemma's 1 + γ) and LayerNorm ``module`` computes, read by applying it to test
    vectors; refused in one line when it is none of them."""
    weight = getattr(module, "weight", None)
    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    v = (torch.randn(6, width, generator=gen) * 3 + 0.7).to(device)
    dtype = param.dtype if param is not None else torch.float32
    out = module(v.to(dtype)).float()
    eps = float(next((getattr(module, n) for n in ("variance_epsilon", "eps", "epsilon") if hasattr(module, n)), 1e-6))
    w = weight.detach().float() if weight is not None else torch.ones(width, device=device)
    bias = getattr(module, "bias", None)
    b = bias.detach().float() if isinstance(bias, torch.Tensor) else None
    tolerance = max(precision.decomposition_tolerance(dtype), 2e-2 if precision.half(dtype) else 0.0)
    for gamma, centre, beta in ((w, False, None), (1.0 + w, False, None), (w, True, b)):
        form = NormForm(gamma, beta, centre, eps)
        made = form.linear(v, form.inv(v)) + (beta if beta is not None else 0)
        if (made - out).norm() <= tolerance * out.norm():
            return form
    raise InputError(f"score attribution: {where} ({type(module).__name__}) is neither an RMSNorm nor a LayerNorm")


# --- a layer's queries and keys ----------------------------------------------------------------------------

def _qk_norms(attn) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    children = dict(attn.named_children())
    find = lambda side: next((m for n, m in children.items()  # noqa: E731
                              if n in (f"{side}_norm", f"{side}_layernorm", f"{side}_ln")), None)
    return find("q"), find("k")


def _call(found, layer, hidden: torch.Tensor, rotation: str, pass_norms: bool) -> dict:
    """Run the layer's attention module on ``hidden`` (1, T, width) and return what its attention function is
    given: queries, keys (float32), scaling, soft-cap, learned sinks. ``rotation``: "run" (the positions'),
    "identity" (cos 1, sin 0). ``pass_norms``: the q/k norms give back their input."""
    from attnviz.core import engine

    attn = layer.attn
    positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
    kwargs = {"attention_mask": None}
    names = found.attn_kwargs
    if "position_ids" in names:
        kwargs["position_ids"] = positions
    if "cache_position" in names:
        kwargs["cache_position"] = positions[0]
    if "position_embeddings" in names:
        made = found.position_embeddings(hidden, positions, layer)
        if made is not None and rotation == "identity":
            cos, sin = made
            made = (torch.ones_like(cos), torch.zeros_like(sin))
        kwargs["position_embeddings"] = made
    # the q/k norms give back their input: kept on the way in, returned on the way out (this thread only: the shared
    # server's other sessions run the same model)
    norms = [norm for norm in _qk_norms(attn) if norm is not None] if pass_norms else []
    seen: dict = {}
    with sites.module_hooks([(norm, sites.save(seen, norm)) for norm in norms], inputs=True), \
            sites.module_hooks([(norm, lambda out, norm=norm: seen.pop(norm)) for norm in norms]), \
            engine.catching() as caught:
        try:
            attn(hidden_states=hidden, **kwargs)
        except engine.Caught:
            pass
    if "query" not in caught:
        raise InputError(f"score attribution: {found.family}'s attention module did not call the attention "
                         "function with its queries and keys")
    return caught


def _rotation(attn, cos: torch.Tensor, sin: torch.Tensor, d: int):
    """R(v, rows): the family's own ``apply_rotary_pos_emb`` at the positions ``rows``; v is (..., m, D) with m the
    rows' count. On the whole head where the function takes it (it may rotate only some dimensions itself, as
    GPT-NeoX's and GLM-4's do, or take half-width tables, as gpt-oss's), else on the first ``cos.shape[-1]``
    dimensions with the rest passed (Phi splits them in its attention, not in the function)."""
    fn = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    if fn is None:
        return None
    width = d
    try:
        probe = torch.zeros(1, 1, 1, d, device=cos.device)
        fn(probe, probe, cos[:, :1], sin[:, :1])
    except RuntimeError:
        width = cos.shape[-1]

    def rotate(v: torch.Tensor, rows) -> torch.Tensor:
        shape = v.shape
        flat = v.reshape(1, -1, shape[-2], shape[-1]) if v.dim() != 4 else v
        c, s = cos[:, rows].to(v.dtype), sin[:, rows].to(v.dtype)
        if c.dim() == 2:  # one row
            c, s = c[:, None], s[:, None]
        turned, _ = fn(flat[..., :width], flat[..., :width], c, s)
        out = torch.cat([turned.to(v.dtype), flat[..., width:]], -1) if width < shape[-1] else turned.to(v.dtype)
        return out.reshape(shape)
    return rotate


class LayerParts:
    """Every head's pieces of one layer's scores (see the module docstring), made once per layer and run."""

    @torch.no_grad()
    def __init__(self, model, s: Scheme, layer_index: int, x: torch.Tensor, n_heads: int):
        found = s.anatomy
        layer = found[layer_index]
        where = f"{found.family} layer {layer_index}"
        dtype = next(model.parameters()).dtype
        device = x.device
        param_device = next(layer.attn.parameters()).device
        width = x.shape[-1]
        # the input norm and its frozen scale
        self.norm = norm_form(layer.attn_norm, width, f"{where}'s input norm") if layer.attn_norm is not None else None
        self.inv = self.norm.inv(x) if self.norm is not None else torch.ones(x.shape[0], 1, device=device)
        normed_run = self.normed(x)
        # the projections, read from the module: identity rows, then zero
        probe = torch.cat([torch.eye(width), torch.zeros(1, width)]).to(param_device, dtype)[None]
        plain = _call(found, layer, probe, "identity", pass_norms=True)
        self.scale, self.softcap = float(plain["scaling"]), plain["softcap"]
        sinks = plain["s_aux"]
        self.sinks = None if sinks is None else sinks.detach().float().flatten().tolist()
        q, k = plain["query"][0].to(device), plain["key"][0].to(device)  # (H, width + 1, D), (KV, width + 1, D)
        self.d = q.shape[-1]
        self.w_q, self.b_q = (q[:, :width] - q[:, width:]).transpose(1, 2), q[:, width]  # (H, D, width), (H, D)
        self.w_k, self.b_k = (k[:, :width] - k[:, width:]).transpose(1, 2), k[:, width]
        self.group = q.shape[0] // k.shape[0]
        # a constant on either side: a projection's bias (whatever its value), or the input norm's β
        self.has_bias = any(name.endswith("bias") for name, _ in layer.attn.named_parameters()) or bool(
            self.norm is not None and self.norm.beta is not None)
        # the q/k norms' frozen factors, from the pre-norm queries and keys of the run
        self.fq = self._qk_factor(layer, "q", normed_run, self.w_q, self.b_q, where)
        self.fk = self._qk_factor(layer, "k", normed_run, self.w_k, self.b_k, where)
        # the rotation, read from the module, and checked: the pieces give back the module's own queries and keys
        real = _call(found, layer, self._input(layer, x).to(param_device, dtype)[None], "run", pass_norms=False)
        q_real, k_real = real["query"][0].float().to(device), real["key"][0].float().to(device)
        self.rotate, self.pairs, self.frequencies = None, [], []
        pe = None
        if s.rotary and found.rotary is not None:
            pe = found.position_embeddings(x[None].to(param_device, dtype),
                                           torch.arange(x.shape[0], device=param_device)[None], layer)
        # every head's queries and keys of the run, unrotated and rotated: made once per layer, read by each head
        self.q_plain, self.k_plain = self.unrotated("q", normed_run), self.unrotated("k", normed_run)
        q_flat, k_flat = self.q_plain, self.k_plain
        if pe is not None and not _relative(q_flat, q_real) <= precision.decomposition_tolerance(dtype):
            cos, sin = (t.float().to(device) for t in pe)
            self.rotate = _rotation(layer.attn, cos, sin, self.d)
            if self.rotate is not None:
                self.pairs, self.frequencies = _pairs(layer.attn, cos.shape[-1], self.d, found.rotary, device)
        self.q, self.k = self.rotated(q_flat, slice(None)), self.rotated(k_flat, slice(None))
        limit = precision.decomposition_tolerance(dtype)
        missed = max(_relative(self.q, q_real), _relative(self.k, k_real))
        if not missed <= limit:
            raise InputError(f"score attribution: {where}'s queries and keys are not a linear map of its input "
                             "with frozen norms and a rotation (a low-rank attention with a norm inside, as "
                             "DeepSeek's latent attention, is one), so its scores cannot be split by source: the "
                             f"pieces miss the module's own by {missed:.3g} relative (limit {limit:.3g} in "
                             f"{precision.name(dtype)})")

    def _input(self, layer, x):
        return (layer.attn_norm(x.to(next(layer.attn.parameters()).dtype)).float()
                if layer.attn_norm is not None else x)

    def normed(self, x):
        """The layer's input norm of ``x`` with its frozen scale, β included (``x`` itself without a norm)."""
        if self.norm is None:
            return x
        return self.norm.linear(x, self.inv) + (self.norm.beta if self.norm.beta is not None else 0)

    def _qk_factor(self, layer, side, normed, w, b, where):
        """The side's q/k norm as a frozen multiplicative factor (H or KV, n, D): 1 without one (a centring
        q/k norm, with a β, is refused)."""
        norm = _qk_norms(layer.attn)[0 if side == "q" else 1]
        heads, d, n = w.shape[0], w.shape[1], normed.shape[0]
        if norm is None:
            return torch.ones(heads, n, d, device=normed.device)
        pre = torch.einsum("nw,hdw->hnd", normed, w) + b[:, None]  # (heads, n, D) before the norm
        size = norm.weight.numel() if getattr(norm, "weight", None) is not None else d
        over_all = size == heads * d  # OLMo 2: one norm over every head's queries
        form = norm_form(norm, size, f"{where}'s {side}_norm")
        if form.centre:
            raise InputError(f"score attribution: {where}'s {side}_norm centres its input (a LayerNorm), which mixes "
                             "the dimensions: not worked out")
        if over_all:
            flat = pre.transpose(0, 1).reshape(n, heads * d)
            factor = (form.gamma * form.inv(flat)).reshape(n, heads, d).transpose(0, 1)
        else:
            factor = form.gamma * form.inv(pre)
        return factor

    def unrotated(self, side: str, normed: torch.Tensor) -> torch.Tensor:
        """Every head's (side's) vectors, before rotation, from the full normed input: (H, n, D)."""
        w, b, f = (self.w_q, self.b_q, self.fq) if side == "q" else (self.w_k, self.b_k, self.fk)
        return f * (torch.einsum("nw,hdw->hnd", normed, w) + b[:, None])

    def rotated(self, v: torch.Tensor, rows) -> torch.Tensor:
        return v if self.rotate is None else self.rotate(v, rows)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ (infinite for different shapes)."""
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).norm()) / max(float(b.norm()), 1e-6)


@torch.no_grad()
def _pairs(attn, width: int, d: int, rotary, device) -> tuple[list[tuple[int, int]], list[float]]:
    """The rotary pairs (dimensions turned together) and each pair's frequency (radians per token): read by
    turning every basis vector a quarter turn (cos 0, sin 1: every pair, whatever its frequency, swaps)."""
    quarter = _rotation(attn, torch.zeros(1, 1, width, device=device), torch.ones(1, 1, width, device=device), d)
    basis = torch.eye(d, device=device)
    turned = quarter(basis[None, :, None, :].contiguous(), slice(0, 1))[0, :, 0]  # (d, d): row a is R e_a
    pairs, seen = [], set()
    for a in range(d):
        if a in seen:
            continue
        partners = [b for b in range(d) if b != a and abs(float(turned[a, b])) > 1e-6]
        if len(partners) == 1:
            pairs.append((a, partners[0]))
            seen.update((a, partners[0]))
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None:
        inv_freq = getattr(rotary, "original_inv_freq", None)
    freqs = inv_freq.float().tolist() if inv_freq is not None else []
    frequencies = [freqs[i] if i < len(freqs) else float("nan") for i in range(len(pairs))]
    return pairs, frequencies


def softmax_logits(part: dict, scores: torch.Tensor) -> torch.Tensor:
    """What the softmax sees of the scores: soft-capped where the family caps them."""
    cap = part["softcap"]
    return cap * torch.tanh(scores / cap) if cap else scores
