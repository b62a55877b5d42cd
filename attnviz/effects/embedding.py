"""The embedding probe of docs/methods.md#evaluation: is a decoder with converted top layers a better text encoder?

Seed 000 asks it; the probe answers it offline. Each document is tokenized once (tokenizer
defaults); one with at least 2M tokens gives a query (its first M ids) and a target (its next M
ids), each fed as its own sequence. Embedding = mean over the M positions of the last hidden state
(after the final norm, the upstream code's mean pooling). Score: recall@1 and MRR of each query's
own target among all targets by cosine similarity. A target's rank is 1 + the number of targets
scoring strictly higher, so ties never flatter the model beyond the first place they share.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from attnviz.core.spec import arch as arch_mod
from attnviz.core import engine
from attnviz.core.loading.models import LoadedModel
from attnviz.corpus import head_ids
from attnviz.errors import InputError

DEFAULT_M = 64
BATCH = 32

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ProbeResult:
    arch: str
    recall_at_1: float
    mrr: float
    n_docs: int
    m: int
    k: int | None = None

    def as_json(self) -> dict:
        doc = {"arch": self.arch, "recall_at_1": round(self.recall_at_1, 6), "mrr": round(self.mrr, 6),
               "n_docs": self.n_docs}
        return doc if self.k is None else {"k": self.k, **doc}


def pairs(loaded: LoadedModel, documents: Sequence[str], m: int = DEFAULT_M,
          max_docs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(queries, targets), each (N, m) token ids, from the documents long enough for both."""
    if m < 1:
        raise InputError(f"m must be at least 1, got {m}")
    queries, targets = [], []
    for doc in documents:
        ids = head_ids(loaded.tokenizer, doc, 2 * m)
        if len(ids) >= 2 * m:
            queries.append(ids[:m])
            targets.append(ids[m:2 * m])
        if max_docs and len(queries) >= max_docs:
            break
    if len(queries) < 2:
        raise InputError(
            f"the corpus is too small for the probe: {len(queries)} of {len(documents)} document(s) have at "
            f"least 2m = {2 * m} tokens, and at least 2 are needed (give more or longer documents, or a smaller m)"
        )
    return torch.tensor(queries), torch.tensor(targets)


def embed(loaded: LoadedModel, ids: torch.Tensor, architecture: arch_mod.Architecture,
          on_batch: Callable[[int], None] | None = None) -> torch.Tensor:
    """Mean-pooled last hidden state of each row of ``ids`` (all rows the same length, no padding)."""
    out = []
    for start in range(0, len(ids), BATCH):
        output, _ = engine.forward(loaded.model, ids[start:start + BATCH], architecture.layers, engine.NOTHING,
                                   engine.Feed(lm_head=False))
        out.append(output.last_hidden_state.float().mean(1).cpu())
        if on_batch:
            on_batch(min(start + BATCH, len(ids)))
    return torch.cat(out)


def retrieval_scores(query_emb: torch.Tensor, target_emb: torch.Tensor) -> tuple[float, float, np.ndarray]:
    """(recall@1, MRR, ranks) of each query's own target (same row) among all targets, by cosine."""
    q = torch.nn.functional.normalize(query_emb.double(), dim=-1)
    t = torch.nn.functional.normalize(target_emb.double(), dim=-1)
    sim = q @ t.T
    own = sim.diagonal()[:, None]
    ranks = 1 + (sim > own).sum(-1).numpy()
    return float(np.mean(ranks == 1)), float(np.mean(1.0 / ranks)), ranks


def probe(loaded: LoadedModel, documents: Sequence[str], recipe: str | arch_mod.Architecture = "fwd",
          m: int = DEFAULT_M, max_docs: int | None = None, on_progress: Progress | None = None,
          ids: tuple[torch.Tensor, torch.Tensor] | None = None) -> ProbeResult:
    """Recall@1 and MRR of the probe under one architecture; ``on_progress(done, total)`` per batch."""
    from attnviz.recipe import build

    architecture = build(loaded, recipe).only("the embedding probe").architecture
    queries, targets = ids if ids is not None else pairs(loaded, documents, m, max_docs)
    both = torch.cat([queries, targets])
    emb = embed(loaded, both, architecture, on_batch=(lambda done: on_progress(done, len(both))) if on_progress else None)
    recall, mrr, _ = retrieval_scores(emb[:len(queries)], emb[len(queries):])
    return ProbeResult(architecture.spec, recall, mrr, len(queries), queries.shape[1])


def parse_ks(text: str | Iterable[int] | None, n_layers: int) -> list[int]:
    """``None``/"all" → 0..L; "0,4,8" or a list → those k, each checked against the layer count."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("", "all")):
        return list(range(n_layers + 1))
    items = text.split(",") if isinstance(text, str) else list(text)
    ks = []
    for item in items:
        try:
            k = int(str(item).strip())
        except ValueError:
            raise InputError(f"k '{item}' is not a whole number") from None
        if not 0 <= k <= n_layers:
            raise InputError(f"k={k} but the model has {n_layers} layers (0 <= k <= {n_layers})")
        ks.append(k)
    return sorted(set(ks))


def sweep(loaded: LoadedModel, documents: Sequence[str], template: str, ks: Iterable[int] | str | None = None,
          m: int = DEFAULT_M, max_docs: int | None = None,
          on_row: Callable[[ProbeResult], None] | None = None,
          on_progress: Progress | None = None) -> list[ProbeResult]:
    """The probe for a named architecture at each k (seed 000's sweep); tokenized once, and layer
    lists that coincide (every template is plain FWD at k = 0) are computed once."""
    ks = parse_ks(ks, loaded.n_layers)
    archs = [(k, arch_mod.with_k(template, k, loaded.n_layers)) for k in ks if _valid_k(template, k)]
    if not archs:
        raise InputError(f"no k in {ks} fits '{template}' (k must be at least k0)")
    ids = pairs(loaded, documents, m, max_docs)
    per_step = 2 * len(ids[0])
    seen: dict[str, ProbeResult] = {}
    rows = []
    for step, (k, architecture) in enumerate(archs):
        key = architecture.as_list()
        if key not in seen:
            progress = (lambda done, total, s=step: on_progress(s * per_step + done, len(archs) * per_step)) \
                if on_progress else None
            seen[key] = probe(loaded, (), architecture, ids=ids, on_progress=progress)
        result = seen[key]
        row = ProbeResult(architecture.spec, result.recall_at_1, result.mrr, result.n_docs, result.m, k)
        rows.append(row)
        if on_row:
            on_row(row)
    return rows


def _valid_k(template: str, k: int) -> bool:
    k0 = re.search(r"k0\s*=\s*(\d+)", template)
    return k0 is None or k >= int(k0.group(1))
