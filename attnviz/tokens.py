"""Text → tokens, the flow's first step: the token ids and display strings a capture, a plan or a page sees.

The last texts tokenized are remembered (per tokenizer, text, BOS control and cap): the plan, the page and the
capture of one text ask for its tokens in turn, and an 8,000-token text takes a noticeable time to decode.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from attnviz.core.loading.models import LoadedModel
from attnviz.errors import InputError

REMEMBERED = 32  # texts
_memo: OrderedDict = OrderedDict()
_lock = threading.Lock()


class TooLong(InputError):
    """A text over the model's limit or the caller's cap (``max_tokens``): the message says both lengths."""


def prefix_ids(loaded: LoadedModel, prepend: str | None) -> list[int]:
    """The BOS control (docs/methods.md#interventions): ``"bos"`` → the tokenizer's BOS token, any other string → its
    tokens, None → nothing. Refused clearly when the tokenizer has no BOS token."""
    if not prepend:
        return []
    if prepend == "bos":
        bos = getattr(loaded.tokenizer, "bos_token_id", None)
        if bos is None:
            raise InputError(f"{loaded.model_id}'s tokenizer has no BOS token: prepend a token of your own (--prepend)")
        return [int(bos)]
    ids = encode(loaded, prepend, special=False)
    if not ids:
        raise InputError(f"'{prepend}' gives no token to prepend")
    return list(ids)


def encode(loaded: LoadedModel, text: str, special: bool = True) -> list[int]:
    """The tokenizer's ids of ``text`` (``special``: with its special tokens, a BOS); a text the tokenizer cannot
    read is refused in one line naming the words it lacks and the tokens it has (:func:`unreadable`): a word-level
    vocabulary without an unknown token, as a lab run's (docs/lab.md#tasks-and-tokenizers)."""
    try:
        return list(loaded.tokenizer(text, add_special_tokens=special)["input_ids"])
    except Exception as err:  # noqa: BLE001 - the tokenizers library fails with a plain Exception, and only that
        if type(err) is not Exception:
            raise
        raise InputError(unreadable(loaded, text, err)) from None


def unreadable(loaded: LoadedModel, text: str, err: Exception) -> str:
    """Why ``loaded``'s tokenizer cannot read ``text``: the words its vocabulary lacks and the tokens it has."""
    tok = loaded.tokenizer
    vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}
    try:
        words = [w for w, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    except AttributeError:
        words = text.split()
    missing = list(dict.fromkeys(w for w in words if w not in vocab))
    if not (vocab and missing):
        return f"{loaded.model_id}'s tokenizer cannot read the text: {(str(err).splitlines() or ['no reason'])[0]}"
    ordered = sorted(vocab, key=vocab.get)
    shown = ", ".join(f"{t} ({vocab[t]})" for t in ordered[:6]) + (
        f", ..., {ordered[-1]} ({vocab[ordered[-1]]})" if len(ordered) > 6 else "")
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return (f"{loaded.model_id}'s tokenizer has no token {missing[0]!r}{more}: it reads only the {len(vocab)} "
            f"tokens of its vocabulary, split at spaces: {shown}")


def tokenize(loaded: LoadedModel, text: str, max_tokens: int | None = None,
             prepend: str | None = None) -> tuple[list[int], list[str]]:
    """Token ids and their display strings of ``text`` (:func:`_tokenize`), remembered for the last texts.
    ``max_tokens``: a whole number of tokens, at least 1 (anything else is refused)."""
    check_max_tokens(max_tokens)
    key = (id(loaded.tokenizer), loaded.model_id, text, max_tokens, prepend)
    with _lock:
        hit = _memo.get(key)
        if hit is not None:
            _memo.move_to_end(key)
    if hit is None:
        # the entry holds the tokenizer itself: while it is remembered, no other object can take its id
        hit = (*_tokenize(loaded, text, max_tokens, prepend), loaded.tokenizer)
        with _lock:
            _memo[key] = hit
            while len(_memo) > REMEMBERED:
                _memo.popitem(last=False)
    return list(hit[0]), list(hit[1])


def check_max_tokens(max_tokens) -> None:
    """Refuse, in one line, a cap on the tokens that is not a whole number of at least 1 (None: no cap)."""
    if max_tokens is None:
        return
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) and not hasattr(max_tokens, "__index__"):
        raise InputError(f"max_tokens must be a whole number of tokens, not {max_tokens!r}")
    if int(max_tokens) < 1:
        raise InputError(f"max_tokens must be at least 1 token, got {max_tokens}")


def embedding_rows(loaded: LoadedModel) -> int | None:
    """How many token ids the model's input embedding has rows for (None where the model shows no embedding)."""
    try:
        embedding = loaded.model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    rows = getattr(embedding, "num_embeddings", None)
    return int(rows) if rows else None


def _tokenize(loaded: LoadedModel, text: str, max_tokens: int | None,
              prepend: str | None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Token ids and their display strings; refuses empty text and text over the limit. ``prepend``:
    the BOS control (:func:`prefix_ids`), added once (a text that already starts with it is left so)."""
    if not isinstance(text, str) or not text.strip():
        raise InputError("the text is empty: type or pick a text to capture")
    ids = encode(loaded, text)
    prefix = prefix_ids(loaded, prepend)
    if prefix and list(ids[:len(prefix)]) != prefix:
        ids = prefix + list(ids)
    if len(ids) > loaded.max_tokens:
        raise TooLong(
            f"the text is {len(ids)} tokens long but {loaded.model_id} takes at most {loaded.max_tokens}: shorten it"
        )
    if max_tokens is not None and len(ids) > max_tokens:
        raise TooLong(f"the text is {len(ids)} tokens long; this view captures at most {max_tokens}: shorten it")
    if len(ids) < 1:
        raise InputError("the text produced no tokens")
    rows = embedding_rows(loaded)
    past = [(i, t) for i, t in enumerate(ids) if rows is not None and not 0 <= t < rows]
    if past:
        i, t = past[0]
        raise InputError(f"token {i} ({loaded.tokenizer.decode([t])!r}, id {t}) is past {loaded.model_id}'s embedding, "
                         f"which has {rows} rows ({len(past)} such token(s)): the tokenizer does not belong to the model")
    return tuple(ids), tuple(loaded.tokenizer.decode([i]) for i in ids)
