"""The lab's fields checked in one place (docs/lab.md#fields-checked): a run's setup and its task's arguments each
take one type and one range, and anything else is refused in one line naming the field, what it takes and what was
given, before anything is built or drawn. A bool is not a whole number here (``True`` is no layer count), a number is
finite, a seed is one a generator takes (0 to 2**64 - 1), a switch is ``True`` or ``False`` and a name is one of its
registry's.
"""

from __future__ import annotations

import math
import numbers

from attnviz.errors import InputError

#: the largest seed: torch's generators take 0 to 2**64 - 1
SEED_MAX = 2**64 - 1


def whole(what: str, value, least: int = 1, most: int | None = None) -> int:
    """``value`` as a whole number from ``least`` to ``most`` (a bool, a float or a string refused)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < least or (
            most is not None and value > most):
        span = f"from {least} to {most}" if most is not None else f"of at least {least}"
        raise InputError(f"{what} is a whole number {span}, not {value!r}")
    return int(value)


def number(what: str, value, least: float | None = None, above: float | None = None,
           below: float | None = None) -> float:
    """``value`` as a finite number at least ``least``, above ``above`` and below ``below`` (each where given); a
    whole number is taken as one, a bool or a string refused."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (least is None or value >= least) and (above is None or value > above) and (
        below is None or value < below)
    if not ok:
        span = [f"at least {least:g}" if least is not None else "", f"above {above:g}" if above is not None else "",
                f"below {below:g}" if below is not None else ""]
        span = " and ".join(s for s in span if s)
        raise InputError(f"{what} is {span + ' (a finite number)' if span else 'a finite number'}, not {value!r}")
    return value


def seed(what: str, value) -> int:
    """``value`` as a seed: a whole number from 0 to :data:`SEED_MAX`."""
    return whole(what, value, 0, SEED_MAX)


def switch(what: str, value) -> bool:
    """``value`` as ``True`` or ``False`` alone (``'no'``, 0 and None are refused, never read as one)."""
    if not isinstance(value, bool):
        raise InputError(f"{what} is True or False, not {value!r}")
    return value


def name(what: str, value, choices=None) -> str:
    """``value`` as a non-empty string, one of ``choices`` where given."""
    if not isinstance(value, str) or not value.strip() or (choices is not None and value not in choices):
        among = f"one of {', '.join(choices)}" if choices is not None else "a non-empty string"
        raise InputError(f"{what} is {among}, not {value!r}")
    return value


def generator_seed(seed: int, step) -> int:
    """The seed of a task's generator at ``step``: ``seed`` × 1,000,003 + ``step``, taken modulo 2**64 (a generator
    takes no more), so every seed and step a task takes draws, and those below it draw as they always did."""
    whole("a batch's step", step, 0)
    return (seed * 1_000_003 + step) % 2**64


def sized(task, size: int) -> int:
    """Size a batch of ``size`` sequences of ``task`` before it is drawn (docs/lab.md#a-batch-sized-first): what
    drawing it makes (``task.drawn_bytes``; ``task.drawn_seconds`` the time it takes) and one head's fp32 scores over
    one of its sequences (length², the least a forward of it makes) against the memory budget (``ATTNVIZ_MEMORY_MB``, 0: a quarter of the machine's memory);
    past it, refused in one line with the estimate, the time to draw it and the longest length that fits. Returns
    the bytes."""
    from attnviz.core.model.devices import mb
    from attnviz.effects.budget import duration, memory_bytes

    whole("a batch's size", size)

    def need(length: int) -> int:
        return task.drawn_bytes(size, length) + 4 * length**2

    room = memory_bytes()
    if need(task.length) <= room:
        return need(task.length)
    lo, hi = 0, task.length
    while lo < hi:  # the longest length that fits (0: none, the vocabulary alone is past it)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= room else (lo, mid - 1)
    fit = f"a length of at most {lo:,}" if lo >= 3 else "a smaller vocabulary or batch"
    raise InputError(f"a batch of {size} {task.name} sequences of {task.length:,} tokens (vocab {task.vocab:,}) needs "
                     f"~{mb(task.drawn_bytes(size, task.length))} to draw "
                     f"(~{duration(task.drawn_seconds(size, task.length))})"
                     f" and ~{mb(4 * task.length**2)} for one head's scores over one sequence: past the memory "
                     f"budget's {mb(room)} (ATTNVIZ_MEMORY_MB): give {fit}")
