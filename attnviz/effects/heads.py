"""Head taxonomy (docs/methods.md#head-classes): which heads are sinks, which are streaming heads, which are inactive.

Per (layer, head), on one text or averaged over the samples of a dataset (the sink-rate protocol, docs/methods.md#sink-rate):
- **sink**: alpha_0 > eps;
- **streaming score** (DuoAttention's pattern, measured instead of trained): the mean over queries
  i >= s + w of the attention on the first s keys plus the last w keys up to i; >= tau is a
  streaming head, the others may retrieve;
- **output norm score** (AHON-LN): the mean over queries of ||W_O^h sum_j A[i,j] v_j^h||, divided by
  the mean of the same over the layer's heads; < tau is inactive.

And the two claims, each one number against the model: give only the streaming heads a sink +
window cache (a per-head mask, :attr:`attnviz.core.engine.Run.head_masks`), and ablate the inactive heads
(``ablate``, docs/methods.md#ablate).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np
import torch

from attnviz.capture import capture
from attnviz.plan import Keep
from attnviz.recipe import Recipe
from attnviz.core import engine
from attnviz.core.loading.models import LoadedModel
from attnviz.effects.evaluate import Evaluation, evaluate
from attnviz.errors import InputError
from attnviz.stats import metrics

SINK, WINDOW = 4, 64
TAU_STREAM, TAU_INACTIVE = 0.9, 0.2
MAX_BYTES = 1 << 30  # the fp32 maps of every layer that one text may take: 1 GB (~1,000 tokens on SmolLM2)


def max_tokens(loaded: LoadedModel, budget: int | None = None) -> int:
    """The longest text whose every layer's fp32 maps (what the scores are computed from) fit ``budget``
    (default :data:`MAX_BYTES`)."""
    per_token_pair = 4 * loaded.n_heads * loaded.n_layers
    return max(2, min(loaded.max_tokens, int(((budget or MAX_BYTES) / per_token_pair) ** 0.5)))


def streaming_score(probs: np.ndarray, s: int = SINK, w: int = WINDOW) -> np.ndarray:
    """(H,) mean over queries i >= s + w of A[i, :s].sum() + A[i, i-w+1 : i+1].sum(); NaN without such queries."""
    probs = np.asarray(probs, dtype=np.float64)
    n = probs.shape[-1]
    if n <= s + w:
        return np.full(probs.shape[0], np.nan)
    i, j = np.indices((n, n))
    pattern = (j < s) | ((j <= i) & (j > i - w))
    rows = probs[:, s + w:, :] * pattern[s + w:][None]
    return rows.sum(-1).mean(-1)


def output_norms(probs: np.ndarray, values: np.ndarray, w_o: np.ndarray) -> np.ndarray:
    """(H,) the mean over queries of ||W_O^h sum_j A[i,j] v_j^h|| (values (H_kv, n, d), W_O (hidden, H·d)): each
    query's norm as :func:`attnviz.effects.induction.query_outputs` computes it, averaged."""
    from attnviz.effects.induction import query_outputs

    return query_outputs(np.asarray(probs)[None], np.asarray(values)[None], w_o)[0].mean(-1)


def ahon(norms: np.ndarray) -> np.ndarray:
    """Each head's output norm over the mean of its layer's heads (AHON-LN)."""
    norms = np.asarray(norms, dtype=np.float64)
    mean = norms.mean()
    return norms / mean if mean > 0 else np.zeros_like(norms)


#: A head that holds several classes is shown in the first it holds (docs/methods.md#head-classes).
PRECEDENCE = ("inactive", "streaming", "sink")


