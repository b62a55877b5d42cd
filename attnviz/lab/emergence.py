"""Emergence measures (docs/methods.md#emergence-measures): how a sink forms over training, one row per checkpoint,
layer and head, on one fixed probe.

A run folder's checkpoints (``RUN/step-N/``, :mod:`attnviz.lab.train`) or a list of model folders are read in step
order; two whose weights hash equal are refused (a hub's step branches that all serve the final weights). Each is
loaded as ``attnviz.load`` loads it (float32, its own tokenizer) and run once through the engine on the same probe (by
default a seeded batch of the run's own task), every layer recorded: the key-0 column of each map, the layer's values and the residual stream entering each layer.
From them, per layer and head: alpha at key 0 and the sink rate (Gu et al. 2025, :mod:`attnviz.stats.metrics`), the
attention on key 0 of the queries that need no attention, the value drain and the residual peak (Guo et al. 2024) and
the matrix entropy of the layer's input (:mod:`attnviz.stats.spectrum`, as the compression valley reads it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from attnviz.core.loading import models, runs
from attnviz.errors import InputError
from attnviz.lab import formation
from attnviz.stats import metrics, spectrum

PROBE_SIZE = 32  # sequences in the task's probe
PROBE_STEP = 10**9  # the task's batch index the probe is drawn at: a step no training run reaches
#: a sink has formed once the queries that need no attention put more than this share of it on the first token
#: (``first_token``; docs/findings.md#making-a-sink-which-attention-forms-one)
FORMED = 0.5
#: the table's columns, in order (docs/methods.md#emergence-measures)
COLUMNS = ("step", "layer", "head", "loss", "train_loss", "alpha0", "sink_rate", "first_token", "row_mass", "value_drain",
           "residual_peak", "entropy", *formation.COLUMNS, "kind", "arch", "hash", "seed", "checkpoint")


@dataclass(frozen=True)
class Checkpoint:
    """One model folder of a run: its step, its metadata (``attnviz_run.json``, empty where it has none)."""

    folder: Path
    step: int
    meta: dict = field(default_factory=dict, hash=False, compare=False)

    @classmethod
    def of(cls, folder, index: int = 0) -> "Checkpoint":
        """The folder as a checkpoint: its step from its name (``step-N``, as a run lists it), else from its
        metadata, else ``index``. A lab checkpoint is checked whole first (:func:`attnviz.core.loading.runs.check`):
        a damaged one is refused in one line before any is measured."""
        folder = Path(folder).expanduser()
        meta = runs.check(folder, "measure") if runs.is_checkpoint(folder) else {}
        if not (folder / "config.json").is_file():
            raise InputError(f"'{folder}' is not a model folder (no config.json in it)")
        named = re.fullmatch(r"step-(\d+)", folder.name)
        step = int(named.group(1)) if named else meta.get("step", index)
        return cls(folder, int(step), meta)

    @property
    def setup(self) -> dict:
        return self.meta.get("setup") or {}

    def get(self, name: str):
        """A field of the metadata, of its recipe or of its setup (None where none has it: older checkpoints lack
        kind and arch)."""
        for where in (self.meta, self.meta.get("recipe") or {}, self.setup):
            if where.get(name) is not None:
                return where[name]
        return None


def checkpoints(run_or_checkpoints) -> list[Checkpoint]:
    """The checkpoints of a run folder (its steps, :func:`attnviz.core.loading.runs.steps_of`), of one model folder,
    or of a list of model folders, sorted by step."""
    if isinstance(run_or_checkpoints, (str, Path)):
        run = Path(run_or_checkpoints).expanduser()
        if not run.is_dir():
            raise InputError(f"'{run}' is not a folder of checkpoints")
        if (run / "config.json").is_file():
            found = [Checkpoint.of(run)]
        else:
            found = [Checkpoint.of(run / f"step-{step}") for step in runs.steps_of(run)]
        if not found:
            raise InputError(f"no checkpoints in '{run}' (no step-N folder with {runs.RUN_FILE})")
    else:
        found = [Checkpoint.of(p, i) for i, p in enumerate(run_or_checkpoints)]
        if not found:
            raise InputError("no checkpoints given")
    steps = sorted(found, key=lambda c: c.step)
    for a, b in zip(steps, steps[1:]):
        if a.step == b.step:
            raise InputError(f"two checkpoints of step {a.step}: '{a.folder}' and '{b.folder}'")
    return steps


def weights_hash(checkpoint: Checkpoint, loaded=None, computed: bool = False) -> str:
    """The checkpoint's weights hash: its metadata's, else (or with ``computed``) computed from its weights as the
    trainer computes it (:func:`attnviz.lab.train.weights_hash`)."""
    if checkpoint.meta.get("hash") and not computed:
        return str(checkpoint.meta["hash"])
    from attnviz.lab import train

    return train.weights_hash((loaded or models.load(str(checkpoint.folder), dtype="float32")).model)


def guard(found: list[Checkpoint]) -> None:
    """Two checkpoints with equal weights are refused in one line naming both. Their metadata's hashes are compared
    where every checkpoint has one (every lab checkpoint does); else their weight files' hashes
    (:func:`attnviz.core.loading.models.folder_hash`), read without building any model, so all are compared by one
    function."""
    seen: dict[str, Checkpoint] = {}
    by_meta = all(c.meta.get("hash") for c in found)
    for checkpoint in found:
        digest = str(checkpoint.meta["hash"]) if by_meta else models.folder_hash(checkpoint.folder)
        if digest in seen:
            raise InputError(f"'{seen[digest].folder}' (step {seen[digest].step}) and '{checkpoint.folder}' (step "
                             f"{checkpoint.step}) have the same weights ({'hash' if by_meta else 'weight files hash'} "
                             f"{digest}): one checkpoint served twice")
        seen[digest] = checkpoint


@dataclass(frozen=True)
class Probe:
    """The sequences every checkpoint is measured on: ``ids`` (B, n) token ids, ``quiet`` (B, n) the queries that
    need no attention (query 0 is never counted: it has one key)."""

    ids: torch.Tensor
    quiet: torch.Tensor
    source: str = "ids"

    @classmethod
    def of(cls, ids, source: str = "ids") -> "Probe":
        """A probe of given ids, (n,) or (B, n): every query counts as needing no attention (as for text)."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        ids = ids[None] if ids.ndim == 1 else ids
        if ids.ndim != 2 or ids.shape[1] < 2:
            raise InputError(f"a probe is a (sequences, tokens) batch of at least 2 tokens, not {tuple(ids.shape)}")
        return cls(ids, torch.ones_like(ids, dtype=torch.bool), source)


