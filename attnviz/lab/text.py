"""The lab's text task and its tokenizers (docs/lab.md#tasks-and-tokenizers): next-token prediction on fixed-length chunks of a
text (the stdlib corpus, :mod:`attnviz.corpus`, or a user's UTF-8 file), tokenized by bytes or by the default
model's tokenizer; and the tokenizer every checkpoint carries, so ``attnviz.load`` reads it back:

- Bigram-Backcopy: a WordLevel vocabulary, ``<bos>`` (id 0), the triggers ``T1``, ``T2``, ... and the ordinary
  tokens ``t4``, ``t5``, ... (named by their id), words split at spaces: ``"t5 T1 t5"``;
- bytes: ``<bos>`` (id 0) and the 256 bytes (ids 1..256), byte-level as GPT-2 writes them;
- default: the default model's own tokenizer (SmolLM2's, offline, :mod:`attnviz.core.loading.shipped`).

A tokenizer of the lab puts ``<bos>`` before every text it encodes; the text task's chunks start with it too.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from attnviz.errors import InputError
from attnviz.lab import fields

TOKENIZERS = ("bytes", "default")
BOS_TOKEN = "<bos>"


def _fast(model, pre, decoder=None):
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(model)
    raw.pre_tokenizer = pre
    if decoder is not None:
        raw.decoder = decoder
    raw.post_processor = processors.TemplateProcessing(single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=BOS_TOKEN, unk_token=None)


def bigram_tokenizer(task):
    """A WordLevel tokenizer over a Bigram-Backcopy vocabulary: ``<bos>``, triggers ``T1``.., ordinary ``tN``; a task
    without triggers (the repeated random tokens) has ``<bos>`` and ordinary ``t1``.. alone."""
    from tokenizers import models, pre_tokenizers

    triggers = getattr(task, "triggers", 0)
    vocab = {BOS_TOKEN: 0}
    vocab.update({f"T{i}": i for i in range(1, triggers + 1)})
    vocab.update({f"t{i}": i for i in range(triggers + 1, task.vocab)})
    return _fast(models.WordLevel(vocab, unk_token=None), pre_tokenizers.WhitespaceSplit())


@functools.lru_cache(maxsize=1)
def bytes_tokenizer():
    """``<bos>`` and the 256 bytes: any UTF-8 text, no unknown token."""
    from tokenizers import decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {BOS_TOKEN: 0}
    vocab.update({char: 1 + byte for byte, char in sorted(bytes_to_unicode().items())})
    model = models.BPE(vocab=vocab, merges=[])
    return _fast(model, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False), decoders.ByteLevel())


@functools.lru_cache(maxsize=1)
def default_tokenizer():
    """The default model's tokenizer, from its converted folder (converted once, offline)."""
    from transformers import AutoTokenizer

    from attnviz.core.loading.shipped import DEFAULT, SHIPPED, converted

    return AutoTokenizer.from_pretrained(converted(SHIPPED[DEFAULT], lambda message: None))


def tokenizer_of(name: str):
    if name == "bytes":
        return bytes_tokenizer()
    if name == "default":
        return default_tokenizer()
    raise InputError(f"unknown tokenizer {name!r}: expected one of {', '.join(TOKENIZERS)}")


def _stamp(source: str):
    """What says a source changed (a file's modification time and size), so an edited file is read again."""
    try:
        found = os.stat(source) if source != "stdlib" else None
    except OSError:  # read, and refused, by corpus.from_file
        return None
    return None if found is None else (found.st_mtime_ns, found.st_size)


@functools.lru_cache(maxsize=4)
def _ids(source: str, tokenizer: str, stamp=None) -> torch.Tensor:
    from attnviz import corpus

    text = corpus.stdlib().text if source == "stdlib" else corpus.from_file(source).text
    tok = tokenizer_of(tokenizer)
    ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


@dataclass(frozen=True)
class Text:
    """Next-token prediction on chunks of ``length`` tokens (``<bos>`` or the tokenizer's BOS first) of ``source``
    (``"stdlib"`` or a file's path), drawn at random offsets, the same for the same seed and step."""

    source: str = "stdlib"
    tokenizer: str = "bytes"
    length: int = 64
    seed: int = 0
    name: str = "text"
    option: ClassVar[str] = "text"

    def __post_init__(self):
        fields.name("the text task's source", self.source)
        if not isinstance(self.tokenizer, str) or self.tokenizer not in TOKENIZERS:
            raise InputError(f"unknown tokenizer {self.tokenizer!r}: expected one of {', '.join(TOKENIZERS)}")
        if not isinstance(self.length, int) or isinstance(self.length, bool) or self.length < 3:
            raise InputError(f"a text chunk is at least 3 tokens long, not {self.length!r}")
        fields.seed("the text task's seed", self.seed)

    def tokenizer_object(self):
        return tokenizer_of(self.tokenizer)

    @property
    def vocab(self) -> int:
        return len(self.tokenizer_object())

    @property
    def bos(self) -> int:
        tok = self.tokenizer_object()
        return tok.bos_token_id if tok.bos_token_id is not None else 0

    def ids(self) -> torch.Tensor:
        ids = _ids(self.source, self.tokenizer, _stamp(self.source))
        if len(ids) < self.length - 1:  # a chunk: BOS and length - 1 tokens of the text
            raise InputError(f"the text {self.source!r} has {len(ids)} tokens: a chunk of {self.length} tokens "
                             f"needs {self.length - 1} besides BOS; give a longer text or a shorter length")
        return ids

    def drawn_bytes(self, size: int, length: int) -> int:
        """What drawing a batch makes beside the text's tokens: its chunks, then the batch they are joined into."""
        return 16 * size * length

    def drawn_seconds(self, size: int, length: int) -> float:
        """The time drawing a batch takes beside the text's tokenization (once a process): its chunks copied."""
        return 1e-8 * size * length

    def batch(self, size: int, step: int = 0) -> torch.Tensor:
        fields.sized(self, size)
        ids = self.ids()
        g = torch.Generator().manual_seed(fields.generator_seed(self.seed, step))
        starts = torch.randint(len(ids) - self.length + 2, (size,), generator=g)
        rows = torch.stack([ids[s:s + self.length - 1] for s in starts.tolist()])
        return torch.cat([torch.full((size, 1), self.bos, dtype=torch.long), rows], dim=1)