@dataclass
class Taxonomy:
    model: str
    arch: str
    samples: int
    alpha0: np.ndarray  # (L, H)
    streaming_score: np.ndarray  # (L, H), NaN where no query is past s + w
    ahon: np.ndarray  # (L, H)
    eps: float = metrics.SINK_EPS
    tau_stream: float = TAU_STREAM
    tau_inactive: float = TAU_INACTIVE
    s: int = SINK
    w: int = WINDOW
    tokens: list[str] = field(default_factory=list, repr=False)

    @property
    def sink(self) -> np.ndarray:
        return np.nan_to_num(self.alpha0, nan=0.0) > self.eps

    @property
    def streaming(self) -> np.ndarray:
        return np.nan_to_num(self.streaming_score, nan=-1.0) >= self.tau_stream

    @property
    def inactive(self) -> np.ndarray:
        return self.ahon < self.tau_inactive

    def with_thresholds(self, eps=None, tau_stream=None, tau_inactive=None) -> "Taxonomy":

        return replace(self, eps=self.eps if eps is None else eps,
                       tau_stream=self.tau_stream if tau_stream is None else tau_stream,
                       tau_inactive=self.tau_inactive if tau_inactive is None else tau_inactive)

    def classes(self) -> np.ndarray:
        """(L, H) one class per head for a grid: the first of :data:`PRECEDENCE` the head holds, else retrieval."""
        out = np.full(self.alpha0.shape, "retrieval", dtype=object)
        for name in reversed(PRECEDENCE):
            out[getattr(self, name)] = name
        return out

    def as_json(self) -> dict:
        def num(x):
            return None if not np.isfinite(x) else round(float(x), 6)

        return {"model": self.model, "arch": self.arch, "samples": self.samples, "eps": self.eps,
                "tau_stream": self.tau_stream, "tau_inactive": self.tau_inactive, "s": self.s, "w": self.w,
                "layers": [{"layer": layer, "heads": [{
                    "head": h, "alpha0": num(self.alpha0[layer, h]), "sink": bool(self.sink[layer, h]),
                    "streaming_score": num(self.streaming_score[layer, h]), "streaming": bool(self.streaming[layer, h]),
                    "ahon": num(self.ahon[layer, h]), "inactive": bool(self.inactive[layer, h])}
                    for h in range(self.alpha0.shape[1])]} for layer in range(self.alpha0.shape[0])]}


def _one(loaded: LoadedModel, text: str, architecture, s: int, w: int):
    cap = capture(loaded, text, architecture, Keep(storage_dtype=torch.float32, qkv=True),
                  max_tokens=max_tokens(loaded))
    modules = engine.attention_modules(loaded.model)
    alpha0, stream, norms = [], [], []
    for layer in cap.layers:
        probs = cap.layer_probs(layer)
        alpha0.append(metrics.alpha(probs, cap.layer_allowed(layer))[:, 0])
        stream.append(streaming_score(probs, s, w))
        w_o = engine.output_projection(modules[layer]).detach().float().cpu().numpy()
        norms.append(ahon(output_norms(probs, cap.layer_qkv(layer).v, w_o)))
    return np.array(alpha0), np.array(stream), np.array(norms), cap


def taxonomy(loaded: LoadedModel, texts: Sequence[str], recipe="fwd", s: int = SINK, w: int = WINDOW,
             eps: float = metrics.SINK_EPS, tau_stream: float = TAU_STREAM, tau_inactive: float = TAU_INACTIVE,
             on_progress: Callable[[int, int], None] | None = None) -> Taxonomy:
    """The scores of every head on one text, or their mean over several (a dataset's samples)."""
    if not texts:
        raise InputError("no text to classify heads on")
    if s < 0 or w < 1:
        raise InputError(f"the streaming pattern needs s >= 0 sink keys and w >= 1 window keys, got s={s}, w={w}")
    from attnviz.recipe import build

    architecture = build(loaded, recipe).only("head classes").architecture
    sums = None
    tokens = []
    for done, text in enumerate(texts, 1):
        alpha0, stream, norms, cap = _one(loaded, text, architecture, s, w)
        if cap.n_tokens <= s + w:
            raise InputError(f"a sample has {cap.n_tokens} tokens; the streaming score needs queries past s + w = "
                             f"{s + w}: give longer samples (--max-len) or a smaller window (--window)")
        parts = (alpha0, stream, norms)
        sums = parts if sums is None else tuple(a + b for a, b in zip(sums, parts))
        tokens = cap.tokens
        if on_progress:
            on_progress(done, len(texts))
    alpha0, stream, norms = (x / len(texts) for x in sums)
    return Taxonomy(loaded.model_id, architecture.spec, len(texts), alpha0, stream, norms, eps, tau_stream,
                    tau_inactive, s, w, tokens)


