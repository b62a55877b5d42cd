"""Slow computations for pages (captures, evaluation, streaming, probes, generation): run once with a
progress bar, kept for every session in a byte-budgeted LRU, errors shown as one message."""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Hashable, TypeVar

import streamlit as st

from attnviz import settings
from attnviz.core.model import devices
from attnviz.errors import AttnvizError
from ui.lru import ByteLRU
from ui import shared

T = TypeVar("T")


@st.cache_resource(show_spinner=False)
def _results() -> ByteLRU:  # results are curves and scores: small (ATTNVIZ_RESULTS_MB, default 64)
    return ByteLRU(settings.active().results_mb * 2**20)


log = logging.getLogger("attnviz.jobs")
if not log.handlers:  # the server's log (stderr): which computations were abandoned, and where
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False

_guard = threading.Lock()
_running: dict = {}  # key -> [lock, waiters]: one computation per key at a time, across sessions


@contextmanager
def _one_at_a_time(key: Hashable):
    """Two sessions asking for the same result at once: the second waits for the first and then
    finds it stored, instead of computing it again."""
    with _guard:
        entry = _running.setdefault(key, [threading.Lock(), 0])
        entry[1] += 1
    try:
        with entry[0]:
            yield
    finally:
        with _guard:
            entry[1] -= 1
            if not entry[1]:
                _running.pop(key, None)


def cached(key: Hashable):
    """The stored result for ``key`` in the pages' results cache, or None."""
    return _results().get(key)


def run(key: Hashable, label: str, compute: Callable[[Callable[..., None]], T],
        store: ByteLRU | None = None, units: float | None = None, reserve: int = 0) -> T | None:
    """``compute(progress)`` once per key; ``progress(done, total)`` moves a bar with elapsed time (and
    ``progress(done, total, note)`` says ``note`` on it too: a training step's loss).

    ``store`` is the LRU to keep results in (default: the pages' results cache); room for ``reserve`` bytes is
    made there just before computing (older results leave first), so the server's resident size stays near the
    store's budget. ``units`` (tokens, steps) lets :func:`eta` quote this machine's own time per unit for the
    key's name (``key[0]``). A run the user abandons (new input, another page) stops at its next progress
    report, i.e. after the current layer: once a rerun is requested, Streamlit interrupts the script at its
    next ``st`` call, here ``bar.progress``; nothing half-done is stored. The server's log says where it stopped
    (``abandoned <label> at 3/30``; tests/test_e2e_browser.py checks it in Chromium).
    """
    store = _results() if store is None else store  # not `or`: an empty ByteLRU is falsy
    found = store.get(key)
    if found is not None:
        return found
    with shared.turn(label), _one_at_a_time(key):  # shared server: this session's turn first (ui/shared.py)
        found = store.get(key)  # computed by another session while this one waited
        if found is not None:
            return found
        if reserve:
            store.reserve(reserve)
            # Evicted results can sit in reference cycles (Streamlit's script frames and callbacks) that only
            # the cycle collector frees, and their large buffers never trigger it: collect now, so their memory
            # is back before the new result is built (measured on captures: +4 GB after five without this,
            # +90 MB with it).
            gc.collect()
        bar = st.progress(0.0, text=label)
        start = time.perf_counter()
        reached = [0, 0]  # (done, total) of the last progress report

        def progress(done: int, total: int, note: str = "") -> None:  # note: what else the bar says ("loss 2.31")
            reached[:] = done, total
            bar.progress(min(done / max(total, 1), 1.0), text=f"{label}: {done}/{total}"
                         + (f" · {note}" if note else "") + f" ({time.perf_counter() - start:.0f} s)")

        try:
            # a device out-of-memory error in any computation: the cache goes back, the other sessions
            # keep running, and it is explained like any other refusal
            with devices.out_of_memory_explained(label.lower()):
                result = compute(progress)
        except AttnvizError as err:
            if isinstance(err, devices.DeviceMemoryError):
                log.warning("out of memory in %s at %d/%d; device cache emptied", label, *reached)
            st.error(f"{label}: {err}")
            return None
        except BaseException as stop:  # Streamlit's rerun/stop: the user moved on
            log.info("abandoned %s at %d/%d after %.1f s (%s)", label, *reached, time.perf_counter() - start,
                     type(stop).__name__)
            raise
        finally:
            bar.empty()
        if units:
            _rates[key[0] if isinstance(key, tuple) else key] = (time.perf_counter() - start) / units
        store.put(key, result)  # least recently used results leave first; one over the whole budget is not kept
        return result


_rates: dict = {}  # a job's name (its key's first item: "eval", "lab-train" ...) -> seconds a unit, its last run here


def rate(name: Hashable) -> float | None:
    """Seconds per unit (token, step) that the last job called ``name`` took on this server, None
    before the first: pages quote this machine's own measurement, not a constant measured elsewhere."""
    return _rates.get(name)


def eta(name: Hashable, units: float, what: str = "a token") -> str:
    """'about 12 s here (4 ms a token, measured on this server)', or what the first run will measure."""
    per = rate(name)
    if per is None:
        return f"the first run measures how long {what} takes on this machine"
    return f"about {per * units:,.0f} s here ({per * 1000:,.1f} ms {what}, measured on this server)"