def task_probe(setup: dict, size: int = PROBE_SIZE) -> Probe:
    """A run's own probe: ``size`` sequences of its task (rebuilt from the saved setup,
    :meth:`attnviz.lab.train.Setup.from_dict`), seeded and the same for every checkpoint; the queries that need no
    attention are Bigram-Backcopy's non-trigger ones (a text task's: every query, as for a text)."""
    from attnviz.lab.tasks import TASKS
    from attnviz.lab.train import Setup

    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise InputError(f"the probe's size is a whole number of at least 1, not {size!r}")
    name = (setup.get("task") or {}).get("name", "bigram-backcopy")
    if name not in TASKS:
        raise InputError(f"the run's task '{name}' has no probe here (the lab's tasks have): give a probe")
    task = Setup.from_dict(setup).task
    ids = task.batch(size, PROBE_STEP)
    if hasattr(task, "needs_attention"):  # Bigram-Backcopy's, the repeated task's
        return Probe(ids, ~task.needs_attention(ids), "task")
    return Probe.of(ids, "task")


def as_text(loaded, ids) -> str:
    """One probe sequence written as text by the checkpoint's own tokenizer, for a capture: its ids decoded (the
    tokenizer's BOS left to the tokenizer), refused in one line where the text does not encode back to them."""
    ids = [int(i) for i in ids]
    text = loaded.tokenizer.decode(ids, skip_special_tokens=True)
    again = loaded.tokenizer(text, add_special_tokens=True)["input_ids"]
    if list(again) != ids:
        raise InputError(f"'{loaded.model_id}''s tokenizer does not write its probe as a text that reads back as "
                         "the same tokens")
    return text


def text_probe(loaded, text: str, max_tokens: int | None = None) -> Probe:
    """One text as a probe, through the checkpoint's tokenizer (its first ``max_tokens`` tokens): every query
    counts."""
    if loaded.tokenizer is None:
        raise InputError(f"'{loaded.model_id}' has no tokenizer to read a text with: give token ids as the probe")
    from attnviz.tokens import tokenize

    return Probe.of(tokenize(loaded, text, max_tokens)[0], "text")


def _ratio(norms: np.ndarray) -> np.ndarray:
    """(..., n) norms → (...) the first's over the median of the others."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return norms[..., 0] / np.median(norms[..., 1:], axis=-1)


def _key0(layer, probs, allow):
    """The engine's whole-layer reduction: the key-0 column of the maps as they are, who may see key 0, and each
    row's sum (below 1 where a kind keeps mass off the keys: a sink logit, softpick; above 1 for sigmoid)."""
    column = probs[..., 0].float()
    return column.cpu().numpy(), allow[..., 0].expand_as(column).cpu().numpy(), probs.float().sum(-1).cpu().numpy()


