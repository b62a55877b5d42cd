"""Why a head attends there (docs/methods.md#score-attribution): the attribution of one score, the sinks'
diagnosis of a whole layer (docs/methods.md#the-sinks-diagnosis) and the query-key view
(docs/methods.md#query-key-view). The kept forward every one of them reads, and the attribution itself, are
:mod:`attnviz.effects.attribution`'s (:class:`KeptForward`, :class:`Explanation`), importable from here too.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

from attnviz.core.loading import models
from attnviz.core.loading.models import LoadedModel
from attnviz.effects.attribution import Explanation, KeptForward, checked_layer
from attnviz.errors import InputError

DIAGNOSIS_TOKENS = 256  # the text a sweep's explain measure diagnoses: its corpus's first tokens

__all__ = ["DIAGNOSIS_TOKENS", "PROJECTIONS", "Diagnosis", "Explanation", "KeptForward", "QueryKeyView", "attentionviz",
           "corpus_samples", "diagnose", "explain", "project", "query_key_view"]


@torch.no_grad()
def explain(loaded: LoadedModel, text: str, recipe="fwd", *, layer: int, head: int, query: int | str,
            key: int) -> Explanation:
    """The attribution of s[query, key] of ``head`` in ``layer`` (:mod:`attnviz.effects.attribution`); ``recipe`` is an
    architecture string or a :class:`~attnviz.recipe.Recipe`. ``query="all"`` averages over every query
    the layer's mask lets see ``key``. One forward, up to the layer."""
    models.require(loaded, "explain")
    run = KeptForward(loaded, text, recipe, upto=checked_layer(loaded, layer))
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
def diagnose(run: KeptForward, layer: int, key: int | str = "sink", top: int = 3) -> Diagnosis:
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
        """A point's side ("query" or "key"), its text and its position in that text."""
        side, index = ("query", point) if point < self.n else ("key", point - self.n)
        return side, self.samples[index], self.positions[index]


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
def query_key_view(runs: "KeptForward | list[KeptForward]", layer: int, head: int, method: str = "pca") -> QueryKeyView:
    """The head's rotated queries and keys after :func:`attentionviz` (means over every point shown), of one
    run or of several pooled (as AttentionViz pools a corpus's samples), projected together by ``method``."""
    runs = [runs] if isinstance(runs, KeptForward) else list(runs)
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
