"""Running a grid: one Ray task per cell, on the local machine or on a Ray cluster.

Each task runs :func:`run_cell` in a Ray worker process. A worker keeps the last model it loaded
(:func:`model_for`) and the cells are submitted model by model, so a worker loads each model once
for its run of cells instead of once per cell; a model that fails to load is remembered by the
worker and every cell of that model is recorded as failed with the reason, the others run on.
Results are written by the worker itself (:mod:`.store`: one file per cell, atomic), so a sweep
interrupted anywhere loses at most the cells in flight, and rerunning it skips every finished cell.
A worker that dies mid-cell has its task retried by Ray (``max_retries``); the retry writes the same
file name, so no cell is ever duplicated.

``ray.init()`` starts a local Ray with this machine's CPUs (``workers`` caps them) and GPUs; an
``address`` (or ``RAY_ADDRESS``) joins a cluster, where each task asks for one GPU if the cluster has
any. ``local=True`` runs the cells in this process without Ray (the benchmark's baseline, and a
machine without Ray).

A training cell (``[train]``, :mod:`.train`) is one task too: it trains its run into ``RUNS/<run id>/`` (resumed from
its last checkpoint, so a worker killed mid-run loses at most the steps since it; a finished run trains nothing),
records it (``train/<run id>.parquet``), then runs the measure cells of its checkpoints not yet on disk.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from attnviz import settings
from attnviz.errors import AttnvizError
from attnviz.recipe import Recipe
from attnviz.sweep import measures, store
from attnviz.sweep import train as train_mod
from attnviz.sweep import spec as spec_mod
from attnviz.sweep.spec import Cell, Spec

#: environment a worker needs to find the same models offline (a cluster's workers do not inherit ours); attnviz's
#: own settings travel with each task (:func:`_ray_cell`), as the library never reads the environment
PASSED_ENV = ("HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")

_MODEL: dict = {}  # this process's model: {name: LoadedModel | AttnvizError}, one at a time (memory)


def model_for(name: str):
    """The worker's model ``name``, loaded once; a load failure is kept and raised again for every cell."""
    if name not in _MODEL:
        _MODEL.clear()
        gc.collect()
        from attnviz.core.loading import runs
        from attnviz.core.loading.models import load

        try:
            # a lab checkpoint in float32, as it was trained and as the emergence table reads it
            _MODEL[name] = load(name, dtype="float32" if runs.is_checkpoint(name) else None)
        except AttnvizError as err:
            _MODEL[name] = err
        except Exception as err:  # noqa: BLE001 - any loader failure is this model's, recorded with its cells
            _MODEL[name] = AttnvizError(f"cannot load model '{name}': {type(err).__name__}: {err}")
    found = _MODEL[name]
    if isinstance(found, Exception):
        raise found
    return found


def run_cell(out: str, cell: Cell) -> dict:
    """Compute one cell and write its file; an error is recorded in the file, never raised."""
    start = time.perf_counter()
    try:
        lm = model_for(cell.model)
        recipe = measures.recipe(lm, cell)
        rows = measures.RUN[cell.measure](lm, cell)
        store.write_cell(out, cell, rows, time.perf_counter() - start, recipe=recipe)
        return {"cell": cell.id, "status": "ok", "elapsed_s": time.perf_counter() - start}
    except Exception as err:  # noqa: BLE001 - one failed cell must not stop the others
        message = str(err) if isinstance(err, AttnvizError) else f"{type(err).__name__}: {err}"
        store.write_cell(out, cell, [], time.perf_counter() - start, error=message)
        return {"cell": cell.id, "status": "failed", "error": message, "elapsed_s": time.perf_counter() - start}


def run_training(out: str, runs: str, cell: train_mod.TrainCell, todo: list[Cell], recorded: bool = False,
                 on_step=None) -> dict:
    """Train one run (resumed from its last checkpoint), record it unless it is ``recorded`` already, then compute
    its measure cells ``todo``; an error is recorded in the files, never raised (Ctrl-C is)."""
    from attnviz.core.loading import runs as runs_mod
    from attnviz.lab.train import train

    start = time.perf_counter()
    folder = Path(runs) / cell.id
    marker = spec_mod.run_marker(cell, runs)
    try:
        before = runs_mod.steps_of(folder)
        last = train(cell.setup, folder, on_step=on_step)
        meta = runs_mod.meta(last)
        if not recorded:
            store.write_cell(out, marker, [{"step": meta["step"], "train_loss": meta["loss"], "hash": meta["hash"],
                                            "checkpoint": str(folder)}], time.perf_counter() - start)
    except Exception as err:  # noqa: BLE001 - one failed run must not stop the others
        message = str(err) if isinstance(err, AttnvizError) else f"{type(err).__name__}: {err}"
        store.write_cell(out, marker, [], time.perf_counter() - start, error=message)
        return {"cell": cell.id, "run": cell.id, "status": "failed", "error": message, "trained": None,
                "measured": 0, "elapsed_s": time.perf_counter() - start}
    failed = [r for r in (run_cell(out, c) for c in todo) if r["status"] != "ok"]
    return {"cell": cell.id, "run": cell.id, "status": "failed" if failed else "ok",
            "error": failed[0]["error"] if failed else "", "trained": cell.setup.steps - (before[-1] if before else 0),
            "measured": len(todo) - len(failed), "elapsed_s": time.perf_counter() - start}


