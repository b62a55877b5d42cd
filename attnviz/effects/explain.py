"""Why a head attends there: score attribution (docs/methods.md#score-attribution).

For one layer, head, query i and key j (or every query that may see key j, averaged), under any recipe:

- the score s_ij = q_i · k_j · scaling, q and k after the rotary rotation, before any mask or intervention;
- its split by rotary pair p (dimensions p and p + D/2, transformers' ``rotate_half`` convention) and by
  single dimension; each sums to s_ij exactly;
- the position-free counterfactual s_ij^nope: the same product without the rotation;
- its split by source on the key side and on the query side: the residual stream entering the layer is
  the token embedding plus every earlier attention block's and MLP block's output; with the layer's
  RMSNorm scale frozen at its value in the run (direct attribution, as TransformerLens'
  ``decompose_resid``), q and k are linear in those sources, so each side sums to s_ij on its own.

One forward under the recipe records the residual stream and the blocks' outputs (forward hooks on
the attention and MLP modules, removed after the pass; no modelling code is patched); the products are
float32 on the device the layer ran on. Llama, Mistral and Qwen2 (SmolLM2 is a Llama) are exact;
other families are refused with one line that names them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from attnviz.capture import tokenize
from attnviz.core.models import LoadedModel
from attnviz.errors import InputError
from attnviz.recipe import build

#: families whose attention is q = R·W_Q·RMSNorm(x) (+ bias), k likewise: the decomposition is exact
SUPPORTED = ("llama", "mistral", "qwen2")


@dataclass
class Explanation:
    """The attribution of one score (or of one key's scores averaged over queries)."""

    layer: int
    head: int
    query: int | str  # a position, or "all": the mean over every query the mask lets see the key
    key: int
    score: float
    nope_score: float
    by_pair: list[float]  # D/2 contributions, pair p = dimensions (p, p + D/2)
    by_dim: list[float]  # D contributions
    key_sources: dict[str, float]  # "embed", "attn.L", "mlp.L", "bias": sums to score
    query_sources: dict[str, float]
    frequencies: list[float]  # the rotary frequency of each pair (radians per token)
    tokens: tuple[str, str]  # the query's (or "all") and the key's token
    queries: int = 1  # how many queries were averaged
    recipe: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        r6 = lambda x: round(float(x), 6)  # noqa: E731
        return {"score": r6(self.score), "nope_score": r6(self.nope_score), "by_pair": [r6(x) for x in self.by_pair],
                "by_dim": [r6(x) for x in self.by_dim],
                "key_sources": {k: r6(v) for k, v in self.key_sources.items()},
                "query_sources": {k: r6(v) for k, v in self.query_sources.items()},
                "layer": self.layer, "head": self.head, "query": self.query, "key": self.key,
                **({"queries_averaged": self.queries} if self.query == "all" else {}),
                "frequencies": [r6(x) for x in self.frequencies], "recipe": self.recipe}

    def top_pairs_share(self, k: int) -> float:
        """The share of Σ_p |c_p| held by the k pairs of largest |c_p|."""
        magnitudes = sorted((abs(c) for c in self.by_pair), reverse=True)
        total = sum(magnitudes)
        return sum(magnitudes[:k]) / total if total else float("nan")

    def figure(self):
        """The score by rotary pair (frequency on the axis) and by source: a paper-ready Plotly figure."""
        from attnviz.figures.why import attribution_figure

        return attribution_figure(self)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """R_t v for vectors (..., n, D) and the positions' cos/sin (n, D)."""
    return v * cos + _rotate_half(v) * sin


@torch.no_grad()
def explain(loaded: LoadedModel, text: str, arch="fwd", *, layer: int, head: int, query: int | str, key: int,
            intervene=None, prepend: str | None = None) -> Explanation:
    """The attribution of s[query, key] of ``head`` in ``layer`` (see the module docstring); ``arch`` is an
    architecture string or a :class:`~attnviz.recipe.Recipe`. ``query="all"`` averages over every query
    the layer's mask lets see ``key``."""
    built = build(loaded, arch, intervene, prepend).only("score attribution", "intervene", "prepend")
    family = getattr(loaded.config, "model_type", "?")
    if family not in SUPPORTED:
        raise InputError(f"score attribution supports {', '.join(SUPPORTED)} models (pre-norm, rotary); "
                         f"{loaded.model_id} is {family}, whose norm and position scheme is not worked out here")
    if not -loaded.n_layers <= layer < loaded.n_layers:
        raise InputError(f"layer {layer} does not exist: the model has layers 0..{loaded.n_layers - 1}")
    layer %= loaded.n_layers
    if not 0 <= head < loaded.n_heads:
        raise InputError(f"head {head} does not exist: the model has heads 0..{loaded.n_heads - 1}")
    ids, tokens = tokenize(loaded, text, prepend=built.recipe.prepend)
    n = len(ids)
    if not 0 <= key < n:
        raise InputError(f"key {key} is outside the text's {n} tokens (0..{n - 1})")
    allowed = torch.from_numpy(built.architecture.layers[layer].matrix(n))
    if query == "all":
        rows = torch.nonzero(allowed[:, key]).flatten()
        if not len(rows):
            raise InputError(f"no query may see key {key} in layer {layer} under {built.recipe.arch}")
    else:
        if not isinstance(query, int) or not 0 <= query < n:
            raise InputError(f"query {query} is outside the text's {n} tokens (0..{n - 1})")
        if not allowed[query, key]:
            raise InputError(f"query {query} may not see key {key} in layer {layer} under {built.recipe.arch}: "
                             "that cell is masked, it has no score to explain")
        rows = torch.tensor([query])

    base = loaded.model.model
    blocks = base.layers
    sources: dict[str, torch.Tensor] = {}
    hooks = []
    for l in range(layer):
        hooks.append(blocks[l].self_attn.register_forward_hook(
            lambda m, args, out, l=l: sources.__setitem__(f"attn.{l}", out[0][0].detach().float())))
        hooks.append(blocks[l].mlp.register_forward_hook(
            lambda m, args, out, l=l: sources.__setitem__(f"mlp.{l}", out[0].detach().float())))
    try:
        _, hidden, _ = built.forward(loaded, torch.tensor([ids]), output_hidden_states=True, last_logits_only=True)
    finally:
        for hook in hooks:
            hook.remove()
    x = hidden[layer][0].float()  # (n, hidden): the residual stream entering the layer
    named = {"embed": hidden[0][0].float(), **{k: sources[k] for l in range(layer)
                                                for k in (f"attn.{l}", f"mlp.{l}")}}

    block = blocks[layer]
    attn = block.self_attn
    norm = block.input_layernorm
    d = attn.head_dim
    group = loaded.n_heads // loaded.n_kv_heads
    kv = head // group
    w_q = attn.q_proj.weight[head * d:(head + 1) * d].float()
    w_k = attn.k_proj.weight[kv * d:(kv + 1) * d].float()
    b_q = attn.q_proj.bias[head * d:(head + 1) * d].float() if attn.q_proj.bias is not None else None
    b_k = attn.k_proj.bias[kv * d:(kv + 1) * d].float() if attn.k_proj.bias is not None else None
    gamma = norm.weight.float()
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    scale = float(getattr(attn, "scaling", d ** -0.5))
    positions = torch.arange(n, device=x.device)[None]
    cos, sin = base.rotary_emb(x[None], positions)
    cos, sin = cos[0].float(), sin[0].float()  # (n, D)

    inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # (n, 1): frozen at the run's value

    normed = gamma * x * inv_rms
    q_plain = normed[rows] @ w_q.T + (b_q if b_q is not None else 0)  # (I, D), unrotated
    k_plain = normed[key] @ w_k.T + (b_k if b_k is not None else 0)  # (D,)
    q = _rotate(q_plain, cos[rows], sin[rows])
    k = _rotate(k_plain, cos[key], sin[key])
    products = q * k[None] * scale  # (I, D)
    by_dim = products.mean(0)
    half = d // 2
    by_pair = by_dim[:half] + by_dim[half:]
    score = float(by_dim.sum())
    nope = float((q_plain * k_plain[None]).sum(-1).mean() * scale)

    stacked = torch.stack(list(named.values()))  # (S, n, hidden)
    k_src = _rotate((gamma * stacked[:, key] * inv_rms[key]) @ w_k.T, cos[key], sin[key])  # (S, D)
    key_parts = (q.mean(0)[None] * k_src).sum(-1) * scale  # (S,)
    q_src = _rotate((gamma * stacked[:, rows] * inv_rms[rows][None]) @ w_q.T, cos[rows], sin[rows])  # (S, I, D)
    query_parts = (q_src * k[None, None]).sum(-1).mean(-1) * scale  # (S,)
    key_sources = {name: float(v) for name, v in zip(named, key_parts)}
    query_sources = {name: float(v) for name, v in zip(named, query_parts)}
    if b_k is not None:
        key_sources["bias"] = float((q.mean(0) * _rotate(b_k, cos[key], sin[key])).sum() * scale)
    if b_q is not None:
        query_sources["bias"] = float((_rotate(b_q[None].expand(len(rows), -1), cos[rows], sin[rows])
                                       * k[None]).sum(-1).mean() * scale)
    frequencies = getattr(base.rotary_emb, "inv_freq", torch.full((half,), math.nan)).float().tolist()
    return Explanation(layer, head, "all" if query == "all" else int(query), key, score, nope, by_pair.tolist(),
                       by_dim.tolist(), key_sources, query_sources, frequencies[:half],
                       ("all" if query == "all" else tokens[int(query)], tokens[key]), len(rows),
                       built.recipe.to_dict())
