"""Defaults are declared once, on the library function or dataclass that uses them; every front end
reads them from there with :func:`of` (the CLI's options and help, the app's widgets, a sweep's measure
options). ``tests/test_defaults.py`` walks the CLI's parsers, the sweep's measures and the library
signatures and fails where two disagree.
"""

from __future__ import annotations

import inspect


def of(target) -> dict:
    """Every keyword default of a function, method or dataclass, by parameter name."""
    return {name: p.default for name, p in inspect.signature(target).parameters.items()
            if p.default is not inspect.Parameter.empty}


def one(target, name: str):
    """One parameter's default (``KeyError`` names the parameter when it has none)."""
    values = of(target)
    if name not in values:
        raise KeyError(f"{getattr(target, '__qualname__', target)} declares no default for '{name}'")
    return values[name]
