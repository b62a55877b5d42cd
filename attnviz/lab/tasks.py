"""The lab's tasks, seeded, one class each in :data:`TASKS` (docs/lab.md#tasks-and-tokenizers): Bigram-Backcopy (Guo
et al. 2024, arXiv 2410.13835), repeated random tokens (Olsson et al. 2022) and the text task (:mod:`attnviz.lab.text`).

Bigram-Backcopy: a vocabulary of ``vocab`` tokens: token 0 is BOS, tokens 1..``triggers`` are triggers, the rest
ordinary. Each sequence starts with BOS; after an ordinary token the next is drawn from a fixed random bigram table
over the ordinary tokens, or is a trigger with probability ``p_trigger``; after a trigger the next token copies the
token just before the trigger. The copy needs attention (to the previous token); the bigram needs none, so the
queries after ordinary tokens are the ones that have nothing to attend to: where a sink forms.

A task is one frozen dataclass with a ``name`` (what a checkpoint's setup saves), an ``option`` (``attnviz train
--task``), ``vocab``, ``length``, ``seed``, ``batch(size, step)`` and ``tokenizer_object()``; a task whose copies need
attention also marks them (``needs_attention``) and names the tokens it draws from (``ordinary``).
``Setup.from_dict`` and ``attnviz train --task`` read :data:`TASKS` alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from attnviz.errors import InputError
from attnviz.lab import fields
from attnviz.lab.text import Text, bigram_tokenizer

BOS = 0


@dataclass(frozen=True)
class BigramBackcopy:
    vocab: int = 64
    triggers: int = 3
    length: int = 64
    p_trigger: float = 0.1
    seed: int = 0
    name: ClassVar[str] = "bigram-backcopy"
    option: ClassVar[str] = "bigram"

    def __post_init__(self):
        for name in ("vocab", "triggers", "length"):
            fields.whole(f"Bigram-Backcopy's {name}", getattr(self, name))
        p = self.p_trigger
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:  # NaN is not at least 0
            raise InputError(f"Bigram-Backcopy's p_trigger is a probability below 1 (at least 0), not {p!r}")
        fields.seed("Bigram-Backcopy's seed", self.seed)
        if self.triggers < 1 or self.vocab - 1 - self.triggers < 2:
            raise InputError(f"Bigram-Backcopy needs at least one trigger and two ordinary tokens: vocab {self.vocab}, "
                             f"triggers {self.triggers}")
        if self.length < 3:
            raise InputError(f"a Bigram-Backcopy sequence is at least 3 tokens long, not {self.length}")

    @property
    def ordinary(self) -> torch.Tensor:
        return torch.arange(1 + self.triggers, self.vocab)

    def tokenizer_object(self):
        return bigram_tokenizer(self)

    def table(self) -> torch.Tensor:
        """(vocab, vocab) the bigram's next-token probabilities of each ordinary token (rows of others are 0): each
        row a random distribution over the ordinary tokens, fixed by the seed."""
        g = torch.Generator().manual_seed(self.seed)
        ordinary = self.ordinary
        probs = torch.zeros(self.vocab, self.vocab)
        logits = torch.randn(len(ordinary), len(ordinary), generator=g) * 2.0
        probs[ordinary.unsqueeze(1), ordinary.unsqueeze(0)] = torch.softmax(logits, -1)
        return probs

    def batch(self, size: int, step: int = 0) -> torch.Tensor:
        """(size, length) sequences, the same for the same seed and step."""
        fields.sized(self, size)
        g = torch.Generator().manual_seed(fields.generator_seed(self.seed, step))
        table, ordinary = self.table(), self.ordinary
        out = torch.empty(size, self.length, dtype=torch.long)
        out[:, 0] = BOS
        out[:, 1] = ordinary[torch.randint(len(ordinary), (size,), generator=g)]
        for t in range(2, self.length):
            prev, before = out[:, t - 1], out[:, t - 2]
            bigram = torch.multinomial(table[prev.clamp(min=0)] + (prev <= self.triggers).float()[:, None] * 1e-9,
                                       1, generator=g)[:, 0]
            trigger = 1 + torch.randint(self.triggers, (size,), generator=g)
            fire = torch.rand(size, generator=g) < self.p_trigger
            is_trigger = (prev >= 1) & (prev <= self.triggers)
            nxt = torch.where(fire & ~is_trigger & (t < self.length - 1), trigger, bigram)
            out[:, t] = torch.where(is_trigger, before, nxt)
        return out

    def drawn_bytes(self, size: int, length: int) -> int:
        """What drawing a batch makes at its peak: the sequences, the bigram table (and its logits and softmax), a
        step's rows of it."""
        return 8 * size * length + 12 * self.vocab**2 + 16 * size * self.vocab

    def drawn_seconds(self, size: int, length: int) -> float:
        """The time drawing a batch takes: a step of the loop a position, all rows at once (120-200 us measured on
        one busy CPU core at 2 to 32 rows)."""
        return 2e-4 * length

    def needs_attention(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, n) bool: the positions whose next token is a copy (a trigger's), the others need no attention."""
        return (tokens >= 1) & (tokens <= self.triggers)


@dataclass(frozen=True)
class RepeatedRandom:
    """BOS, a segment r_1..r_L of distinct random tokens, the same segment again, then fresh random tokens up to
    ``length`` (docs/lab.md#tasks-and-tokenizers). L is drawn per sequence from ``shortest``..(length - 1) // 2, so
    no fixed offset finds the copy: the second copy is predicted by an induction head (a previous-token head below
    it, then attention from r_k to the token after r_k's first occurrence), which needs two layers. Every other
    query needs no attention, its next token being a fresh draw: the first copy, the query before the second copy
    starts, the tail. The tail's tokens are never the segment's, so a copy is only ever right in the second copy.
    Tokens: BOS (0) and the ordinary tokens 1..vocab-1."""

    vocab: int = 32
    length: int = 32
    shortest: int = 4
    seed: int = 0
    name: ClassVar[str] = "repeated-random"
    option: ClassVar[str] = "repeat"

    def __post_init__(self):
        for name in ("vocab", "length", "shortest"):
            fields.whole(f"the repeated task's {name}", getattr(self, name))
        fields.seed("the repeated task's seed", self.seed)
        if not 2 <= self.shortest <= self.longest:
            raise InputError(f"the repeated segment is 2 to (length - 1) // 2 = {self.longest} tokens long: shortest "
                             f"{self.shortest} does not fit a length of {self.length}")
        if self.vocab - 1 < self.longest + 2:
            raise InputError(f"the repeated task needs more ordinary tokens than its longest segment ({self.longest}) "
                             f"plus two for the tail: vocab {self.vocab} is too small")

    @property
    def longest(self) -> int:
        return (self.length - 1) // 2

    @property
    def ordinary(self) -> torch.Tensor:
        return torch.arange(1, self.vocab)

    def tokenizer_object(self):
        return bigram_tokenizer(self)

    def batch(self, size: int, step: int = 0) -> torch.Tensor:
        """(size, length) sequences, the same for the same seed and step."""
        fields.sized(self, size)
        g = torch.Generator().manual_seed(fields.generator_seed(self.seed, step))
        spans = torch.randint(self.shortest, self.longest + 1, (size,), generator=g)
        order = 1 + torch.rand(size, self.vocab - 1, generator=g).argsort(-1)  # each row's tokens, shuffled
        tail = torch.randint(self.longest, self.vocab - 1, (size, self.length), generator=g)  # past any segment
        out = torch.gather(order, 1, tail)
        out[:, 0] = BOS
        for row, span in enumerate(spans.tolist()):
            out[row, 1:span + 1] = out[row, span + 1:2 * span + 1] = order[row, :span]
        return out

    def drawn_bytes(self, size: int, length: int) -> int:
        """What drawing a batch makes at its peak: each row's shuffled vocabulary (its draws and their order), the
        tail's draws and the sequences."""
        return 20 * size * self.vocab + 16 * size * length

    def drawn_seconds(self, size: int, length: int) -> float:
        """The time drawing a batch takes: each row's vocabulary shuffled and its tail drawn (0.2 s for 32 rows of
        4,000 tokens from 4,000, 0.6 s for 256, measured on one busy CPU core)."""
        return 2e-6 * size * (self.vocab + length)

    def spans(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B,) each sequence's L: where r_1 comes again, less one (the segment's tokens are distinct, the tail's
        are none of them)."""
        again = (tokens[:, 2:] == tokens[:, 1:2]).int().argmax(-1)
        return again + 1

    def needs_attention(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, n) bool: the second copy's queries L+1..2L-1, whose next token is a copy; the others need none."""
        i = torch.arange(tokens.shape[1])[None]
        span = self.spans(tokens)[:, None]
        return (i > span) & (i < 2 * span)


#: every task the lab trains, by the name a checkpoint's setup saves
TASKS = {task.name: task for task in (BigramBackcopy, RepeatedRandom, Text)}


def named(name: str):
    """The task class saved as ``name``, refused in one line where the lab has none."""
    if not isinstance(name, str) or name not in TASKS:
        raise InputError(f"the saved task {name!r} is not one the lab trains ({', '.join(TASKS)})")
    return TASKS[name]
