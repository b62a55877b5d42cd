"""Why a head attends there: score attribution (docs/methods.md#score-attribution), one kept forward and its scores.

For one layer, head, query i and key j (or every query that may see key j, averaged), under any recipe:

- the score s_ij = q_i · k_j · scaling, q and k after the rotary rotation, before any mask or intervention;
- its split by rotary pair p (dimensions p and p + D/2, transformers' ``rotate_half`` convention) and by
  single dimension; each sums to s_ij exactly;
- the position-free counterfactual s_ij^nope: the same product without the rotation;
- its split by source on the key side and on the query side: the residual stream entering the layer is
  the token embedding plus every earlier attention block's and MLP block's output; with the layer's
  RMSNorm scale frozen at its value in the run (direct attribution, as TransformerLens'
  ``decompose_resid``), q and k are linear in those sources, so each side sums to s_ij on its own.

One forward under the recipe (:class:`KeptForward`) records the residual stream and the blocks' writes at the
named sites ``attn_out`` and ``mlp_out`` (docs/methods.md#sites: in the asking thread only, no modelling code
patched); the products are float32 on the device the layer ran on. Every family whose layer's queries and keys are a
linear map of its input with frozen norms and a rotation is exact: the pieces are read from the model's own
modules and checked against them (:mod:`attnviz.effects.schemes`); a layer that is not such a map
(DeepSeek's latent attention) is refused with one line. GPT-2 has learned absolute positions: its
counterfactual is the score without the position embedding in the sources (source "pos"), and it has
no rotary pairs. Under a partial rotation (GPT-NeoX, Phi, GLM-4) the pairs are the rotated dimensions'.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from attnviz.core.spec import allowsets
from attnviz.core import engine
from attnviz.core.engine import sites
from attnviz.core.loading.models import LoadedModel
from attnviz.effects import schemes
from attnviz.effects.opening import Opening
from attnviz.errors import InputError


@dataclass
class Explanation:
    """The attribution of one score (or of one key's scores averaged over queries)."""

    layer: int
    head: int
    query: int | str  # a position, or "all": the mean over every query the mask lets see the key
    key: int
    score: float
    nope_score: float  # without rotation; with learned positions, without the position embedding
    by_pair: list[float]  # D/2 contributions, pair p = dimensions (p, p + D/2); none without rotary positions
    by_dim: list[float]  # D contributions
    key_sources: dict[str, float]  # "embed", ("pos",) "attn.L", "mlp.L", "bias": sums to score
    query_sources: dict[str, float]
    frequencies: list[float]  # the rotary frequency of each pair (radians per token)
    tokens: tuple[str, str]  # the query's (or "all") and the key's token
    queries: int = 1  # how many queries were averaged
    recipe: dict = field(default_factory=dict)
    position: str = "rotary"  # or "learned absolute"
    softcapped_score: float | None = None  # what the softmax sees, where the family soft-caps its logits

    def as_json(self) -> dict:
        r6 = lambda x: round(float(x), 6)  # noqa: E731
        return {"score": r6(self.score), "nope_score": r6(self.nope_score), "by_pair": [r6(x) for x in self.by_pair],
                "by_dim": [r6(x) for x in self.by_dim],
                "key_sources": {k: r6(v) for k, v in self.key_sources.items()},
                "query_sources": {k: r6(v) for k, v in self.query_sources.items()},
                "layer": self.layer, "head": self.head, "query": self.query, "key": self.key,
                **({"queries_averaged": self.queries} if self.query == "all" else {}),
                "frequencies": [r6(x) for x in self.frequencies], "position": self.position,
                "nope_means": ("the score without the rotary rotation" if self.position == "rotary"
                               else "the score without the position embedding in the sources"),
                **({"softcapped_score": r6(self.softcapped_score)} if self.softcapped_score is not None else {}),
                "recipe": self.recipe}

    @property
    def key_split(self) -> dict[str, float]:
        """The key side summed by kind of source: embedding, attention blocks, MLP blocks, bias."""
        out = {"embed": 0.0, "attn": 0.0, "mlp": 0.0, "bias": 0.0}
        for name, value in self.key_sources.items():
            source = name.split(".")[0]
            out[source] = out.get(source, 0.0) + value
        return out

    def top_pairs_share(self, k: int) -> float:
        """The share of Σ_p |c_p| held by the k pairs of largest |c_p|."""
        magnitudes = sorted((abs(c) for c in self.by_pair), reverse=True)
        total = sum(magnitudes)
        return sum(magnitudes[:k]) / total if total else float("nan")


def checked_layer(loaded: LoadedModel, layer: int) -> int:
    """``layer`` counted from the bottom (negative counts from the top), refused when it does not exist."""
    if not isinstance(layer, numbers.Integral) or isinstance(layer, bool):
        raise InputError(f"layer is a layer number (an int, negative counts from the top), not {layer!r}")
    if not -loaded.n_layers <= layer < loaded.n_layers:
        raise InputError(f"layer {layer} does not exist: the model has layers 0..{loaded.n_layers - 1}")
    return layer % loaded.n_layers



class KeptForward:
    """One forward under a recipe, kept for score attribution: the residual stream entering each layer and its
    sources (the embeddings, every attention block's and MLP block's write), float32. Not a residual variant
    (:mod:`attnviz.core.engine.residual`): the model's own forward, read."""

    @torch.no_grad()
    def __init__(self, loaded: LoadedModel, text: str, recipe="fwd", upto: int | None = None, on_layer=None):
        """``recipe``: an architecture string or a recipe; ``upto``: the highest layer asked about (sources are kept
        below it; default every layer); ``on_layer(done, total)`` reports the forward's progress."""
        opened = Opening(loaded, text, recipe, "score attribution")
        opened.built.softmax_only("score attribution")
        self.scheme = schemes.scheme(loaded)
        self.loaded, self.built, self.ids, self.tokens = loaded, opened.built, opened.ids, opened.tokens
        self.upto = loaded.n_layers - 1 if upto is None else upto
        # every block's write as the stream adds it (Granite's residual multiplier included), in this thread only:
        # the shared server's other sessions run the same model
        names = {f"{block}.{l}": sites.Site(f"{block}_out", l) for l in range(self.upto) for block in ("attn", "mlp")}
        kept: dict[str, torch.Tensor] = {}
        progress = (lambda l: on_layer(l + 1, loaded.n_layers)) if on_layer else None
        _, hidden, _ = opened.forward(engine.Record.nothing(on_layer=progress),
                                      engine.Feed(hidden_states=True, last_logits_only=True),
                                      [(site, sites.save(kept, name, first_row=True, dtype=torch.float32))
                                       for name, site in names.items()])
        self.hidden = [h[0].float() for h in hidden[:self.upto + 1]]  # the input of layers 0 .. upto
        self._parts: dict[int, schemes.LayerParts] = {}
        self._allowed: dict[int, torch.Tensor] = {}
        # in forward order: attn.0, mlp.0, attn.1, ... (the order of every figure and table)
        self.sources = {**schemes.embeddings(loaded.model, self.scheme, self.ids, self.hidden[0]),
                        **{name: kept[name] for name in names}}

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    @property
    def held_bytes(self) -> int:
        """What this run keeps (the residual streams and sources, not the model): the app's caches count it."""
        tensors = {id(t): t for t in [*self.hidden, *self.sources.values()]}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def check(self, layer: int, head: int) -> int:
        loaded = self.loaded
        layer = checked_layer(loaded, layer)
        if layer > self.upto:
            raise InputError(f"layer {layer} is above the layers this run kept (0..{self.upto})")
        if not isinstance(head, numbers.Integral) or isinstance(head, bool) or not 0 <= head < loaded.n_heads:
            raise InputError(f"head {head} does not exist: the model has heads 0..{loaded.n_heads - 1}")
        return layer

    @property
    def device(self) -> torch.device:
        """Where this run's residual stream is, and so every tensor computed from it."""
        return self.hidden[0].device

    def allowed(self, layer: int) -> torch.Tensor:
        """(n, n) the layer's allow-set, on the run's device: its mask and the model's own sliding window there
        together (:func:`attnviz.core.spec.allowsets.allowed`), the cells the model computes, as a capture records them.
        Every average over "the queries that may see a key" reads it, and a cell outside it is refused."""
        if layer not in self._allowed:
            window = self.scheme.anatomy[layer].window
            self._allowed[layer] = allowsets.allowed(self.built.architecture.layers[layer], self.n_tokens,
                                                     window).to(self.device)
        return self._allowed[layer]

    def _before(self, layer: int) -> dict[str, torch.Tensor]:
        """The sources of the residual stream entering ``layer``."""
        return {name: s for name, s in self.sources.items() if "." not in name or int(name.split(".")[1]) < layer}

    def layer_parts(self, layer: int) -> schemes.LayerParts:
        """Every head's pieces of ``layer``'s scores, read from the model once per layer and run."""
        if layer not in self._parts:
            self._parts[layer] = schemes.LayerParts(self.loaded.model, self.scheme, layer, self.hidden[layer],
                                                    self.loaded.n_heads)
        return self._parts[layer]

    @torch.no_grad()
    def head(self, layer: int, head: int) -> dict:
        """Everything one head's scores are made of: its layer's pieces (:class:`schemes.LayerParts`), and the
        plain and rotated q, k (with learned positions, also q and k without the position embedding: the
        counterfactual's)."""
        parts = self.layer_parts(layer)
        kv = head // parts.group
        part = {"parts": parts, "head": head, "kv": kv, "d": parts.d, "scale": parts.scale, "softcap": parts.softcap,
                "sink": None if parts.sinks is None else parts.sinks[head], "inv": parts.inv,
                "q_plain": parts.q_plain[head], "k_plain": parts.k_plain[kv], "q": parts.q[head], "k": parts.k[kv]}
        if "pos" not in self.sources:
            part["q_nope"], part["k_nope"] = part["q_plain"], part["k_plain"]
        else:
            pos = self._source_side(part, "q", self.sources["pos"], slice(None), rotate=False)
            part["q_nope"] = part["q_plain"] - pos
            part["k_nope"] = part["k_plain"] - self._source_side(part, "k", self.sources["pos"], slice(None),
                                                                 rotate=False)
        return part

    @staticmethod
    def _source_side(part: dict, side: str, sources: torch.Tensor, rows, rotate: bool = True) -> torch.Tensor:
        """One side's part of each source (..., m, width) at the positions ``rows`` (m of them): its frozen input
        norm's linear part, the head's projection, the frozen q/k norm and, where ``rotate``, the rotation."""
        parts = part["parts"]
        inv = parts.inv[rows]
        lin = parts.norm.linear(sources, inv) if parts.norm is not None else sources
        h = part["head"] if side == "q" else part["kv"]
        w, f = (parts.w_q, parts.fq) if side == "q" else (parts.w_k, parts.fk)
        out = (lin @ w[h].T) * f[h][rows]
        return parts.rotated(out, rows) if rotate else out

    @staticmethod
    def _bias_side(part: dict, side: str, rows) -> torch.Tensor | None:
        """One side's constant at the positions ``rows``: the projection's bias plus the projected input-norm β,
        through the frozen q/k norm and the rotation. None where it is zero."""
        parts = part["parts"]
        h = part["head"] if side == "q" else part["kv"]
        w, b, f = (parts.w_q, parts.b_q, parts.fq) if side == "q" else (parts.w_k, parts.b_k, parts.fk)
        if not parts.has_bias:
            return None
        total = b[h] + (w[h] @ parts.norm.beta if parts.norm is not None and parts.norm.beta is not None else 0)
        return parts.rotated(f[h][rows] * total, rows)

    @torch.no_grad()
    def probabilities(self, layer: int, head: int, part: dict | None = None) -> torch.Tensor:
        """(n, n) the head's softmax of its scores under the layer's mask (no intervention; soft-capped and
        with its learned sink logit where the family has them): what its sink key
        (docs/methods.md#sink-key-and-shift-rate) is read from."""
        part = part or self.head(layer, head)
        logits = schemes.softmax_logits(part, (part["q"] @ part["k"].T) * part["scale"])
        logits = logits.masked_fill(~self.allowed(layer), float("-inf"))
        if part["sink"] is not None:  # gpt-oss: the sink takes its share of each row, then is dropped
            sink = torch.full((logits.shape[0], 1), part["sink"], dtype=logits.dtype, device=logits.device)
            return torch.softmax(torch.cat([logits, sink], -1), -1)[:, :-1]
        return torch.softmax(logits, -1)

    def sink_key(self, layer: int, head: int, part: dict | None = None) -> int:
        """The head's sink key: the argmax of the column mean of :meth:`probabilities`."""
        return int(self.probabilities(layer, head, part).mean(0).argmax())

    @torch.no_grad()
    def explain(self, layer: int, head: int, query: int | str, key: int, part: dict | None = None) -> Explanation:
        layer = self.check(layer, head)
        n, arch = self.n_tokens, self.built.recipe.arch
        if not isinstance(key, numbers.Integral) or isinstance(key, bool) or not 0 <= key < n:
            raise InputError(f"key {key} is outside the text's {n} tokens (0..{n - 1})")
        allowed = self.allowed(layer)
        if query == "all":
            rows = torch.nonzero(allowed[:, key]).flatten()
            if not len(rows):
                raise InputError(f"no query may see key {key} in layer {layer} under {arch}")
        else:
            if not isinstance(query, int) or not 0 <= query < n:
                raise InputError(f"query {query} is outside the text's {n} tokens (0..{n - 1})")
            if not allowed[query, key]:
                in_mask = bool(allowsets.allowed(self.built.architecture.layers[layer], n)[query, key])
                window = self.scheme.anatomy[layer].window
                why = (f"past the model's own {window}-token sliding window: the model never computes that cell"
                       if in_mask else f"under {arch}: that cell is masked")
                raise InputError(f"query {query} may not see key {key} in layer {layer} {why}, it has no score to "
                                 "explain")
            rows = torch.tensor([query], device=self.device)
        p = part or self.head(layer, head)
        scale, parts = p["scale"], p["parts"]
        q, k = p["q"][rows], p["k"][key]
        by_dim = (q * k[None] * scale).mean(0)
        score = float(by_dim.sum())
        nope = float((p["q_nope"][rows] * p["k_nope"][key][None]).sum(-1).mean() * scale)
        named = self._before(layer)
        at_key = torch.stack([s[key:key + 1] for s in named.values()])  # (S, 1, hidden): only the rows read
        at_rows = torch.stack([s[rows] for s in named.values()])  # (S, I, hidden)
        k_src = self._source_side(p, "k", at_key, slice(key, key + 1))[:, 0]  # (S, D)
        key_parts = (q.mean(0)[None] * k_src).sum(-1) * scale
        q_src = self._source_side(p, "q", at_rows, rows)  # (S, I, D)
        query_parts = (q_src * k[None, None]).sum(-1).mean(-1) * scale
        key_sources = {name: float(v) for name, v in zip(named, key_parts)}
        query_sources = {name: float(v) for name, v in zip(named, query_parts)}
        k_bias = self._bias_side(p, "k", slice(key, key + 1))
        if k_bias is not None:
            key_sources["bias"] = float((q.mean(0) * k_bias[0]).sum() * scale)
        q_bias = self._bias_side(p, "q", rows)
        if q_bias is not None:
            query_sources["bias"] = float((q_bias * k[None]).sum(-1).mean() * scale)
        capped = None
        if p["softcap"]:
            capped = float(schemes.softmax_logits(p, (q * k[None]).sum(-1) * scale).mean())
        by_pair = [float(by_dim[a] + by_dim[b]) for a, b in parts.pairs]
        return Explanation(layer, head, "all" if query == "all" else int(query), key, score, nope,
                           by_pair, by_dim.tolist(), key_sources, query_sources, list(parts.frequencies),
                           ("all" if query == "all" else self.tokens[int(query)], self.tokens[key]), len(rows),
                           self.built.recipe.to_dict(), self.scheme.position, capped)
