"""A lab run's folder (docs/lab.md#loading), written by attnviz.lab.train: ``step-N`` checkpoints, each a Hugging
Face folder with ``attnviz_run.json`` and a tokenizer. The one place that lists a run's steps, finds one of them and
reads a checkpoint's metadata: ``attnviz.load(RUN)`` loads the run's last checkpoint, ``attnviz.load(RUN/step-N)``
that one; a step the run does not have is refused in one line naming the steps it has, and a lab checkpoint saved
without a tokenizer (before checkpoints carried one) in one line saying so."""

from __future__ import annotations

import json
import re
from pathlib import Path

from attnviz.errors import InputError

RUN_FILE = "attnviz_run.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def steps_of(out) -> list[int]:
    """The steps of the checkpoints saved in the run folder ``out``, in order (none: not a run)."""
    found = []
    out = Path(out).expanduser()
    if not out.is_dir():
        return found
    for p in out.glob("step-*"):
        tail = p.name[5:]
        if p.is_dir() and tail.isdigit() and (p / RUN_FILE).is_file():
            found.append(int(tail))
    return sorted(found)


def last(out) -> Path | None:
    steps = steps_of(out)
    return Path(out) / f"step-{steps[-1]}" if steps else None


def is_checkpoint(folder) -> bool:
    """Whether ``folder`` is one lab checkpoint (a folder with the lab's metadata)."""
    return (Path(folder).expanduser() / RUN_FILE).is_file()


def meta(folder) -> dict:
    """A checkpoint's metadata (``attnviz_run.json``: step, loss, hash, recipe, setup); empty where it has none,
    refused in one line where it cannot be read."""
    path = Path(folder).expanduser() / RUN_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read '{path}': {str(err).splitlines()[0]}") from None


def _listed(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 12 else f"{', '.join(map(str, steps[:10]))}, ..., {steps[-1]}"


def _missing(run: Path, steps: list[int], what: str, step: int | None) -> InputError:
    past = " (past its last)" if step is not None and step > steps[-1] else ""
    return InputError(f"the lab run {run} has {what}{past}: its last is step-{steps[-1]}, its checkpoints are at "
                      f"steps {_listed(steps)}")


def step_folder(run, step: int) -> Path:
    """The checkpoint of the run folder ``run`` at ``step``; a step it has none at is refused in one line."""
    run = Path(run).expanduser()
    steps = steps_of(run)
    if not steps:
        raise InputError(f"'{run}' is no lab run: it holds no step-N checkpoint with {RUN_FILE}")
    if step not in steps:
        raise _missing(run, steps, f"no step {step}", step)
    return run / f"step-{step}"


def checkpoint(path: Path, name: str) -> Path:
    """The folder to load for ``path``: a run's last checkpoint for a run folder, else ``path`` itself; refused in
    one line for a checkpoint a run does not have, and for a lab checkpoint without a tokenizer."""
    if path.is_dir() and not (path / "config.json").is_file() and steps_of(path):
        path = last(path)
    elif not path.exists() and steps_of(path.parent):
        match = re.fullmatch(r"step-(\d+)", path.name)
        if match:
            step_folder(path.parent, int(match.group(1)))
        raise _missing(path.parent, steps_of(path.parent), f"no checkpoint {path.name!r}", None)
    if is_checkpoint(path) and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise InputError(f"the lab checkpoint '{name}' has no tokenizer (saved before checkpoints carried one): "
                         "train the run again to load it")
    return path
