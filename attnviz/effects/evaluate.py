"""Perplexity and next-token accuracy of a text under an architecture (docs/methods.md#evaluation).

The windows follow transformers' perplexity guide, so a user can reproduce every number with stock
transformers: windows start at 0, S, 2S, ... and end at min(start + W, n); each predicts the
positions after its first that no earlier window predicted. Only causal-compatible architectures
have a perplexity: under BACK/BIDIR a query reads the token it predicts (refused, never a number).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from attnviz.core.spec import arch as arch_mod
from attnviz.core.loading.models import LoadedModel
from attnviz.corpus import head_ids
from attnviz.errors import InputError

DEFAULT_WINDOW = 512
DEFAULT_MAX_TOKENS = 4096


@dataclass
class Evaluation:
    model: str
    arch: str
    nll: float
    accuracy: float
    tokens: int  # predicted tokens
    windows: int
    token_nll: np.ndarray = field(repr=False)  # per predicted token, in text order
    positions: np.ndarray = field(repr=False)  # the position each of them predicts
    residual: str | None = None  # the seed-003 variant, if any
    intervene: str | None = None  # the interventions (docs/methods.md#interventions), if any

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)

    def as_json(self) -> dict:
        return {"model": self.model, "arch": self.arch, "perplexity": round(self.perplexity, 6),
                "accuracy": round(self.accuracy, 6), "nll": round(self.nll, 6), "tokens": self.tokens,
                "windows": self.windows} | ({"residual": self.residual} if self.residual else {}) \
            | ({"intervene": self.intervene} if self.intervene else {})


def token_ids(loaded: LoadedModel, text: str, max_tokens: int | None = None) -> list[int]:
    """Token ids of a (long) text, at most ``max_tokens``; no model-length limit here, windows handle it."""
    if not isinstance(text, str) or not text.strip():
        raise InputError("the text is empty: give a text or corpus with some words")
    if max_tokens is not None and max_tokens < 2:
        raise InputError(f"--max-tokens must be at least 2, got {max_tokens}")
    ids = head_ids(loaded.tokenizer, text, max_tokens)
    if len(ids) < 2:
        raise InputError(f"the text has {len(ids)} token(s); at least 2 are needed to predict one")
    return ids


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """``(start, end, first_predicted)`` of every window over ``n`` tokens (docs/methods.md#evaluation)."""
    spans, predicted_to = [], 1  # position 0 has no prefix: never predicted
    for start in range(0, n, stride):
        end = min(start + window, n)
        spans.append((start, end, max(start + 1, predicted_to)))
        predicted_to = end
        if end == n:
            break
    return spans


def check_window(window: int, stride: int, n: int, loaded: LoadedModel) -> None:
    if window <= 0:
        raise InputError(f"the window must be positive, got {window}")
    if window > n:
        raise InputError(f"the window ({window}) is longer than the text ({n} tokens): use a window <= {n}")
    if window > loaded.max_tokens:
        raise InputError(f"the window ({window}) is longer than {loaded.model_id} takes ({loaded.max_tokens})")
    if not 0 < stride <= window:
        raise InputError(f"the stride must be between 1 and the window ({window}), got {stride}")


def evaluate(loaded: LoadedModel, text_or_ids: str | list[int], recipe: str | arch_mod.Architecture = "fwd",
             window: int = DEFAULT_WINDOW, stride: int | None = None, max_tokens: int | None = DEFAULT_MAX_TOKENS,
             on_window: Callable[[int, int], None] | None = None) -> Evaluation:
    """Perplexity, accuracy and mean NLL of a text (or token ids) under ``recipe``: an architecture string, or a
    recipe with its interventions (docs/methods.md#interventions, applied throughout) and residual variant (a
    fine-tuned directory's own variant is used when none is named).

    ``on_window(done, total)`` reports progress after each window.
    """
    from attnviz import recipe as recipe_mod

    built = recipe_mod.build(loaded, recipe).only(
        "a perplexity (it scores the text as written)", "intervene", "residual", "kind")
    variant, acts = built.variant, built.interventions
    architecture = built.architecture.require_causal("compute a perplexity")
    ids = text_or_ids if isinstance(text_or_ids, list) else token_ids(loaded, text_or_ids, max_tokens)
    if len(ids) < 2:
        raise InputError(f"the text has {len(ids)} token(s); at least 2 are needed to predict one")
    stride = window if stride is None else stride
    check_window(window, stride, len(ids), loaded)
    spans = windows(len(ids), window, stride)
    all_ids = torch.tensor([ids])
    nlls, hits, positions = [], [], []
    for done, (start, end, first) in enumerate(spans, 1):
        logits = built.forward(loaded, all_ids[:, start:end])[0]
        logprobs = torch.log_softmax(logits[0, first - 1 - start:end - 1 - start].float(), -1)
        targets = all_ids[0, first:end].to(logprobs.device)
        nlls.append(-logprobs.gather(-1, targets[:, None])[:, 0].cpu())
        hits.append((logprobs.argmax(-1) == targets).cpu())
        positions.append(torch.arange(first, end))
        if on_window:
            on_window(done, len(spans))
    token_nll = torch.cat(nlls).double().numpy()
    return Evaluation(model=loaded.model_id, arch=architecture.spec, residual=variant.name if variant else None,
                      intervene=acts.spec or None, nll=float(token_nll.mean()),
                      accuracy=float(torch.cat(hits).float().mean()), tokens=int(token_nll.size),
                      windows=len(spans), token_nll=token_nll, positions=torch.cat(positions).numpy())
