"""The Emergence page's glue: the runs folder (under the access rules), each run's table of measures (through
:func:`table`, the one way the page reaches ``attnviz.lab.emergence.table``), a checkpoint captured on the run's
probe, and a small training run of any kind and mask the trainer takes, each a job in the server's queue with a
progress bar (:func:`ui.jobs.run`)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import streamlit as st

from attnviz.core.spec import kinds
from attnviz.errors import AttnvizError
from attnviz.lab import emergence
from attnviz.lab import runs as runs_mod
from attnviz.lab.runs import LabRun
from ui import jobs, shared

#: the attention kinds the trainer takes, as the call syntax writes them (docs/methods.md#attention-kinds)
KINDS = kinds.help(trained=True)
DEFAULT_KIND = "softmax"
DEFAULT_MASK = "fwd"  # the causal mask, as the call syntax writes it


def default_folder() -> Path:
    """Where runs live by default: ``runs/`` in the app's data folder (beside the Sweeps page's results)."""
    from attnviz.core.loading.models import cache_dir

    return cache_dir() / "runs"


def table(run_folder, on_step=None):
    """The run's measures over its checkpoints, one row per (step, layer, head), on the run's own probe:
    ``attnviz.lab.emergence.table(run_folder, on_step=on_step)`` (``on_step(done, total)`` after each checkpoint;
    tests may replace this function with a faster table of the same columns)."""
    return emergence.table(run_folder, on_step=on_step)


def found(folder: str) -> list[LabRun] | None:
    """The runs in ``folder`` (the folder itself, or its sub-folders); None after ``st.error`` where the folder may
    not be read or is no run and holds none. The default folder is no error: it holds no run yet."""
    path = shared.checked(shared.access().readable, folder, "runs folder")
    if path is None:
        return None
    refused: list[str] = []
    try:
        runs = runs_mod.find_runs(path, refused)
    except (AttnvizError, OSError, ValueError) as err:
        st.error(f"Runs folder: {err}")
        return None
    for reason in refused:  # a damaged run is left out, said, and the others shown
        st.warning(f"Left out: {reason}")
    if not runs and Path(folder) != default_folder():
        st.error(f"'{folder}' is no training run and holds none (a run is a folder of step-N checkpoints).")
        return None
    return runs


def measured(run: LabRun):
    """The run's table, computed once per run and last checkpoint (a job with a progress bar, moved after each
    checkpoint); None after a message."""
    last = run.meta(run.steps[-1]).get("hash", "")

    def compute(progress):
        return table(run.folder, on_step=lambda done, total: progress(done, total))

    return jobs.run(("emergence-table", str(run.folder), run.steps, last), f"Measuring {run.name}'s checkpoints",
                    compute)


def capture_at(run: LabRun, step: int):
    """The checkpoint at ``step`` (loaded as ``attnviz.load`` loads it, float32, its own tokenizer) captured on a
    sequence of the run's task under the run's own mask (full maps of every layer), or None after a message."""
    from attnviz.capture import prepare
    from attnviz.core.loading.models import load

    def compute(progress):
        loaded = load(str(run.checkpoint(step)), dtype="float32")
        return prepare(loaded, runs_mod.probe_text(loaded, run), run.trained().arch).run_reporting(progress)

    meta = run.meta(step)
    return jobs.run(("emergence-capture", str(run.folder), step, meta.get("hash")),
                    f"Capturing {run.name} at step {step}", compute)


def setup_for(kind: str, mask: str, steps: int, seed: int):
    """The trainer's setup of a small run (the lab's default model and task, ``steps`` steps, ``seed`` for the
    weights and the task) under ``kind`` and ``mask`` (blank: softmax, fwd); what the trainer cannot train is refused
    in one line by the trainer itself (:class:`~attnviz.lab.train.Setup`)."""
    from attnviz.lab.tasks import BigramBackcopy
    from attnviz.lab.train import Setup

    return Setup(kind=kind.strip() or DEFAULT_KIND, arch=mask.strip() or DEFAULT_MASK, steps=int(steps),
                 seed=int(seed), task=BigramBackcopy(seed=int(seed)))


def run_name(kind: str, mask: str, steps: int, seed: int) -> str:
    return re.sub(r"[^A-Za-z0-9.=]+", "-", f"{kind}-{mask}-seed{seed}-{steps}steps").strip("-")


def train_run(folder: str, kind: str, mask: str, steps: int, seed: int) -> Path | None:
    """Train a small run into ``folder``/<its name> as a job in the server's queue, the bar showing the step and the
    loss; the last checkpoint's folder, or None after a message."""
    try:
        setup = setup_for(kind, mask, steps, seed)
    except AttnvizError as err:
        st.error(f"Training: {err}")
        return None
    root = shared.checked(shared.access().writable, folder, "runs folder")
    if root is None:
        return None
    out = root / run_name(setup.kind, setup.arch, setup.steps, setup.seed)
    from attnviz.lab.train import train

    def compute(progress):
        every = max(1, setup.steps // 200)  # the bar moves about 200 times, whatever the length

        def on_step(step, total, loss):
            if step % every == 0 or step == total:
                progress(step, total, f"loss {loss:.3f}")
        return str(train(setup, out, on_step=on_step))

    key = ("lab-train", str(out), dataclasses.astuple(setup))
    done = jobs.run(key, f"Training {out.name}", compute, units=setup.steps)
    return None if done is None else Path(done)


def export_meta(run: LabRun, step: int) -> dict:
    """What an exported figure of ``run`` at ``step`` carries (docs/app.md#exports): the run's folder name as its model,
    its mask as its architecture, its kind and seed, and one line saying what the run is (the file's description)."""
    setup = run.setup
    kind, mask, seed = setup.get("kind", DEFAULT_KIND), setup.get("arch", DEFAULT_MASK), setup.get("seed", 0)
    task = (setup.get("task") or {}).get("name", "bigram-backcopy")
    trained = setup.get("steps", run.steps[-1])
    return {"tool": "attnviz", "model": run.name, "arch": mask, "kind": kind, "seed": seed, "step": step,
            "run": str(run.folder), "description": f"lab run {run.name}: {kind} · {mask} · seed {seed}, {task}, "
                                                  f"{trained} steps; at step {step}"}
