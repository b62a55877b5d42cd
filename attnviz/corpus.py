"""Offline text for evaluation: Python's own reference documentation, or a user's file.

No data set can be downloaded here, and every CPython ships ``pydoc_data.topics`` (~465k characters
in ~79 topics), so it is the default corpus, read at run time and never copied into the project.
``stdlib`` is every topic in key order; ``stdlib:NAME`` is one topic (docs/methods.md#cache-policies measures
``stdlib:specialnames``). A user's text (a file, or ``--text``) is scored as written: its running
text is the text itself, byte for byte, so its perplexity is the one transformers' perplexity guide
gives on the same file. Documents, split at blank lines (the natural unit of a
plain-text file), are for the embedding probe and the dataset protocol only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from attnviz.errors import InputError

STDLIB = "stdlib"
CHARS_PER_TOKEN_BOUND = 16  # no tokenizer we know packs more: tokenize only the prefix we need


@dataclass(frozen=True)
class Corpus:
    name: str
    documents: tuple[str, ...]
    raw: str | None = None  # a user's text as written: the running text, verbatim

    @property
    def text(self) -> str:
        """The running text, for perplexity and streaming: a user's text as written; the stdlib's
        documents joined by a blank line."""
        return self.raw if self.raw is not None else "\n\n".join(self.documents)


def stdlib_topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return dict(topics)


def stdlib(topic: str | None = None) -> Corpus:
    topics = stdlib_topics()
    if topic is None:
        return Corpus(STDLIB, tuple(topics[name].strip() for name in sorted(topics)))
    if topic not in topics:
        close = [name for name in sorted(topics) if topic.lower() in name.lower()][:5]
        hint = f"; did you mean {', '.join(close)}?" if close else f"; e.g. {', '.join(sorted(topics)[:4])}"
        raise InputError(f"pydoc_data has no topic '{topic}'{hint}")
    return Corpus(f"{STDLIB}:{topic}", (topics[topic].strip(),))


def from_file(path: str | Path) -> Corpus:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise InputError(f"cannot read text file '{path}': {err.strerror}") from None
    except UnicodeDecodeError:
        raise InputError(f"text file '{path}' is not UTF-8 text") from None
    return from_text(text, Path(path).name)


def from_text(text: str, name: str = "text") -> Corpus:
    documents = tuple(d.strip() for d in re.split(r"\n\s*\n", text or "") if d.strip())
    if not documents:
        raise InputError(f"'{name}' is empty: give a text with some words")
    return Corpus(name, documents, raw=text)


def head_ids(tokenizer, text: str, n: int | None = None) -> list[int]:
    """The ids of the first ``n`` tokens of ``text`` (all with ``n`` None), tokenizer defaults.

    Only a prefix that surely holds n tokens is tokenized: the stdlib docs are ~465k characters and
    evaluation, the probe and the dataset protocol each want a small head of them.
    """
    head = text[: n * CHARS_PER_TOKEN_BOUND] if n else text
    ids = tokenizer(head, add_special_tokens=True, verbose=False)["input_ids"]
    return list(ids[:n] if n else ids)


def text_of(tokenizer, ids: list[int]) -> str:
    """``ids`` decoded so that tokenizing the text again gives them: a leading BOS that the tokenizer adds by
    itself is left out (it would come back twice)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return tokenizer.decode(ids[1:] if ids and bos is not None and ids[0] == bos else ids)


def load(corpus: str | None = None, text_file: str | Path | None = None) -> Corpus:
    """``corpus`` is ``stdlib`` or ``stdlib:TOPIC``; ``text_file`` a UTF-8 file; the file wins if both."""
    if text_file:
        return from_file(text_file)
    spec = (corpus or STDLIB).strip()
    if spec == STDLIB:
        return stdlib()
    if spec.startswith(STDLIB + ":"):
        return stdlib(spec.split(":", 1)[1])
    raise InputError(f"unknown corpus '{spec}': use 'stdlib', 'stdlib:TOPIC' or a text file")
