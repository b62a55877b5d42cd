"""Option values that every front end reads the same way: the CLI's options (``--ratios``, ``--ks``) and the app's
text boxes parse their lists of numbers here, so both accept and refuse the same input (``tests/test_defaults.py``
holds the Effects page to it). Below everything else in the flow: it imports only ``attnviz.errors``
(docs/layout.md).
"""

from __future__ import annotations

from attnviz.errors import InputError


def numbers(text: str, name: str, whole: bool = False) -> list:
    """The comma-separated numbers of ``text``, in the order given: "0.25, 0.5" → [0.25, 0.5]. Spaces around a
    number are allowed, a space between two numbers is not; ``name`` (the option, or the box) names the refusal."""
    cast = int if whole else float
    try:
        return [cast(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise InputError(f"{name} must be {'whole numbers' if whole else 'numbers'} separated by commas, "
                         f"got '{text}'") from None


def ratios(text: str, name: str = "--ratios") -> list[float]:
    """Compression ratios, at least one (each is checked against [0, 1) by :func:`attnviz.kv.compress.check`)."""
    values = numbers(text, name)
    if not values:
        raise InputError(f"{name} needs at least one ratio in [0, 1)")
    return values


def ks(text: str, name: str = "--ks") -> list[int]:
    """Whole k values, at least one (the Linformer what-if checks each against the text's tokens)."""
    values = numbers(text, name, whole=True)
    if not values:
        raise InputError(f"{name} needs at least one k")
    return values
