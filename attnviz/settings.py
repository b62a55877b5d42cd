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

import math
import numbers
import os
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Mapping

from attnviz.errors import InputError

TRUE, FALSE = ("1", "true", "yes"), ("0", "false", "no")
#: the dtypes a model loads in (``ATTNVIZ_DTYPE``; auto: by device)
DTYPES = ("auto", "float32", "fp32", "float16", "fp16", "bfloat16", "bf16")
#: a shared server's caps in secrets.toml's [attnviz] table
CAPS = ("jobs", "max_tokens", "max_cells")


def _whole(least: int):
    return lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= least


def _above_zero(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _text(v) -> bool:
    return isinstance(v, str) and bool(v.strip())


def _texts(v) -> bool:
    return isinstance(v, tuple) and all(_text(x) for x in v)


def _switch(v) -> bool:
    return isinstance(v, bool)


MB = "a number of MB above 0"
WHOLE_MB = "a whole number of MB, at least 0"
#: what each field takes, in words, and its check (a field whose default is None takes None too): one place, so a
#: value of the wrong type or range is refused in one line however it came (the environment, replace, a caller)
TAKES = {
    "device": ("a device's name (cpu, cuda, cuda:1, ...)", _text), "dtype": (f"one of {', '.join(DTYPES)}",
                                                                           lambda v: v in DTYPES),
    "cache": ("a folder's path", _text), "device_mb": (MB, _above_zero), "block_mb": (MB, _above_zero),
    "whole_allow_mb": (WHOLE_MB, _whole(0)), "fused": ("True or False", _switch),
    "fused_lse": ("True or False", _switch),
    "cudnn": ("True or False", _switch),
    "kernel_tile": ("two whole numbers above 0 (BM, BN)",
                    lambda v: isinstance(v, tuple) and len(v) == 2 and all(_whole(1)(x) for x in v)),
    "kernel_warps": ("4 or 8", lambda v: _whole(1)(v) and v in (4, 8)),
    "kernel_stages": ("a whole number, at least 1", _whole(1)), "kernel_groups": ("a whole number, at least 1",
                                                                                  _whole(1)),
    "kernel_registers": ("a whole number, at least 0 (0: no cap)", _whole(0)), "viewer_mb": (MB, _above_zero),
    "debug": ("True or False", _switch), "max_tokens": ("a whole number of tokens, at least 1", _whole(1)),
    "results_mb": ("a whole number of MB, at least 1", _whole(1)), "full_maps_mb": (WHOLE_MB, _whole(0)),
    "memory_mb": (WHOLE_MB + " (0: a quarter of the machine's memory)", _whole(0)),
    "checkpoint_mb": (WHOLE_MB, _whole(0)), "shared": ("True or False", _switch),
    "roots": ("folders' paths", _texts), "write_root": ("a folder's path", _text),
    "models": ("model names", lambda v: _texts(v) and bool(v)), "trust_remote_code": ("True or False", _switch),
    "caps": (f"(name, whole number of at least 1) pairs, the names among {', '.join(CAPS)}",
             lambda v: isinstance(v, tuple) and all(isinstance(c, tuple) and len(c) == 2 and c[0] in CAPS
                                                    and _whole(1)(c[1]) for c in v)),
}


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

    def __post_init__(self):
        """Every field checked against :data:`TAKES`, refused in one line naming the field and its variable (a list
        where a tuple is kept is taken as one)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list) and f.name in ("kernel_tile", "roots", "models", "caps"):
                value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
                object.__setattr__(self, f.name, value)
            takes, ok = TAKES[f.name]
            if not (value is None and f.default is None) and not ok(value):
                where = f" (ATTNVIZ_{f.name.upper()})" if f.name != "caps" else " (secrets.toml's [attnviz] table)"
                raise InputError(f"the setting {f.name}{where} is {takes}{' or None' if f.default is None else ''}, "
                                 f"not {value!r} (docs/cli.md#settings)")

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
            if value and value not in TRUE + FALSE:
                raise InputError(f"ATTNVIZ_{name}={get(name)!r}: not a switch ({'/'.join(TRUE)} or "
                                 f"{'/'.join(FALSE)})")
            return True if value in TRUE else False if value in FALSE else None

        def cap(name: str) -> int:
            try:
                return int(str(secrets[name]).strip())
            except ValueError:
                raise InputError(f"secrets.toml's [attnviz] {name} = {secrets[name]!r}: not a whole number") from None

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
            whole_allow_mb=number("WHOLE_ALLOW_MB"), fused=switch("FUSED"), fused_lse=switch("FUSED_LSE"),
            cudnn=switch("CUDNN"),
            kernel_tile=(bm, bn) if tile else None, kernel_warps=number("KERNEL_WARPS"),
            kernel_stages=number("KERNEL_STAGES"), kernel_groups=number("KERNEL_GROUPS"),
            kernel_registers=number("KERNEL_REGISTERS"), viewer_mb=number("VIEWER_MB", float),
            debug=switch("DEBUG"), max_tokens=number("MAX_TOKENS") or None, results_mb=number("RESULTS_MB"),
            full_maps_mb=number("FULL_MAPS_MB", fallback="full_maps_mb"),
            memory_mb=number("MEMORY_MB", fallback="memory_mb"),
            checkpoint_mb=number("CHECKPOINT_MB", fallback="checkpoint_mb"),
            shared=switch("SHARED"), roots=tuple(p for p in get("ROOTS").split(":") if p.strip()),
            write_root=get("WRITE_ROOT") or None,
            models=tuple(m.strip() for m in get("MODELS").split(",") if m.strip()) or None,
            trust_remote_code=switch("TRUST_REMOTE_CODE"),
            caps=tuple((k, cap(k)) for k in CAPS if k in secrets))
        # a variable left unset keeps the library's default
        return cls(**{f.name: getattr(defaults, f.name) if given[f.name] is None else given[f.name]
                      for f in fields(cls)})

    def cap(self, name: str, default: int) -> int:
        """A shared server's cap from secrets.toml (``jobs``, ``max_tokens``, ``max_cells``), else ``default``."""
        return dict(self.caps).get(name, default)

    def replace(self, **changes) -> "Settings":
        """These settings with ``changes``, each checked as the settings are (a name they lack refused too)."""
        unknown = [name for name in changes if name not in TAKES]
        if unknown:
            raise InputError(f"the settings have no {unknown[0]!r} (they are {', '.join(TAKES)}: docs/cli.md#settings)")
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
