"""Training runs on disk for the Emergence page (docs/lab.md): the run folders :func:`attnviz.lab.train.train`
writes, found under a folder, each with its checkpoints' steps and its setup, built on the one reader of a run folder
(:mod:`attnviz.core.loading.runs`: the steps, a step's folder and its refusal, the metadata). A checkpoint loads as
any model does (``attnviz.load``, its own tokenizer), and the page captures it on :func:`probe_text`: a sequence of
the run's own task (the emergence table's probe) written out by that tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attnviz.core.loading import runs
from attnviz.errors import InputError
from attnviz.lab import emergence
from attnviz.lab.train import Setup


@dataclass(frozen=True)
class LabRun:
    """One run folder: its checkpoints' steps and the setup it was trained with (``attnviz_run.json``'s)."""

    folder: Path
    steps: tuple[int, ...]
    setup: dict

    @property
    def name(self) -> str:
        return self.folder.name

    def checkpoint(self, step: int) -> Path:
        """The folder of the checkpoint at ``step``, checked whole (:func:`attnviz.core.loading.runs.check`); a step
        the run has none at, or a damaged checkpoint, is refused in one line."""
        folder = runs.step_folder(self.folder, step)
        runs.check(folder)
        return folder

    def meta(self, step: int) -> dict:
        return runs.check(runs.step_folder(self.folder, step))

    def trained(self) -> Setup:
        """The setup as a :class:`~attnviz.lab.train.Setup` (:meth:`~attnviz.lab.train.Setup.from_dict`)."""
        return Setup.from_dict(self.setup)


def open_run(folder: str | Path) -> LabRun:
    """The run in ``folder``, its setup its last checkpoint's (checked whole); a folder that holds no checkpoint, or
    whose last checkpoint is damaged, is refused in one line."""
    folder = Path(folder)
    steps = runs.steps_of(folder)
    if not steps:
        what = "does not exist" if not folder.exists() else f"holds no step-N checkpoint with {runs.RUN_FILE}"
        raise InputError(f"'{folder}' is no training run: it {what}")
    return LabRun(folder, tuple(steps), runs.check(folder / f"step-{steps[-1]}")["setup"])


def find_runs(folder: str | Path, refused: list[str] | None = None) -> list[LabRun]:
    """The runs in ``folder``: the folder itself where it is one, else its sub-folders that are (by name). Given a
    list ``refused``, a sub-folder run that is refused (a damaged last checkpoint) is left out with its one-line
    reason appended there, so one damaged run does not hide the others; without it, it is refused."""
    folder = Path(folder)
    if runs.steps_of(folder):
        return [open_run(folder)]
    if not folder.is_dir():
        return []
    found = []
    for p in sorted(folder.iterdir()):
        if p.is_dir() and runs.steps_of(p):
            try:
                found.append(open_run(p))
            except InputError as err:
                if refused is None:
                    raise
                refused.append(str(err))
    return found


def probe_text(loaded, run: LabRun) -> str:
    """One sequence of the run's own task, drawn as the emergence table's probe is (:func:`emergence.task_probe`,
    the same at every step), written out by the checkpoint ``loaded``'s own tokenizer (:func:`emergence.as_text`)."""
    return emergence.as_text(loaded, emergence.task_probe(run.setup, 1).ids[0])
