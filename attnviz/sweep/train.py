"""Training cells of a sweep (docs/sweeps.md#training-cells): a ``[train]`` table (or several, ``[[train]]``) whose
keys are the lab's options, each list an axis and each single value fixed, the grid their product; each cell trains
one run (:func:`attnviz.lab.train.train`, resumed from its last checkpoint) and then runs the spec's measures on every
checkpoint of it.

The keys are read off the dataclasses, never listed here: every field of :class:`attnviz.lab.train.Setup` but its
task, ``task`` (a task's option in the lab's registry, :data:`attnviz.lab.tasks.TASKS`: ``"bigram"``, ``"repeat"``,
``"text"``) and the fields of the chosen task's dataclass; ``seed`` seeds both the weights and
the task, as ``attnviz train --seed`` does. Each value is checked against its field's type and every cell's
:class:`~attnviz.lab.train.Setup` is built before anything runs, so a bad key or value is refused naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
import types
import typing
from dataclasses import dataclass, field

from attnviz.errors import AttnvizError, InputError

#: readable short names of some keys in a run's id (any other key is written whole)
SHORT = {"weight_decay": "wd", "seed": "s", "steps": "n", "layers": "L", "width": "d", "heads": "h"}


def _task_classes() -> dict:
    """Each task of the lab's registry (:data:`attnviz.lab.tasks.TASKS`) by its command-line option."""
    from attnviz.lab.tasks import TASKS

    return {task.option: task for task in TASKS.values()}


def keys() -> dict[str, dict[str, object]]:
    """``{"setup": {key: type}, "bigram": {...}, "repeat": {...}, "text": {...}}``: the table's keys and their types, read from the
    dataclasses' fields (``task`` and the task's own ``name`` left out; ``seed`` is the setup's)."""
    from attnviz.lab.train import Setup

    out = {"setup": {f.name: typing.get_type_hints(Setup)[f.name] for f in dataclasses.fields(Setup)
                     if f.name != "task"}}
    for name, cls in _task_classes().items():
        hints = typing.get_type_hints(cls)
        out[name] = {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in ("name", "seed")}
    return out


def _types(hint) -> tuple[type, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(t for t in typing.get_args(hint) if t is not type(None))
    return (hint,) if isinstance(hint, type) else ()


def _value(key: str, value, hint):
    """``value`` checked against the field's type (an int where a float is asked is taken as that float)."""
    allowed = _types(hint)
    if not allowed:
        return value
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if any(isinstance(value, t) and not (t is int and isinstance(value, bool)) for t in allowed):
        return value
    names = " or ".join(t.__name__ for t in allowed)
    raise InputError(f"spec: 'train.{key}' must be {names}, got {value!r}")


@dataclass(frozen=True)
class TrainCell:
    """One run of the grid: its :class:`~attnviz.lab.train.Setup`, the values of the keys the spec named (``values``)
    and which of them are lists (``axes``)."""

    setup: object
    values: dict = field(hash=False, compare=False)
    axes: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        """The run's folder name: its kind, mask and the values of its axes, then a hash of the whole setup."""
        parts = [self.setup.kind, self.setup.arch]
        parts += [f"{SHORT.get(k, k)}{self.values[k]}" for k in self.axes if k not in ("kind", "arch")]
        name = "-".join(re.sub(r"[^A-Za-z0-9.=]+", "_", str(p)).strip("_") for p in parts)[:80]
        digest = hashlib.sha1(json.dumps(self.setup.as_dict(), sort_keys=True).encode()).hexdigest()[:8]
        return f"{name}-{digest}"

    def info(self, step: int | None = None) -> dict:
        """What a row of this run carries (:mod:`.store`): the run's id, the values of the keys named, which are
        axes, the setup, and the checkpoint's step."""
        return {"run": self.id, "values": dict(self.values), "axes": list(self.values), "step": step,
                "setup": self.setup.as_dict()}


def _one(table: dict, known: dict) -> list[TrainCell]:
    from attnviz.lab.train import Setup

    if not isinstance(table, dict):
        raise InputError("spec: 'train' must be a table of lab options, e.g. [train] kind = [\"softmax\", \"sink\"]")
    tasks = _task_classes()
    allowed = {**known["setup"], "task": str, **{k: t for name in tasks for k, t in known[name].items()}}
    lists = {}
    for key, raw in table.items():
        if key not in allowed:
            raise InputError(f"spec: unknown key 'train.{key}' (expected {', '.join(sorted(allowed))})")
        values = raw if isinstance(raw, list) else [raw]
        if not values:
            raise InputError(f"spec: 'train.{key}' is empty: the grid has no cell")
        lists[key] = list(dict.fromkeys(_value(key, v, allowed[key]) for v in values))
        if key == "task":
            for v in lists[key]:
                if v not in tasks:
                    raise InputError(f"spec: 'train.task' must be one of {', '.join(tasks)}, got {v!r}")
    axes = tuple(k for k, raw in table.items() if isinstance(raw, list))
    cells = []
    for combo in itertools.product(*lists.values()):
        values = dict(zip(lists, combo))
        task = values.get("task", "bigram")
        extra = [k for k in values if k not in known["setup"] and k != "task" and k not in known[task]]
        if extra:
            raise InputError(f"spec: 'train.{extra[0]}' is not an option of the {task} task")
        seed = values.get("seed", Setup.seed)
        try:
            made = tasks[task](seed=seed, **{k: v for k, v in values.items() if k in known[task]})
            setup = Setup(**{k: v for k, v in values.items() if k in known["setup"]}, task=made)
        except (AttnvizError, TypeError, ValueError) as err:
            where = ", ".join(f"{k}={v!r}" for k, v in values.items() if k in axes)
            raise InputError(f"spec: train{f' ({where})' if where else ''}: {err}") from None
        cells.append(TrainCell(setup, values, axes))
    return cells


def parse(raw) -> list[TrainCell]:
    """The training cells of a spec's ``train`` (a table, or an array of tables whose grids are joined), in order,
    each setup once; every key and value checked and every setup built (the module docstring)."""
    tables = raw if isinstance(raw, list) else [raw]
    if not tables:
        raise InputError("spec: 'train' is empty: the grid has no cell")
    known = keys()
    found: dict[str, TrainCell] = {}
    for table in tables:
        for cell in _one(table, known):
            found.setdefault(cell.id, cell)
    every = tuple(dict.fromkeys(k for c in found.values() for k in c.values))
    # every run carries every key any table named (its own value, or the setup's where its table left it out)
    return [TrainCell(c.setup, {k: c.values.get(k, _named(c.setup, k)) for k in every}, c.axes)
            for c in found.values()]


def _named(setup, key: str):
    """The value of ``key`` in ``setup``: a setup's field, ``task``, or a field of its task."""
    if key == "task":
        return next(name for name, cls in _task_classes().items() if isinstance(setup.task, cls))
    return getattr(setup, key) if hasattr(setup, key) and key != "task" else getattr(setup.task, key, None)

