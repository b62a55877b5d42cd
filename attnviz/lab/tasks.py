"""The lab's tasks: Bigram-Backcopy (Guo et al. 2024, arXiv 2410.13835), seeded.

A vocabulary of ``vocab`` tokens: token 0 is BOS, tokens 1..``triggers`` are triggers, the rest ordinary. Each
sequence starts with BOS; after an ordinary token the next is drawn from a fixed random bigram table over the
ordinary tokens, or is a trigger with probability ``p_trigger``; after a trigger the next token copies the token just
before the trigger. The copy needs attention (to the previous token); the bigram needs none, so the queries after
ordinary tokens are the ones that have nothing to attend to: where a sink forms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnviz.errors import InputError

BOS = 0


@dataclass(frozen=True)
class BigramBackcopy:
    vocab: int = 64
    triggers: int = 3
    length: int = 64
    p_trigger: float = 0.1
    seed: int = 0

    def __post_init__(self):
        if not (isinstance(self.vocab, int) and isinstance(self.triggers, int) and isinstance(self.length, int)):
            raise InputError("Bigram-Backcopy's vocab, triggers and length are whole numbers")
        if self.triggers < 1 or self.vocab - 1 - self.triggers < 2:
            raise InputError(f"Bigram-Backcopy needs at least one trigger and two ordinary tokens: vocab {self.vocab}, "
                             f"triggers {self.triggers}")
        if self.length < 3:
            raise InputError(f"a Bigram-Backcopy sequence is at least 3 tokens long, not {self.length}")
        if not 0 <= self.p_trigger < 1:
            raise InputError(f"p_trigger is a probability below 1, not {self.p_trigger}")

    @property
    def ordinary(self) -> torch.Tensor:
        return torch.arange(1 + self.triggers, self.vocab)

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
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
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

    def needs_attention(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, n) bool: the positions whose next token is a copy (a trigger's), the others need no attention."""
        return (tokens >= 1) & (tokens <= self.triggers)