def _ray_training(out: str, runs: str, cell, todo: list[Cell], recorded: bool,
                  given: settings.Settings | None = None) -> dict:
    """A training cell as a Ray task (torch threads and settings as :func:`_ray_cell`'s)."""
    import ray
    import torch

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    torch.set_num_threads(max(1, int(cpus)))
    if given is not None:
        settings.use(given)
    return run_training(out, runs, cell, todo, recorded)


def runs_folder(out: str, runs: str | None = None) -> str:
    """Where the trained runs go: ``runs`` where given, else ``OUT/runs``; for an object-store OUT (``s3://``,
    ``gs://``) a local folder, ``sweep-runs`` in the working folder (the trainer writes to a file system)."""
    if runs:
        return str(Path(runs).expanduser().resolve())
    return str(Path("sweep-runs").resolve()) if "://" in str(out) else f"{out}/runs"


def _ray_cell(out: str, cell: Cell, given: settings.Settings | None = None) -> dict:
    """A Ray task: torch gets the CPUs Ray gave the task, not every core of the node; the library runs under the
    sweep's settings (``given``: the caller's, handed down, since a worker has its own process)."""
    import ray
    import torch

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    torch.set_num_threads(max(1, int(cpus)))
    if given is not None:
        settings.use(given)
    return run_cell(out, cell)


@dataclass
class Summary:
    total: int
    skipped: int
    ok: int = 0
    failed: int = 0
    errors: dict[str, str] = field(default_factory=dict)  # cell id -> message
    elapsed_s: float = 0.0
    startup_s: float = 0.0  # starting or joining Ray
    runs: str = ""  # where the trained runs are (a spec with [train])
    trained: int = 0  # steps trained in this sweep, all runs together

    def as_json(self, out: str) -> dict:
        return {"out": out, "cells": self.total, "skipped": self.skipped, "ok": self.ok, "failed": self.failed,
                "elapsed_s": round(self.elapsed_s, 2), "startup_s": round(self.startup_s, 2), "errors": self.errors,
                **({"runs": self.runs, "trained_steps": self.trained} if self.runs else {})}


def sweep(spec: Spec, out: str, address: str | None = None, workers: int | None = None, local: bool = False,
          on_cell=None, runs: str | None = None, on_step=None) -> Summary:
    """Run every cell of ``spec`` not yet in ``out``, the training cells' runs in ``runs`` (:func:`runs_folder`).
    ``on_cell(done, total, result)`` after each cell; ``local`` only: ``on_step(run, step, steps, loss)`` after
    each training step."""
    out = str(out) if "://" in str(out) else str(Path(out).expanduser().resolve())
    cells = spec.cells()
    finished = store.done(out)
    todo = [c for c in cells if c.id not in finished]
    folder = runs_folder(out, runs) if spec.train else ""
    trainings = []  # (cell, its measure cells left, recorded): a run is done once recorded and measured
    for cell in spec.train:
        left = [c for c in spec.run_cells(cell, folder) if c.id not in finished]
        if cell.id not in finished or left:
            trainings.append((cell, left, cell.id in finished))
    total = len(cells) + len(spec.train)
    summary = Summary(total=total, skipped=total - len(todo) - len(trainings), runs=folder)
    start = time.perf_counter()

    def record(result: dict) -> None:
        if result["status"] == "ok":
            summary.ok += 1
        else:
            summary.failed += 1
            summary.errors[result["cell"]] = result["error"]
        summary.trained += result.get("trained") or 0
        if on_cell:
            on_cell(summary.ok + summary.failed, len(todo) + len(trainings), result)

    if local or not (todo or trainings):
        for cell, left, recorded in trainings:
            stepped = (lambda step, steps, loss, run=cell.id: on_step(run, step, steps, loss)) if on_step else None
            record(run_training(out, folder, cell, left, recorded, stepped))
        for cell in todo:
            record(run_cell(out, cell))
    else:
        import ray

        address = address or settings.passed(["RAY_ADDRESS"]).get("RAY_ADDRESS")
        env = settings.passed(PASSED_ENV)
        if not ray.is_initialized():
            # "local": always a new local Ray for this sweep, never one someone else started on the machine
            ray.init(address=address or "local", num_cpus=None if address else (workers or os.cpu_count()),
                     include_dashboard=False, log_to_driver=False, configure_logging=False,
                     runtime_env={"env_vars": env} if env else None)
        summary.startup_s = time.perf_counter() - start
        gpus = ray.cluster_resources().get("GPU", 0) > 0
        task = ray.remote(num_cpus=1, num_gpus=1 if gpus else 0, max_retries=3)(_ray_cell)
        training = ray.remote(num_cpus=1, num_gpus=1 if gpus else 0, max_retries=3)(_ray_training)
        pending = [training.remote(out, folder, cell, left, recorded, settings.active())  # the long ones first
                   for cell, left, recorded in trainings]
        pending += [task.remote(out, cell, settings.active()) for cell in todo]  # model by model (Spec.cells' order)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            record(ray.get(ready[0]))
    summary.elapsed_s = time.perf_counter() - start
    return summary
