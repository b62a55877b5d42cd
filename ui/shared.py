"""The app as a lab's shared server (docs/sharing.md): which paths and models a visitor may use
(:mod:`attnviz.access`), a fair queue for heavy jobs, per-job caps and the sign-in gate.

Shared mode is on when the server listens beyond the loopback (``--server.address 0.0.0.0``) or with
``ATTNVIZ_SHARED=1``. Caps and the number of heavy jobs the server runs at once are read from the
``[attnviz]`` table of ``.streamlit/secrets.toml`` (``jobs``, ``max_tokens``, ``max_cells``); sign-in
is required where an ``[auth]`` table is configured there (Streamlit's own ``st.login``).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager, nullcontext

import streamlit as st

from attnviz import settings
from attnviz.access import Access, is_shared
from attnviz.errors import InputError

CAPS = {"jobs": 1, "max_tokens": 8192, "max_cells": 12}  # shared mode's defaults, overridden in secrets.toml


def apply_settings() -> bool:
    """The app's settings, read once a run from the environment and the ``[attnviz]`` table of
    ``.streamlit/secrets.toml`` (:meth:`attnviz.settings.Settings.from_environment`) and handed to the library
    (:func:`attnviz.settings.use`), so that a changed environment applies at once; False after ``st.error`` where a
    value is not one its variable takes."""
    try:
        settings.use(settings.Settings.from_environment(secrets=_secrets("attnviz")))
    except InputError as err:
        st.error(f"Settings: {err}")
        return False
    return True


def fell_back(result) -> None:
    """Tell the visitor that their capture took the block engine where the fused kernel failed (the same numbers,
    slower), with the reason: the route stays on for the next capture and for every other visitor."""
    reasons = (getattr(result, "meta", None) or {}).get("fused_fallback")
    if reasons:
        st.warning("This capture fell back from the fused statistics kernel to the block engine (the same "
                   f"statistics, slower): {'; '.join(reasons)}. The next capture tries the kernel again.")


def _secrets(table: str) -> dict:
    """A table of ``.streamlit/secrets.toml``, empty when there is no file or no such table."""
    try:
        return dict(st.secrets.get(table, {}) or {})
    except Exception:  # noqa: BLE001 - no secrets file at all is the common case
        return {}


def access() -> Access:
    """This server's access rules, from the app's settings (:func:`apply_settings`, read every run)."""
    return Access.of(is_shared(st.get_option("server.address")))


def cap(name: str) -> int:
    return int(settings.active().cap(name, CAPS[name]))


def checked(check, *args):
    """``check(*args)`` of :class:`Access` (``readable``, ``writable``, ``model``), or None after ``st.error``."""
    try:
        return check(*args)
    except InputError as err:
        st.error(str(err))
        return None


def auth_configured() -> bool:
    return bool(_secrets("auth"))


def gate() -> None:
    """Before any page: sign-in where ``[auth]`` is configured; in shared mode without it, one line saying that
    anyone who reaches the port can use the app."""
    if auth_configured():
        if not st.user.is_logged_in:
            st.title("attnviz")
            st.info("This attnviz server asks you to sign in first.")
            st.button("Sign in", on_click=st.login, type="primary", key="sign_in")
            st.stop()
        with st.sidebar:
            st.caption(f"signed in as {st.user.get('email') or st.user.get('name') or 'you'}")
            st.button("Sign out", on_click=st.logout, key="sign_out")
    elif access().shared:
        with st.sidebar:
            st.caption("Shared server without sign-in: anyone who reaches this port can use the app "
                       "(docs/sharing.md: add [auth] to .streamlit/secrets.toml).")


class FairQueue:
    """At most ``slots`` heavy jobs at once, at most one per session; the others wait first come, first
    served. A waiting session that leaves (its script stopped) gives up its place."""

    def __init__(self):
        self._cond = threading.Condition()
        self._waiting: list[tuple[str, object]] = []  # (session, ticket) in arrival order
        self._running: dict[str, int] = {}  # session -> depth (a job inside a job of the same session)

    def positions(self) -> list[str]:
        with self._cond:
            return [session for session, _ in self._waiting]

    def running(self) -> list[str]:
        with self._cond:
            return list(self._running)

    @contextmanager
    def turn(self, session: str, slots: int, on_wait=None):
        """Wait for a slot; ``on_wait(position, running)`` is called about twice a second while waiting (a
        Streamlit call there lets a session that left stop waiting)."""
        with self._cond:
            if session in self._running:  # this session's own job asked for another: it already has a slot
                self._running[session] += 1
                ticket = None
            else:
                ticket = object()
                self._waiting.append((session, ticket))
        try:
            while ticket is not None:
                with self._cond:
                    position = next(i for i, (_, t) in enumerate(self._waiting) if t is ticket)
                    if position == 0 and len(self._running) < max(1, slots):
                        self._waiting.pop(0)
                        self._running[session] = 1
                        self._cond.notify_all()
                        break
                    running = len(self._running)
                if on_wait is not None:
                    on_wait(position + 1, running)
                with self._cond:
                    self._cond.wait(timeout=0.5)
            yield
        finally:
            with self._cond:
                if ticket is not None and any(t is ticket for _, t in self._waiting):
                    self._waiting = [(s, t) for s, t in self._waiting if t is not ticket]
                elif session in self._running:
                    self._running[session] -= 1
                    if not self._running[session]:
                        del self._running[session]
                self._cond.notify_all()


QUEUE = FairQueue()  # one per server process: every session's heavy jobs


def session_id() -> str:
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    ctx = get_script_run_ctx()
    return ctx.session_id if ctx is not None else "no-session"


def turn(label: str):
    """In shared mode, wait for this session's turn to run ``label`` (its position shown while it waits; the
    wait is said after it); outside it, nothing."""
    if not access().shared:
        return nullcontext()
    return _shared_turn(label)


@contextmanager
def _shared_turn(label: str):
    notice = st.empty()
    start = time.perf_counter()
    waited = [0]

    def on_wait(position: int, running: int) -> None:
        waited[0] = max(waited[0], position)
        notice.info(f"Waiting for the server: {label} is number {position} in the queue "
                    f"({running} job{'s' if running != 1 else ''} running; {time.perf_counter() - start:.0f} s). "
                    "Leaving this page gives up the place.")

    with QUEUE.turn(session_id(), cap("jobs"), on_wait):
        notice.empty()
        if waited[0]:
            st.caption(f"{label} waited {time.perf_counter() - start:.1f} s in the server's queue "
                       f"(position {waited[0]} at first).")
        yield
