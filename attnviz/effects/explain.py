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
the modules whose outputs the stream adds, removed after the pass; no modelling code is patched); the
products are float32 on the device the layer ran on. Every family whose layer's queries and keys are a
linear map of its input with frozen norms and a rotation is exact: the pieces are read from the model's own
modules and checked against them (:mod:`attnviz.effects.schemes`); a layer that is not such a map
(DeepSeek's latent attention) is refused with one line. GPT-2 has learned absolute positions: its
counterfactual is the score without the position embedding in the sources (source "pos"), and it has
no rotary pairs. Under a partial rotation (GPT-NeoX, Phi, GLM-4) the pairs are the rotated dimensions'.
"""

from __future__ import annotations

import importlib
import numbers
from dataclasses import dataclass, field

import torch

from attnviz.tokens import tokenize
from attnviz.core import allowsets, engine
from attnviz.core import models
from attnviz.core.models import LoadedModel
from attnviz.effects import schemes
from attnviz.errors import InputError
from attnviz.recipe import build

DIAGNOSIS_TOKENS = 256  # the text a sweep's explain measure diagnoses: its corpus's first tokens



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
            kind = name.split(".")[0]
            out[kind] = out.get(kind, 0.0) + value
        return out

    def top_pairs_share(self, k: int) -> float:
        """The share of Σ_p |c_p| held by the k pairs of largest |c_p|."""
        magnitudes = sorted((abs(c) for c in self.by_pair), reverse=True)
        total = sum(magnitudes)
        return sum(magnitudes[:k]) / total if total else float("nan")

    def figure(self):
        """The score by rotary pair (frequency on the axis) and by source: a paper-ready Plotly figure."""
        from attnviz.figures.why import attribution_figure

        return attribution_figure(self)


def _layer(loaded: LoadedModel, layer: int) -> int:
    """``layer`` counted from the bottom (negative counts from the top), refused when it does not exist."""
    if not isinstance(layer, numbers.Integral) or isinstance(layer, bool):
        raise InputError(f"layer is a layer number (an int, negative counts from the top), not {layer!r}")
    if not -loaded.n_layers <= layer < loaded.n_layers:
        raise InputError(f"layer {layer} does not exist: the model has layers 0..{loaded.n_layers - 1}")
    return layer % loaded.n_layers


class Residual:
    """One forward under a recipe, kept for attribution: the residual stream entering each layer and its
    sources (the embeddings, every attention block's and MLP block's output), float32 on the host."""

    @torch.no_grad()
    def __init__(self, loaded: LoadedModel, text: str, arch="fwd", upto: int | None = None, on_layer=None):
        """``arch``: an architecture string or a recipe; ``upto``: the highest layer asked about (sources are kept
        below it; default every layer); ``on_layer(done, total)`` reports the forward's progress."""
        models.require(loaded, "score attribution")
        built = build(loaded, arch).only("score attribution", "intervene", "prepend")
        self.scheme = schemes.scheme(loaded)
        self.loaded, self.built = loaded, built
        self.ids, self.tokens = tokenize(loaded, text, prepend=built.recipe.prepend)
        built.check_text(len(self.ids))
        self.upto = loaded.n_layers - 1 if upto is None else upto
        sources: dict[str, torch.Tensor] = {}
        hooks = []
        for l in range(self.upto):
            scale = self.scheme.anatomy[l].scale  # the stream adds scale × the write (Granite's residual multiplier)
            for kind, module in zip(("attn", "mlp"), schemes.source_modules(loaded.model, self.scheme, l)):
                hooks.append(module.register_forward_hook(
                    lambda m, args, out, name=f"{kind}.{l}", scale=scale:
                    sources.__setitem__(name, schemes.first_row(out) * scale)))
        try:
            progress = (lambda l: on_layer(l + 1, loaded.n_layers)) if on_layer else None
            _, hidden, _ = built.forward(loaded, torch.tensor([self.ids]),
                                         engine.Record(frozenset(), on_layer=progress),
                                         engine.Feed(hidden_states=True, last_logits_only=True))
        finally:
            for hook in hooks:
                hook.remove()
        self.hidden = [h[0].float() for h in hidden[:self.upto + 1]]  # the input of layers 0 .. upto
        self._parts: dict[int, schemes.LayerParts] = {}
        self._allowed: dict[int, torch.Tensor] = {}
        # the hooks fire in forward order: attn.0, mlp.0, attn.1, ... (the order of every figure and table)
        self.sources = {**schemes.embeddings(loaded.model, self.scheme, self.ids, self.hidden[0]), **sources}

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
        layer = _layer(loaded, layer)
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
        together (:func:`attnviz.core.allowsets.allowed`), the cells the model computes, as a capture records them.
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


@torch.no_grad()
def explain(loaded: LoadedModel, text: str, arch="fwd", *, layer: int, head: int, query: int | str,
            key: int) -> Explanation:
    """The attribution of s[query, key] of ``head`` in ``layer`` (see the module docstring); ``arch`` is an
    architecture string or a :class:`~attnviz.recipe.Recipe`. ``query="all"`` averages over every query
    the layer's mask lets see ``key``. One forward, up to the layer."""
    models.require(loaded, "explain")
    run = Residual(loaded, text, arch, upto=_layer(loaded, layer))
    return run.explain(layer, head, query, key)


@dataclass
class Diagnosis:
    """Where every head of one layer gets its sink key's score from (docs/methods.md#the-sinks-diagnosis)."""

    layer: int
    heads: list[dict]  # per head: its sink key, score, top pairs and their share, top sources, the split
    sources: list[str]
    key_side: list[list[float]]  # (heads, sources): each source's key-side share of the head's score
    recipe: dict = field(default_factory=dict)

    def leading(self) -> tuple[str, int]:
        """The source that contributes most to the sink key's score in the most heads, and in how many."""
        tops = [h["key_sources"][0][0] for h in self.heads]
        best = max(tops, key=tops.count)  # a tie goes to the lowest head's source: the same in every process
        return best, tops.count(best)

    def as_json(self) -> dict:
        name, count = self.leading()
        return {"layer": self.layer, "heads": self.heads, "leading_source": name, "leading_heads": count,
                "recipe": self.recipe}


@torch.no_grad()
def diagnose(run: Residual, layer: int, key: int | str = "sink", top: int = 3) -> Diagnosis:
    """For every head of ``layer``: its sink key (the argmax of the column mean of its attention under the
    layer's mask, docs/methods.md#sink-key-and-shift-rate; or ``key`` itself), the attribution of that key
    averaged over every query that sees it, the share of |score| held by its top 1, 4 and 8 rotary pairs,
    its ``top`` sources on each side and the embedding / attention / MLP split of the key side."""
    layer = run.check(layer, 0)
    heads, matrix, names = [], [], None
    for h in range(run.loaded.n_heads):
        part = run.head(layer, h)
        if key == "sink":
            j = run.sink_key(layer, h, part)
        else:
            j = int(key)
        e = run.explain(layer, h, "all", j, part)
        order = sorted(range(len(e.by_pair)), key=lambda p: -abs(e.by_pair[p]))
        ranked = lambda d: sorted(d.items(), key=lambda kv: -abs(kv[1]))[:top]  # noqa: E731
        heads.append({"head": h, "key": j, "token": e.tokens[1], "score": round(e.score, 6),
                      "nope_score": round(e.nope_score, 6),
                      "top_pairs": [{"pair": p, "frequency": round(e.frequencies[p], 6), "contribution": round(e.by_pair[p], 6)}
                                    for p in order[:8]],
                      "pair_share": {str(k): round(e.top_pairs_share(k), 4) for k in (1, 4, 8)} if e.by_pair else None,
                      "key_sources": [(n, round(v, 6)) for n, v in ranked(e.key_sources)],
                      "query_sources": [(n, round(v, 6)) for n, v in ranked(e.query_sources)],
                      "key_split": {k: round(v, 6) for k, v in e.key_split.items()}})
        names = list(e.key_sources)
        matrix.append([e.key_sources[n] for n in names])
    return Diagnosis(layer, heads, names, matrix, run.built.recipe.to_dict())


@dataclass
class QueryKeyView:
    """One head's rotated queries and keys, of one text or of several pooled, in one 2D picture
    (docs/methods.md#query-key-view)."""

    layer: int
    head: int
    points: list[tuple[float, float]]  # the n queries, then the n keys (n: all texts' tokens, text by text)
    tokens: list[str]
    positions: list[int]  # each token's position in its text
    samples: list[int]  # each token's text (0: the first)
    sink_keys: list[int]  # each text's sink key, as an index into ``tokens``
    scale: float  # c: queries times c, keys (translated) divided by c
    method: str = "pca"

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def sink_key(self) -> int:
        """The first text's sink key."""
        return self.sink_keys[0]

    def where(self, point: int) -> tuple[str, int, int]:
        """A point's kind ("query" or "key"), its text and its position in that text."""
        kind, index = ("query", point) if point < self.n else ("key", point - self.n)
        return kind, self.samples[index], self.positions[index]


@torch.no_grad()
def attentionviz(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """AttentionViz's normalisation (Yeh et al., IEEE VIS 2023): keys translated by μ_q − μ_k (every score of
    a row moves by the same amount: its softmax is unchanged), then queries scaled by
    c = sqrt(mean‖k‖ / mean‖q‖) and keys by 1/c (every product unchanged; both clouds get one mean norm)."""
    k = k + (q.mean(0) - k.mean(0))
    c = float(torch.sqrt(k.norm(dim=-1).mean() / q.norm(dim=-1).mean()))
    return q * c, k / c, c


PROJECTIONS = {"pca": None, "tsne": ("sklearn.manifold", "scikit-learn"), "umap": ("umap", "umap-learn")}


def project(points: torch.Tensor, method: str = "pca") -> torch.Tensor:
    """(N, D) to (N, 2). PCA is deterministic (each component's sign fixed by its largest entry); t-SNE
    (scikit-learn: ``pip install 'attnviz[projection]'``) and UMAP (``pip install umap-learn``; not pinned or
    tested here, it pulls numba) run where those are installed, seeded, so the same points give the same picture."""
    if method not in PROJECTIONS:
        raise InputError(f"unknown projection '{method}'; expected one of {', '.join(PROJECTIONS)}")
    if method == "pca":
        centred = points - points.mean(0)
        _, _, v = torch.linalg.svd(centred, full_matrices=False)
        axes = v[:2]
        axes = axes * torch.sign(axes.gather(1, axes.abs().argmax(1, keepdim=True)))
        return centred @ axes.T
    module, package = PROJECTIONS[method]
    try:
        lib = importlib.import_module(module)
    except ImportError:
        extra = " (or attnviz[projection])" if method == "tsne" else ""
        raise InputError(f"the {method} projection needs {package}, which is not installed: "
                         f"pip install {package}{extra}; PCA needs nothing") from None
    data = points.double().cpu().numpy()
    if method == "tsne":
        fitted = lib.TSNE(n_components=2, init="pca", random_state=0,
                          perplexity=float(min(30.0, max(2.0, (len(data) - 1) / 3)))).fit_transform(data)
    else:
        fitted = lib.UMAP(n_components=2, random_state=0, n_neighbors=min(15, len(data) - 1)).fit_transform(data)
    return torch.from_numpy(fitted).float()


@torch.no_grad()
def query_key_view(runs: "Residual | list[Residual]", layer: int, head: int, method: str = "pca") -> QueryKeyView:
    """The head's rotated queries and keys after :func:`attentionviz` (means over every point shown), of one
    run or of several pooled (as AttentionViz pools a corpus's samples), projected together by ``method``."""
    runs = [runs] if isinstance(runs, Residual) else list(runs)
    if not runs:
        raise InputError("the query-key view needs at least one text")
    qs, ks, tokens, sinks, positions, samples = [], [], [], [], [], []
    for s, run in enumerate(runs):
        layer = run.check(layer, head)
        part = run.head(layer, head)
        sinks.append(len(tokens) + run.sink_key(layer, head, part))
        qs.append(part["q"]), ks.append(part["k"])
        tokens += list(run.tokens)
        positions += list(range(run.n_tokens))
        samples += [s] * run.n_tokens
    q, k, c = attentionviz(torch.cat(qs), torch.cat(ks))
    xy = project(torch.cat([q, k]), method)
    return QueryKeyView(layer, head, [tuple(map(float, p)) for p in xy], tokens, positions, samples, sinks, c, method)


def corpus_samples(loaded: LoadedModel, count: int, tokens: int = 96) -> list[str]:
    """The first ``count`` topics of the default corpus (Python's own ``pydoc_data.topics``), each cut to its
    first ``tokens`` tokens: the samples the query-key view pools beside a text."""
    from attnviz import corpus

    return [corpus.text_of(loaded.tokenizer, corpus.head_ids(loaded.tokenizer, text, tokens))
            for text in corpus.stdlib().documents[:count]]
