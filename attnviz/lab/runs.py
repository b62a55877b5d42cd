"""A training run on disk (docs/lab.md): the folders :func:`attnviz.lab.train.train` writes (``RUN/step-N/``, each a
Hugging Face folder with ``attnviz_run.json``), found under a folder, its checkpoints by step, its setup read back,
and one checkpoint loaded as a :class:`~attnviz.core.loading.models.LoadedModel` that captures like any model: a
lab model has no tokenizer, so its text is the task's token ids written out (``BOS 17 2 17 …``) and
:class:`TaskTokenizer` reads them back. The probe is one sequence of the run's own task, the same at every step.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from attnviz.core.loading.models import LoadedModel
from attnviz.errors import InputError
from attnviz.lab.tasks import BOS, BigramBackcopy
from attnviz.lab.train import Setup

META = "attnviz_run.json"
PROBE_STEP = 10**6  # the task's batch of this step is the probe: a step no run trains on (a fresh sequence)
_STEP = re.compile(r"^step-(\d+)$")


def checkpoint_steps(folder: str | Path) -> list[int]:
    """The steps of the whole checkpoints in ``folder`` (``step-N`` folders with their ``attnviz_run.json``)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir()
                  if (m := _STEP.match(p.name)) and (p / META).is_file())


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
        """The folder of the checkpoint at ``step``; a step the run has none at is refused in one line."""
        if step not in self.steps:
            past = f"past its last checkpoint ({self.steps[-1]})" if step > self.steps[-1] else "not one of its checkpoints"
            raise InputError(f"run '{self.name}' has no checkpoint at step {step}: {past}")
        return self.folder / f"step-{step}"

    def meta(self, step: int) -> dict:
        return json.loads((self.checkpoint(step) / META).read_text())

    def trained(self) -> Setup:
        """The setup as a :class:`~attnviz.lab.train.Setup` (fields it does not know are left out)."""
        return setup_of(self.setup)


def open_run(folder: str | Path) -> LabRun:
    """The run in ``folder``; a folder that holds no checkpoint is refused in one line."""
    folder = Path(folder)
    steps = checkpoint_steps(folder)
    if not steps:
        what = "does not exist" if not folder.exists() else "holds no step-N checkpoint with attnviz_run.json"
        raise InputError(f"'{folder}' is no training run: it {what}")
    setup = json.loads((folder / f"step-{steps[-1]}" / META).read_text()).get("setup") or {}
    return LabRun(folder, tuple(steps), setup)


def find_runs(folder: str | Path) -> list[LabRun]:
    """The runs in ``folder``: the folder itself where it is one, else its sub-folders that are (by name)."""
    folder = Path(folder)
    if checkpoint_steps(folder):
        return [open_run(folder)]
    if not folder.is_dir():
        return []
    return [open_run(p) for p in sorted(folder.iterdir()) if p.is_dir() and checkpoint_steps(p)]


def setup_of(saved: dict) -> Setup:
    """A :class:`Setup` from its saved form (``dataclasses.asdict``), its task rebuilt; unknown fields dropped."""
    known = {f.name for f in dataclasses.fields(Setup)}
    fields = {k: v for k, v in saved.items() if k in known}
    task = fields.get("task")
    if isinstance(task, dict):
        names = {f.name for f in dataclasses.fields(BigramBackcopy)}
        fields["task"] = BigramBackcopy(**{k: v for k, v in task.items() if k in names})
    return Setup(**fields)


class TaskTokenizer:
    """The tokenizer of a lab model: its text is the token ids written out, ``BOS`` for the first and ``T1``… for the
    task's triggers; ``decode`` shows them the same way. Nothing else is a token."""

    def __init__(self, task: BigramBackcopy):
        self.task = task

    def token(self, i: int) -> str:
        return "BOS" if i == BOS else f"T{i}" if 1 <= i <= self.task.triggers else str(i)

    def text(self, ids) -> str:
        return " ".join(self.token(int(i)) for i in ids)

    def ids(self, text: str) -> list[int]:
        out = []
        for word in str(text).split():
            value = BOS if word == "BOS" else int(word[1:]) if word[:1] == "T" and word[1:].isdigit() else (
                int(word) if word.isdigit() else None)
            if value is None or not 0 <= value < self.task.vocab:
                raise InputError(f"'{word}' is no token of this task: BOS, T1…T{self.task.triggers} or a number "
                                 f"below {self.task.vocab}")
            out.append(value)
        return out

    def __call__(self, text: str, add_special_tokens: bool = True, **_) -> dict:
        return {"input_ids": self.ids(text)}

    def decode(self, ids, **_) -> str:
        return self.text(ids)


def probe_text(run: LabRun) -> str:
    """One sequence of the run's own task (its seed's, at :data:`PROBE_STEP`), written out for :class:`TaskTokenizer`."""
    task = run.trained().task
    return TaskTokenizer(task).text(task.batch(1, PROBE_STEP)[0].tolist())


def load_checkpoint(run: LabRun, step: int, device: str = "cpu") -> LoadedModel:
    """The checkpoint at ``step`` as a model attnviz captures (its attention through the engine), on ``device``."""
    from transformers import AutoModelForCausalLM

    from attnviz.core.engine import KEY, prepare

    folder = run.checkpoint(step)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=KEY, use_safetensors=True).to(device)
    model.eval()
    prepare(model)
    return LoadedModel(model, TaskTokenizer(run.trained().task), f"{run.name}@step-{step}", None,
                       time.perf_counter() - started)
