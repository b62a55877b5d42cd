"""The one call syntax of every option string: ``name(key=value, ...)@layers``, several joined with ``;``.

Architectures (``mask0-bidir(k=8)``), interventions (``sinkscale(beta=0.3)@20-29; ablate(heads=0,3)@5``),
KV-cache presses (``snapkv(window=64, kernel=5)``), cache policies (``sink(s=4, w=124)``) and attention kinds
(``softpick(eps=1e-6)``) are all written this way and read by the functions here. Each keeps a
:class:`Registry` of its classes (or builder functions); the registry reads every parameter's name, type and
default from the class's fields (the function's signature), so nothing is listed twice, and it writes the canonical
string back (:meth:`Registry.spec`): every field in declaration order, ``name`` alone when there are
none. Definitions: ``docs/methods.md#the-call-syntax``.

One layer-list syntax serves everywhere (:func:`layers`): ``all``, ``5``, ``-1`` (the top layer),
``20-29``, ``0,5,7`` or a mix.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

from attnviz.errors import InputError

_CALL = re.compile(r"^(?P<name>[a-z_][a-z0-9_&\-]*)\s*(?:\((?P<args>.*)\))?\s*(?:@\s*(?P<layers>.*))?$", re.S | re.I)


@dataclass(frozen=True)
class Call:
    """One parsed call: its name, its ``key=value`` arguments (raw text), its ``@layers`` (raw text)."""

    name: str
    args: dict[str, str]
    layers: str | None
    text: str


def split(text: str, sep: str = ";") -> list[str]:
    """The non-empty parts of ``text`` between separators (outside parentheses)."""
    parts, depth, current = [], 0, []
    for char in text:
        depth += (char == "(") - (char == ")")
        if char == sep and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def call(text: str, noun: str, usage: str, error=InputError) -> Call:
    """``name(a=1, heads=0,3)@5-7`` → :class:`Call`; names are case-insensitive. A piece without ``=``
    continues the value before it (``heads=0,3``). ``noun`` and ``usage`` write the refusal."""
    part = text.strip()
    match = _CALL.match(part)
    if not match or (match["args"] is not None and ("(" in match["args"] or ")" in match["args"])):
        raise error(f"cannot read {noun} '{part}': write {usage}")
    args: dict[str, str] = {}
    last = None
    for piece in (p.strip() for p in (match["args"] or "").split(",")):
        if not piece:
            continue
        if "=" in piece:
            key, value = (s.strip() for s in piece.split("=", 1))
            key = key.lower()
            if not key or not value:
                raise error(f"in '{part}': expected key=value, got '{piece}'")
            if key in args:
                raise error(f"in '{part}': parameter '{key}' given twice")
            args[key] = value
            last = key
        elif last is not None:
            args[last] += "," + piece
        else:
            raise error(f"in '{part}': expected key=value, got '{piece}'")
    return Call(match["name"].lower(), args, match["layers"].strip() if match["layers"] is not None else None, part)


@dataclass(frozen=True)
class Parameter:
    name: str
    type: Any
    default: Any  # inspect.Parameter.empty when required


class Registry:
    """The classes (or builders) of one ``noun`` (a mask type, an intervention, a press ...), by name.
    ``build(call)`` converts the arguments by the annotated types of the fields (int, float, str, bool,
    tuple[int, ...], and ``X | None``), refuses unknown and missing ones naming what is accepted, and calls the
    class; its own ``__post_init__`` checks ranges."""

    def __init__(self, noun: str, error=InputError, skip: tuple[str, ...] = ("layers",)):
        self.noun, self.error, self.skip = noun, error, skip
        self.entries: dict[str, Callable] = {}

    def register(self, name: str | None = None):
        def add(target):
            key = name or getattr(target, "name")
            self.entries[key] = target
            return target
        return add

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    def parameters(self, name: str) -> list[Parameter]:
        """Every parameter of ``name`` with its type and default, read from its fields or signature."""
        target = self.entries[name]
        hints = typing.get_type_hints(target)
        out = []
        for p in inspect.signature(target).parameters.values():
            if p.name in self.skip or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            out.append(Parameter(p.name, hints.get(p.name, str), p.default))
        return out

    def usage(self) -> str:
        """``a(x=X), b`` for help texts and errors: each name with its parameters."""
        def one(name):
            params = self.parameters(name)
            return f"{name}({', '.join(f'{p.name}={p.name.upper()}' for p in params)})" if params else name
        return ", ".join(one(n) for n in self.entries)

    def example(self, name: str) -> str:
        """``name(key=default, ...)`` with every default filled in (the selectors' choices)."""
        return self.spec(self.entries[name](**self.defaults(name))) if not self.required(name) else name

    def defaults(self, name: str) -> dict:
        return {p.name: p.default for p in self.parameters(name) if p.default is not inspect.Parameter.empty}

    def required(self, name: str) -> list[str]:
        return [p.name for p in self.parameters(name) if p.default is inspect.Parameter.empty]

    def build(self, parsed: Call, **extra):
        """The object ``parsed`` names, its arguments converted; ``extra`` go to the constructor as they are."""
        if parsed.name not in self.entries:
            raise self.error(f"cannot read {self.noun} '{parsed.text}': unknown {self.noun} '{parsed.name}'; "
                             f"use {self.usage()}")
        params = {p.name: p for p in self.parameters(parsed.name)}
        unknown = [k for k in parsed.args if k not in params]
        if unknown:
            accepted = ", ".join(params) or "no parameters"
            raise self.error(f"in '{parsed.text}': unknown parameter '{unknown[0]}': {parsed.name} takes "
                             f"{accepted}, not {', '.join(unknown)}")
        missing = [k for k in self.required(parsed.name) if k not in parsed.args]
        if missing:
            raise self.error(f"in '{parsed.text}': {parsed.name} needs {', '.join(k + '=' for k in missing)}")
        values = {k: convert(params[k].type, v, k, parsed.text, self.error) for k, v in parsed.args.items()}
        return self.entries[parsed.name](**values, **extra)

    def spec(self, obj) -> str:
        """The canonical string of a built object: every field in declaration order."""
        name = getattr(obj, "name")
        values = [f"{p.name}={_text(getattr(obj, p.name))}" for p in self.parameters(name)
                  if getattr(obj, p.name) is not None]
        return f"{name}({', '.join(values)})" if values else name


def convert(annotation, raw: str, key: str, where: str, error=InputError):
    """``raw`` as the annotated type ``annotation`` (Optional unwrapped; tuples of ints split at commas)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in args if a is not type(None))
        args = typing.get_args(annotation)
    raw = raw.strip()
    if typing.get_origin(annotation) is tuple:
        return tuple(convert(args[0] if args else int, piece, key, where, error) for piece in raw.split(",") if piece.strip())
    if annotation is bool:
        if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise error(f"in '{where}': {key}={raw} must be true or false")
        return raw.lower() in ("true", "1", "yes")
    if annotation in (int, float):
        try:
            number = float(raw)
        except ValueError:
            whole = "whole " if annotation is int else ""
            raise error(f"in '{where}': {key}={raw} is not a number ({key} must be a {whole}number)") from None
        if annotation is int:
            if number != int(number):
                raise error(f"in '{where}': {key}={raw} must be a whole number")
            return int(number)
        return number
    return raw.lower() if annotation is str else raw


def _text(value) -> str:
    if isinstance(value, tuple):
        return ",".join(_text(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def layers(text, n_layers: int, where: str | None = None, error=InputError) -> list[int]:
    """The one layer-list syntax: ``None``/``all`` → every layer; ``5``, ``-1`` (counted from the top),
    ``20-29`` (both ends included) and ``0,5,7`` mixed freely; a list or tuple of ints. Sorted, once each."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("", "all")):
        return list(range(n_layers))
    pieces = text.split(",") if isinstance(text, str) else list(text)
    context = f" in '{where}'" if where else ""
    chosen: set[int] = set()
    for piece in (str(p).strip() for p in pieces):
        match = re.fullmatch(r"(-?\d+)(?:\s*-\s*(-?\d+))?", piece)
        if not match:
            raise error(f"cannot read the layer '{piece}'{context}: write a layer (5, or -1 for the top one), "
                        "a range (20-29) or a list (0,5,7)")
        ends = [int(match[1])] + ([int(match[2])] if match[2] is not None else [])
        for end in ends:
            if not -n_layers <= end < n_layers:
                raise error(f"layer {end} does not exist: the model has layers 0..{n_layers - 1}")
        lo, hi = (e % n_layers for e in (ends[0], ends[-1]))
        if lo > hi:
            raise error(f"the layer range '{piece}'{context} runs backwards: write {hi}-{lo}")
        chosen.update(range(lo, hi + 1))
    return sorted(chosen)


def ranges(chosen) -> str:
    """(0, 1, 2, 5) → '0-2,5': the canonical layer list."""
    chosen = sorted(chosen)
    out, start = [], None
    for i, layer in enumerate(chosen):
        if start is None:
            start = layer
        if i + 1 == len(chosen) or chosen[i + 1] != layer + 1:
            out.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ",".join(out)


def fields_of(cls) -> list[str]:
    """The dataclass fields of ``cls`` that are parameters (not the layers)."""
    return [f.name for f in dataclasses.fields(cls) if f.name != "layers"]
