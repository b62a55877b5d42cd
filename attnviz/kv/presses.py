"""KV-cache compression scorers (docs/methods.md#kv-cache-compression), in the style of NVIDIA kvpress:
each method is one short registered dataclass with one ``score()`` over the same inputs, and the shared
base does the keeping. kvpress itself cannot be a dependency (it pins transformers < 5.3); each class
cites the kvpress 0.5 file it follows, and keeps exactly the keys kvpress 0.5.5 keeps.

``score(context)`` gets one layer's :class:`Context` (the context's attention under the current
architecture, its keys, which query heads share each KV head) and returns (H_kv, C) scores, higher
kept first. :meth:`Press.keep` keeps the top ``int(C·(1 - r))`` keys of every KV head, as kvpress's
``ScorerPress.compress`` does. Ties go to the lower position (kvpress's ``topk`` leaves them undefined).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from attnviz.core.spec import syntax
from attnviz.errors import InputError

#: Every press by name; parameters and defaults are read from each dataclass's fields.
PRESSES = syntax.Registry("press")


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


def kept_count(n: int, ratio: float) -> int:
    """How many of ``n`` keys a press keeps at compression ratio ``ratio``: ``int(n·(1 - r))``, kvpress's
    ``n_kept`` (``presses/scorer_press.py``), in the same float arithmetic."""
    return int(n * (1 - ratio))


@dataclass
class Press:
    """A compression method: ``score`` decides, :meth:`keep` keeps."""

    name: ClassVar[str] = ""

    @property
    def spec(self) -> str:
        return PRESSES.spec(self)

    def __post_init__(self):
        for key in syntax.fields_of(type(self)):
            value = getattr(self, key)
            if value < (0 if key == "seed" else 1):
                raise InputError(f"{self.name} {key} must be positive, got {value}")

    def score(self, context: Context) -> torch.Tensor:
        raise NotImplementedError

    def keep(self, context: Context, ratio: float) -> torch.Tensor:
        """(H_kv, C) bool: the top :func:`kept_count` keys of every KV head; ties to the lower position."""
        scores = self.score(context).float()
        count = kept_count(scores.shape[-1], ratio)
        order = torch.sort(-scores, dim=-1, stable=True).indices[:, :count]
        kept = torch.zeros_like(scores, dtype=torch.bool)
        return kept.scatter_(1, order, True)


@PRESSES.register()
@dataclass
class Streaming(Press):
    """The first ``s`` keys and the most recent ones (StreamingLLM); kvpress ``presses/streaming_llm_press.py``."""

    name: ClassVar[str] = "streaming"
    s: int = 4

    def score(self, context: Context) -> torch.Tensor:
        n = context.keys.shape[1]
        position = torch.arange(n, dtype=torch.float32)
        score = torch.where(position < self.s, float("inf"), position)
        return score.expand(context.n_kv_heads, n)


@PRESSES.register()
@dataclass
class Observed(Press):
    """H2O-like observed attention: sum_i A[i,k] / (context queries that see k), mean over the KV group
    (docs/methods.md#alpha); kvpress ``presses/observed_attention_press.py``."""

    name: ClassVar[str] = "observed"

    def score(self, context: Context) -> torch.Tensor:
        allowed = context.allowed.float()
        sums = (context.attention * allowed).sum(1)
        return context.per_kv_head(sums / allowed.sum(0).clamp(min=1))


@PRESSES.register()
@dataclass
class SnapKV(Press):
    """SnapKV (arXiv 2404.14469) as kvpress ``presses/snapkv_press.py`` computes it: the last ``window``
    context queries' attention to the keys *before* the window (``attentions[..., -w:, :-w]``), averaged
    over those queries, average-pooled over keys (``kernel``, stride 1, zero padding ``kernel // 2``),
    then over each KV group; the window's own keys score the maximum plus one, so they are always kept."""

    name: ClassVar[str] = "snapkv"
    window: int = 64
    kernel: int = 5

    def score(self, context: Context) -> torch.Tensor:
        n = context.attention.shape[-1]
        if n <= self.window:
            raise InputError(f"snapkv's window ({self.window}) must be shorter than the context ({n} tokens): "
                             "lengthen --context or shorten the window")
        observed = context.attention[:, n - self.window:, :n - self.window].mean(1)  # (H, C - w)
        pooled = torch.nn.functional.avg_pool1d(observed[:, None, :], self.kernel, stride=1,
                                                padding=self.kernel // 2)[:, 0, :n - self.window]
        score = context.per_kv_head(pooled)
        window = torch.full((score.shape[0], self.window), float(score.max()) + 1.0)
        return torch.cat([score, window], dim=-1)


@PRESSES.register()
@dataclass
class TOVA(Press):
    """TOVA (arXiv 2401.06104) as kvpress ``presses/tova_press.py`` computes it: the last context query's
    attention to every earlier key, averaged over all heads; the last key itself scores the maximum
    plus one, so it is always kept."""

    name: ClassVar[str] = "tova"

    def score(self, context: Context) -> torch.Tensor:
        last = context.attention[:, -1, :-1].mean(0)
        score = torch.cat([last, (last.max() + 1.0).reshape(1)]) if last.numel() else torch.ones(1)
        return score.expand(context.n_kv_heads, -1)


@PRESSES.register()
@dataclass
class KNorm(Press):
    """Minus the key's L2 norm: the keys of the smallest norm are kept (arXiv 2406.11430); kvpress
    ``presses/knorm_press.py``."""

    name: ClassVar[str] = "knorm"

    def score(self, context: Context) -> torch.Tensor:
        return -context.keys.float().norm(dim=-1)


@PRESSES.register()
@dataclass
class Random(Press):
    """Random scores, seeded per (seed, layer); kvpress ``presses/random_press.py``."""

    name: ClassVar[str] = "random"
    seed: int = 0

    def score(self, context: Context) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + context.layer)
        return torch.rand(context.keys.shape[:2], generator=generator)


#: Every press with its default parameters: the CLI's, the app's and the sweep's default selection.
DEFAULTS = [PRESSES.example(name) for name in PRESSES.names()]
USAGE = ", ".join(DEFAULTS)


def parse(text: str) -> Press:
    """``streaming(s=4)``, ``observed``, ``snapkv(window=64, kernel=5)``, ``tova``, ``knorm``, ``random(seed=0)``."""
    if isinstance(text, Press):
        return text
    parsed = syntax.call(text or "", "press", USAGE)
    if parsed.layers is not None:
        raise InputError(f"a press acts on every layer: drop '@{parsed.layers}' from '{parsed.text}'")
    return PRESSES.build(parsed)
