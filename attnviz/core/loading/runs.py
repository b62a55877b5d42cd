"""A lab run's folder (docs/lab.md#loading), written by attnviz.lab.train: ``step-N`` checkpoints, each a Hugging
Face folder with ``attnviz_run.json``. ``attnviz.load(RUN)`` loads the run's last checkpoint,
``attnviz.load(RUN/step-N)`` that one; a step the run does not have is refused in one line naming the steps it has."""

from __future__ import annotations

import re
from pathlib import Path

from attnviz.errors import InputError

RUN_FILE = "attnviz_run.json"


def steps_of(out) -> list[int]:
    """The steps of the checkpoints saved in the run folder ``out``, in order (none: not a run)."""
    found = []
    out = Path(out)
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


def _listed(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 12 else f"{', '.join(map(str, steps[:10]))}, ..., {steps[-1]}"


def checkpoint(path: Path, name: str) -> Path:
    """The folder to load for ``path``: a run's last checkpoint for a run folder, else ``path`` itself; refused in
    one line for a checkpoint a run does not have."""
    if path.is_dir() and not (path / "config.json").is_file() and steps_of(path):
        return last(path)
    if not path.exists() and steps_of(path.parent):
        steps = steps_of(path.parent)
        match = re.fullmatch(r"step-(\d+)", path.name)
        what = f"no step {int(match.group(1))}" if match else f"no checkpoint {path.name!r}"
        past = " (past its last)" if match and int(match.group(1)) > steps[-1] else ""
        raise InputError(f"the lab run {path.parent} has {what}{past}: its last is step-{steps[-1]}, its "
                         f"checkpoints are at steps {_listed(steps)}")
    return path