def measure(loaded, probe: Probe, recipe="fwd", eps: float = metrics.SINK_EPS) -> list[dict]:
    """One model's rows on ``probe`` under ``recipe`` (an architecture string or a Recipe): one forward, every layer
    recorded. Per (layer, head): ``loss`` (the probe's mean next-token loss), ``alpha0``, ``sink_rate``,
    ``first_token``, ``row_mass``, ``value_drain``, ``residual_peak``, ``entropy`` (docs/methods.md#emergence-measures)."""
    from attnviz.core.engine import Feed, Record
    from attnviz.recipe import build

    eps = metrics.check_eps(eps)
    built = build(loaded, recipe).only("the emergence measures", "intervene", "kind")  # maps read as they are
    ids = probe.ids
    if int(ids.max()) >= loaded.model.get_input_embeddings().num_embeddings or int(ids.min()) < 0:
        raise InputError(f"the probe's token ids are outside '{loaded.model_id}''s vocabulary")
    logits, hidden, run = built.forward(loaded, ids, Record.every_layer(reducer=_key0, qkv=True),
                                        Feed(hidden_states=True))
    loss = float(torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1).cpu(), ids[:, 1:].flatten()))
    quiet = probe.quiet.clone().numpy()
    quiet[:, 0] = False
    rows = []
    for layer in range(loaded.n_layers):
        rows += _layer_rows(run, hidden, layer, loss, quiet, loaded.kv_groups, eps)
    run.release()
    return rows


def _layer_rows(run, hidden, layer: int, loss: float, quiet: np.ndarray, groups: list[int], eps: float) -> list[dict]:
    """One layer's rows, a head each: the key-0 column and values the run recorded, the stream entering it."""
    import warnings

    from attnviz.effects.valley import gram_spectrum

    rows = []
    with warnings.catch_warnings():  # a key 0 no later query sees (NoSink) has no alpha: NaN, not a warning
        warnings.simplefilter("ignore", RuntimeWarning)
        column, seen, mass = run.reduced[layer]  # (B, H, n) each
        alpha0 = np.stack([metrics.alpha(column[b][..., None], seen[b][..., None])[:, 0] for b in range(len(column))])
        rate = float(np.nanmean([metrics.sink_rate(a, eps) for a in alpha0]))
        values = torch.linalg.vector_norm(run.qkv[layer][2].float(), dim=-1).numpy()  # (B, H_kv, n)
        drain = _ratio(values).mean(0)  # (H_kv,)
        h = hidden[layer].float().cpu()  # the residual stream entering the layer (B, n, d)
        peak = float(_ratio(torch.linalg.vector_norm(h, dim=-1).numpy()).mean())
        entropy = float(np.nanmean([spectrum.matrix_entropy(gram_spectrum(z), z.shape[0]) for z in h]))
        for head in range(column.shape[1]):
            first, kept = column[:, head][quiet], mass[:, head][quiet]
            rows.append({"layer": layer, "head": head, "loss": loss, "alpha0": float(np.nanmean(alpha0[:, head])),
                         "sink_rate": rate, "first_token": float(first.mean()) if first.size else float("nan"),
                         "row_mass": float(kept.mean()) if kept.size else float("nan"),
                         "value_drain": float(drain[groups[head]]), "residual_peak": peak, "entropy": entropy})
    return rows


def _task_of(found: list[Checkpoint]) -> dict:
    """The setup whose task every checkpoint shares (their probe's), refused in one line where they share none."""
    tasks = {json.dumps(c.setup.get("task"), sort_keys=True) for c in found}
    if any(not c.setup.get("task") for c in found):
        raise InputError("a checkpoint without the lab's task in its metadata needs a probe (a text or token ids)")
    if len(tasks) > 1:
        raise InputError("the checkpoints come from runs of different tasks: give one probe to measure them on")
    return found[0].setup


def plan(found: list[Checkpoint], loaded, probe=None, size: int = PROBE_SIZE, budget: int | None = None):
    """The table's plan (:class:`attnviz.lab.sizing.TablePlan`) for ``found`` shaped as ``loaded`` (the first of
    them) on ``probe`` (as :func:`table` takes it), checked against the memory budget before any probe is drawn."""
    from attnviz.lab import sizing
    from attnviz.lab.train import Setup

    if isinstance(probe, str):
        rows, n = text_probe(loaded, probe).ids.shape
    elif probe is not None:
        rows, n = (probe if isinstance(probe, Probe) else Probe.of(probe)).ids.shape
    else:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InputError(f"the probe's size is a whole number of at least 1, not {size!r}")
        rows, n = size, Setup.from_dict(_task_of(found)).task.length
    return sizing.TablePlan.of(loaded, len(found), rows, n, budget).check()