def dataset_texts(loaded: LoadedModel, documents: Sequence[str], samples: int = 20, max_len: int = 128) -> list[str]:
    """The first ``max_len`` tokens of the first ``samples`` documents long enough (the sink-rate protocol, docs/methods.md#sink-rate), as text."""
    if samples < 2:
        raise InputError(f"a dataset needs at least 2 samples, got {samples}")
    texts = []
    for doc in documents:
        ids = loaded.tokenizer(doc, add_special_tokens=False)["input_ids"]
        if len(ids) >= max_len:
            texts.append(loaded.tokenizer.decode(ids[:max_len]))
        if len(texts) == samples:
            break
    if len(texts) < 2:
        raise InputError(f"only {len(texts)} document(s) have {max_len} tokens: the dataset is too small to average "
                         "head scores over; lower --max-len or give more text")
    return texts


def streaming_only_perplexity(loaded: LoadedModel, text: str, tax: Taxonomy, recipe="fwd") -> tuple[Evaluation, Evaluation]:
    """(dense, streaming heads on sink(s, w)) perplexity of ``text``: the first claim of docs/methods.md#head-classes.
    Only the streaming heads get the sink + window mask (:func:`streaming_spec`, a ``headwindow`` intervention
    in the recipe); every other head stays dense."""
    from attnviz.recipe import build

    built = build(loaded, recipe).only("the streaming heads' perplexity")  # an architecture string or a Recipe
    built.architecture.require_causal("compute a perplexity")
    ids = loaded.tokenizer(text, add_special_tokens=True)["input_ids"]
    if len(ids) > loaded.max_tokens:
        raise InputError(f"the text is {len(ids)} tokens, longer than {loaded.model_id}'s context")
    dense = evaluate(loaded, ids, built.recipe, window=len(ids))
    windowed = evaluate(loaded, ids, Recipe.of(loaded, replace(built.recipe, intervene=streaming_spec(tax))),
                        window=len(ids))
    return dense, windowed


def streaming_spec(tax: Taxonomy) -> str:
    """The ``headwindow`` intervention (docs/methods.md#headwindow) that puts every streaming head on the sink and
    window cache sink(s, w) of the taxonomy, layer by layer."""
    parts = [f"headwindow(heads={','.join(map(str, np.flatnonzero(tax.streaming[layer])))}, s={tax.s}, w={tax.w})"
             f"@{layer}" for layer in range(tax.streaming.shape[0]) if tax.streaming[layer].any()]
    return "; ".join(parts)


def ablation_spec(tax: Taxonomy) -> str:
    """The ``ablate`` intervention (docs/methods.md#interventions) that zeroes every inactive head, layer by layer."""
    parts = [f"ablate(heads={','.join(map(str, np.flatnonzero(tax.inactive[layer])))})@{layer}"
             for layer in range(tax.inactive.shape[0]) if tax.inactive[layer].any()]
    return "; ".join(parts)


def ablate_inactive(loaded: LoadedModel, text: str, tax: Taxonomy, recipe="fwd") -> tuple[Evaluation, Evaluation, float]:
    """(model, inactive heads ablated, share of heads removed): the second claim of docs/methods.md#head-classes."""
    ids = loaded.tokenizer(text, add_special_tokens=True)["input_ids"]
    base = evaluate(loaded, ids, recipe, window=len(ids))
    spec = ablation_spec(tax)
    made = Recipe.of(loaded, recipe)  # the inactive heads ablated on top of the recipe's own interventions
    both = "; ".join(part for part in (made.intervene, spec) if part)
    ablated = evaluate(loaded, ids, Recipe.of(loaded, replace(made, intervene=both)), window=len(ids))
    return base, ablated, float(tax.inactive.mean())
