"""KV-cache compression scorers (SPEC §13), in the style of NVIDIA kvpress: each method is one short
class with one ``score()`` over the same inputs, and the shared base does the keeping. kvpress itself
cannot be a dependency (it pins transformers < 5.3); each class cites the kvpress 0.5 file it follows.

``score(context)`` gets one layer's :class:`Context` (the context's attention under the current
architecture, its keys, which query heads share each KV head) and returns (H_kv, C) scores, higher
kept first. :meth:`Press.keep` keeps the top ceil((1 - r)·C) keys of every KV head (ties: the lower
position wins).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ..errors import InputError


@dataclass
class Context:
    """One layer of the prefilled context: attention (H, C, C) fp32, allow-set (C, C), keys (H_kv, C, d)."""

    layer: int
    attention: torch.Tensor
    allowed: torch.Tensor
    keys: torch.Tensor

    @property
    def n_kv_heads(self) -> int:
        return self.keys.shape[0]

    def per_kv_head(self, per_head: torch.Tensor) -> torch.Tensor:
        """(H, C) → (H_kv, C): the mean over each KV group's query heads."""
        heads = per_head.shape[0]
        return per_head.view(self.n_kv_heads, heads // self.n_kv_heads, -1).mean(1)


class Press:
    """A compression method: ``score`` decides, :meth:`keep` keeps."""

    name = ""

    @property
    def spec(self) -> str:
        return self.name

    def score(self, context: Context) -> torch.Tensor:
        raise NotImplementedError

    def keep(self, context: Context, ratio: float) -> torch.Tensor:
        """(H_kv, C) bool: the top ceil((1 - ratio)·C) keys of every KV head; ties to the lower position."""
        scores = self.score(context).float()
        n = scores.shape[-1]
        count = math.ceil((1.0 - ratio) * n)
        order = torch.sort(-scores, dim=-1, stable=True).indices[:, :count]
        kept = torch.zeros_like(scores, dtype=torch.bool)
        return kept.scatter_(1, order, True)


@dataclass
class Streaming(Press):
    """The first ``s`` keys and the most recent ones (StreamingLLM); kvpress ``presses/streaming_llm_press.py``."""

    s: int = 4
    name = "streaming"

    @property
    def spec(self) -> str:
        return f"streaming(s={self.s})"

    def score(self, context: Context) -> torch.Tensor:
        n = context.keys.shape[1]
        position = torch.arange(n, dtype=torch.float32)
        score = torch.where(position < self.s, float("inf"), position)
        return score.expand(context.n_kv_heads, n)


class Observed(Press):
    """H2O-like observed attention: sum_i A[i,k] / (context queries that see k), mean over the KV group
    (SPEC §6's alpha_k); kvpress ``presses/observed_attention_press.py``."""

    name = "observed"

    def score(self, context: Context) -> torch.Tensor:
        allowed = context.allowed.float()
        sums = (context.attention * allowed).sum(1)
        return context.per_kv_head(sums / allowed.sum(0).clamp(min=1))


@dataclass
class SnapKV(Press):
    """The mean attention of the last ``window`` context queries to each key, average-pooled over keys
    (``kernel``, stride 1, padding kernel // 2), mean over the KV group; the window's own keys are always
    kept (arXiv 2404.14469); kvpress ``presses/snapkv_press.py``."""

    window: int = 64
    kernel: int = 5
    name = "snapkv"

    @property
    def spec(self) -> str:
        return f"snapkv(window={self.window}, kernel={self.kernel})"

    def score(self, context: Context) -> torch.Tensor:
        n = context.attention.shape[-1]
        if n < self.window:
            raise InputError(f"snapkv's window ({self.window}) is longer than the context ({n} tokens): "
                             "lengthen --context or shorten the window")
        recent = context.attention[:, n - self.window:, :].mean(1)  # (H, C)
        pooled = torch.nn.functional.avg_pool1d(recent[:, None, :], self.kernel, stride=1,
                                                padding=self.kernel // 2)[:, 0, :n]
        score = context.per_kv_head(pooled)
        score[:, n - self.window:] = float("inf")
        return score


class TOVA(Press):
    """The last context query's attention, averaged over all heads (arXiv 2401.06104); kvpress
    ``presses/tova_press.py``."""

    name = "tova"

    def score(self, context: Context) -> torch.Tensor:
        last = context.attention[:, -1, :].mean(0)
        return last.expand(context.n_kv_heads, -1)


class KNorm(Press):
    """Minus the key's L2 norm: the keys of the smallest norm are kept (arXiv 2406.11430); kvpress
    ``presses/knorm_press.py``."""

    name = "knorm"

    def score(self, context: Context) -> torch.Tensor:
        return -context.keys.float().norm(dim=-1)


@dataclass
class Random(Press):
    """Random scores, seeded per (seed, layer); kvpress ``presses/random_press.py``."""

    seed: int = 0
    name = "random"

    @property
    def spec(self) -> str:
        return f"random(seed={self.seed})"

    def score(self, context: Context) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + context.layer)
        return torch.rand(context.keys.shape[:2], generator=generator)


PRESSES = {"streaming": Streaming, "observed": Observed, "snapkv": SnapKV, "tova": TOVA, "knorm": KNorm,
           "random": Random}
ARGS = {"streaming": {"s"}, "snapkv": {"window", "kernel"}, "random": {"seed"}}
DEFAULTS = ["streaming(s=4)", "observed", "snapkv(window=64, kernel=5)", "tova", "knorm", "random(seed=0)"]


def parse(text: str) -> Press:
    """``streaming(s=4)``, ``observed``, ``snapkv(window=64, kernel=5)``, ``tova``, ``knorm``, ``random(seed=0)``."""
    match = re.fullmatch(r"\s*([a-z]+)\s*(?:\((.*)\))?\s*", text or "")
    name = match.group(1) if match else ""
    if name not in PRESSES:
        raise InputError(f"unknown press '{text}': use {', '.join(DEFAULTS)}")
    args = {}
    for piece in (p.strip() for p in (match.group(2) or "").split(",") if p.strip()):
        key, _, value = piece.partition("=")
        key = key.strip()
        if key not in ARGS.get(name, set()):
            raise InputError(f"{name} takes {', '.join(sorted(ARGS.get(name, set()))) or 'no arguments'}, not '{key}'")
        try:
            args[key] = int(value)
        except ValueError:
            raise InputError(f"{name} {key} must be a whole number, got '{value.strip()}'") from None
        if args[key] < (0 if key == "seed" else 1):
            raise InputError(f"{name} {key} must be positive, got {args[key]}")
    return PRESSES[name](**args)