def _probe_for(probe, found: list[Checkpoint], size: int):
    """The probe every checkpoint is measured on, or a text each checkpoint tokenizes (a str)."""
    if isinstance(probe, (Probe, str)):
        return probe
    if probe is not None:
        return Probe.of(probe)
    return task_probe(_task_of(found), size)


def table(run_or_checkpoints, probe=None, recipe: str | None = None, eps: float = metrics.SINK_EPS,
          size: int = PROBE_SIZE, on_step: Callable[[int, int], None] | None = None, on_plan: Callable | None = None,
          budget: int | None = None):
    """The emergence table (a pandas DataFrame, :data:`COLUMNS`): one row per (step, layer, head) of a run folder's
    checkpoints or a list of model folders, in step order, each measured on the same probe (None: ``size``
    sequences of the run's own task; a :class:`Probe`, token ids, or a text). ``recipe``: an architecture string,
    None for each checkpoint's own (its metadata's ``arch``, else fwd). Equal weights are refused before any forward
    (:func:`guard`), and so is a probe past the memory budget (:func:`plan`; ``budget``: a caller's own, in bytes),
    whose plan goes to ``on_plan`` first. ``on_step(i, total)`` after each checkpoint."""
    import pandas as pd

    eps = metrics.check_eps(eps)
    found = checkpoints(run_or_checkpoints)
    guard(found)
    loaded = models.load(str(found[0].folder), dtype="float32")
    planned = plan(found, loaded, probe, size, budget)
    if on_plan:
        on_plan(planned)
    chosen = _probe_for(probe, found, size)
    rows = []
    for i, checkpoint in enumerate(found):
        loaded = loaded if i == 0 else models.load(str(checkpoint.folder), dtype="float32")
        arch = recipe or checkpoint.get("arch") or "fwd"
        probe_here = text_probe(loaded, chosen) if isinstance(chosen, str) else chosen
        rows += checkpoint_rows(checkpoint, loaded, probe_here, arch, eps)
        loaded = None
        if on_step:
            on_step(i + 1, len(found))
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    return frame.astype({"step": "int64", "layer": "int64", "head": "int64", "seed": "Int64"})


def checkpoint_rows(checkpoint: Checkpoint, loaded, probe: Probe, recipe="fwd", eps: float = metrics.SINK_EPS,
                    arch: str | None = None) -> list[dict]:
    """One checkpoint's rows of the table (:data:`COLUMNS`), one per (layer, head): the measures on ``probe`` under
    ``recipe`` and the head classes (:func:`attnviz.lab.formation.columns`); ``arch`` the architecture column (the
    recipe's string by default). The table's and the sweep's ``emergence`` measure's one way to a row."""
    measured = measure(loaded, probe, recipe, eps)
    classes = formation.columns(loaded, probe, recipe, eps, checkpoint.setup)  # the head classes' columns
    digest = weights_hash(checkpoint, loaded)  # its metadata's, else from the model loaded here (one load)
    label = arch if arch is not None else recipe
    return [row_of(checkpoint, digest, label, loaded, {**r, **classes[r["layer"], r["head"]],
                                                       "sink_head": r["alpha0"] > eps}) for r in measured]


def row_of(checkpoint: Checkpoint, digest: str, arch: str, loaded, row: dict) -> dict:
    """A measured row with its checkpoint's step, training loss, kind (the model's own, as the engine read it in the
    forward measured: a lab checkpoint's config carries the kind it was trained with), architecture, hash, seed and
    folder."""
    from attnviz.core.spec import kinds

    train_loss = checkpoint.meta.get("loss")
    seed = checkpoint.get("seed")
    return {"step": checkpoint.step, **row,
            "train_loss": float("nan") if train_loss is None else float(train_loss),
            "kind": kinds.own(loaded.model).spec, "arch": arch, "hash": digest,
            "seed": None if seed is None else int(seed), "checkpoint": str(checkpoint.folder)}


def write(frame, path) -> Path:
    """The table as one Parquet file (pyarrow), written to a temporary name and moved: never half written."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise InputError(f"'{path}' is a folder, not a Parquet file")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    frame.to_parquet(partial, engine="pyarrow", index=False)
    partial.replace(path)
    return path
