"""The settings the front ends read from the environment, in one object (:class:`Settings`), and the one place the
library finds them (:func:`active`).

The CLI (:func:`attnviz.cli.main`), the app (``app.py``, which also reads ``.streamlit/secrets.toml``'s
``[attnviz]`` table) and ``attnviz doctor`` read them once with :meth:`Settings.from_environment` and hand them to
the library with :func:`use`. The library never reads the environment: a notebook that never calls :func:`use` gets
:class:`Settings`' documented defaults even where ``ATTNVIZ_*`` variables are set (``attnviz.settings.use(
attnviz.settings.Settings.from_environment())`` takes them, as the CLI does). Every variable: docs/cli.md#settings.

This module is the only library module that reads ``os.environ`` (``tests/test_layout.py``); a child process's
environment is made here too (:func:`environment_without`, :func:`passed`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Mapping

from attnviz.errors import InputError

TRUE, FALSE = ("1", "true", "yes"), ("0", "false", "no")


@dataclass(frozen=True)
class Settings:
    """Every setting a front end reads (its variable in brackets); the defaults are the library's."""

    # where and how a model runs: the library reads these through active()
    device: str | None = None  # ATTNVIZ_DEVICE: where a model loads when none is named (None: CUDA if here, else CPU)
    dtype: str | None = None  # ATTNVIZ_DTYPE: the dtype a model loads in when none is named (None: by device)
    cache: str | None = None  # ATTNVIZ_CACHE, else $XDG_CACHE_HOME/attnviz (None: ~/.cache/attnviz)
    device_mb: float | None = None  # ATTNVIZ_DEVICE_MB: a cap on a device's free memory
    block_mb: float | None = None  # ATTNVIZ_BLOCK_MB: one query block's fp32 scores (None: by device)
    whole_allow_mb: int = 256  # ATTNVIZ_WHOLE_ALLOW_MB: allow-sets above it are made a block of rows at a time
    fused: bool | None = None  # ATTNVIZ_FUSED: 0 off, 1 forced (None: on a CUDA GPU with Triton)
    fused_lse: bool = True  # ATTNVIZ_FUSED_LSE=0: the statistics kernel finds the log-sum-exp itself
    cudnn: bool = True  # ATTNVIZ_CUDNN=0: cuDNN's log-sum-exp is never trusted
    kernel_tile: tuple[int, int] | None = None  # ATTNVIZ_KERNEL_TILE=BMxBN
    kernel_warps: int | None = None  # ATTNVIZ_KERNEL_WARPS (4 or 8)
    kernel_stages: int | None = None  # ATTNVIZ_KERNEL_STAGES
    kernel_groups: int | None = None  # ATTNVIZ_KERNEL_GROUPS
    kernel_registers: int | None = None  # ATTNVIZ_KERNEL_REGISTERS (0: no cap)
    viewer_mb: float | None = None  # ATTNVIZ_VIEWER_MB: image bytes one viewer payload holds (None: 40 MB)
    # the front ends' own
    debug: bool = False  # ATTNVIZ_DEBUG: the CLI shows a traceback
    max_tokens: int | None = None  # ATTNVIZ_MAX_TOKENS: the app's token limit (None: the model's context)
    results_mb: int = 64  # ATTNVIZ_RESULTS_MB: the app's cache of job results
    # the app's sizes: the variable, else ``<name>_mb`` in secrets.toml's [attnviz] table
    full_maps_mb: int = 1024  # ATTNVIZ_FULL_MAPS_MB
    memory_mb: int = 0  # ATTNVIZ_MEMORY_MB (0: a quarter of the machine's memory)
    checkpoint_mb: int = 512  # ATTNVIZ_CHECKPOINT_MB
    # a shared server (docs/sharing.md)
    shared: bool | None = None  # ATTNVIZ_SHARED (None: by the server's address)
    roots: tuple[str, ...] = ()  # ATTNVIZ_ROOTS, colon-separated (empty: the cache directory)
    write_root: str | None = None  # ATTNVIZ_WRITE_ROOT (None: the cache directory)
    models: tuple[str, ...] | None = None  # ATTNVIZ_MODELS, comma-separated (None: the shipped models)
    trust_remote_code: bool = False  # ATTNVIZ_TRUST_REMOTE_CODE
    caps: tuple[tuple[str, int], ...] = ()  # secrets.toml's [attnviz] jobs, max_tokens, max_cells

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None,
                         secrets: Mapping | None = None) -> "Settings":
        """The settings of ``environ`` (None: this process's environment) and, for the app, its secrets'
        ``[attnviz]`` table; a value that is not what its variable takes is refused with the variable's name."""
        env = os.environ if environ is None else environ
        secrets = dict(secrets or {})

        def get(name: str) -> str:
            return str(env.get(f"ATTNVIZ_{name}", "")).strip()

        def number(name: str, cast=int, fallback=None):
            value = get(name)
            if not value and fallback is not None:
                value = str(secrets.get(fallback, "")).strip()
            if not value:
                return None
            try:
                return cast(value) if cast is int else float(value)
            except ValueError:
                raise InputError(f"ATTNVIZ_{name}={value!r}: not a {'whole ' if cast is int else ''}number") from None

        def switch(name: str) -> bool | None:
            value = get(name).lower()
            return True if value in TRUE else False if value in FALSE else None

        tile = get("KERNEL_TILE").lower()
        if tile:
            try:
                bm, bn = (int(x) for x in tile.split("x"))
            except ValueError:
                raise InputError(f"ATTNVIZ_KERNEL_TILE={tile!r}: not BMxBN (64x64)") from None
        cache = get("CACHE") or (os.path.join(env["XDG_CACHE_HOME"], "attnviz") if env.get("XDG_CACHE_HOME") else None)
        defaults = cls()
        given = dict(
            device=get("DEVICE") or None, dtype=get("DTYPE") or None, cache=cache,
            device_mb=number("DEVICE_MB", float), block_mb=number("BLOCK_MB", float),
            whole_allow_mb=number("WHOLE_ALLOW_MB"), fused={"0": False, "1": True}.get(get("FUSED")),
            fused_lse=get("FUSED_LSE") != "0", cudnn=get("CUDNN") != "0",
            kernel_tile=(bm, bn) if tile else None, kernel_warps=number("KERNEL_WARPS"),
            kernel_stages=number("KERNEL_STAGES"), kernel_groups=number("KERNEL_GROUPS"),
            kernel_registers=number("KERNEL_REGISTERS"), viewer_mb=number("VIEWER_MB", float),
            debug=bool(get("DEBUG")), max_tokens=number("MAX_TOKENS") or None, results_mb=number("RESULTS_MB"),
            full_maps_mb=number("FULL_MAPS_MB", fallback="full_maps_mb"),
            memory_mb=number("MEMORY_MB", fallback="memory_mb"),
            checkpoint_mb=number("CHECKPOINT_MB", fallback="checkpoint_mb"),
            shared=switch("SHARED"), roots=tuple(p for p in get("ROOTS").split(":") if p.strip()),
            write_root=get("WRITE_ROOT") or None,
            models=tuple(m.strip() for m in get("MODELS").split(",") if m.strip()) or None,
            trust_remote_code=get("TRUST_REMOTE_CODE").lower() in TRUE,
            caps=tuple((k, int(secrets[k])) for k in ("jobs", "max_tokens", "max_cells") if k in secrets))
        # a variable left unset keeps the library's default
        return cls(**{f.name: getattr(defaults, f.name) if given[f.name] is None else given[f.name]
                      for f in fields(cls)})

    def cap(self, name: str, default: int) -> int:
        """A shared server's cap from secrets.toml (``jobs``, ``max_tokens``, ``max_cells``), else ``default``."""
        return dict(self.caps).get(name, default)

    def replace(self, **changes) -> "Settings":
        return replace(self, **changes)


DEFAULTS = Settings()
_active = DEFAULTS


def active() -> Settings:
    """The settings the library runs under: :data:`DEFAULTS` until a front end calls :func:`use`."""
    return _active


def use(settings: Settings) -> Settings:
    """Make ``settings`` the ones the library runs under, in this process (a front end's call, once it has read
    them); returns the ones they replace."""
    global _active
    if not isinstance(settings, Settings):
        raise InputError(f"use takes attnviz.settings.Settings, not a {type(settings).__name__}")
    previous, _active = _active, settings
    return previous


@contextmanager
def applied(settings: Settings | None = None, **changes):
    """Inside, the library runs under ``settings`` (None: the active ones) with ``changes``; after, as before."""
    previous = use((settings or active()).replace(**changes))
    try:
        yield active()
    finally:
        use(previous)


def environment_without(*names: str) -> dict[str, str]:
    """This process's environment less ``names``: a child process's (a kernel compiled without Triton's
    interpreter)."""
    return {k: v for k, v in os.environ.items() if k not in names}


def passed(names) -> dict[str, str]:
    """The variables of ``names`` set in this process: what a sweep's workers on a cluster are given."""
    return {k: os.environ[k] for k in names if k in os.environ}
