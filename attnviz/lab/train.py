"""Training a small decoder from scratch under any mask and attention kind (docs/lab.md): a stock transformers model
of the kind's family (:mod:`attnviz.lab.models`) built from a config, every training forward through the recipe
(:func:`attnviz.recipe.build`, the mask and the kind applied, the autograd graph kept), next-token cross entropy,
AdamW, Adam or SGD with momentum (:data:`OPTIMIZERS`, docs/lab.md#optimizers) with warm-up, fixed seeds, and
checkpoints as Hugging Face folders (safetensors, config, tokenizer, optimizer state and ``attnviz_run.json``: the
run's recipe, step, loss, a hash of the weights and the setup) every K steps, log-spaced early. A run resumes from
its last checkpoint and ends bit-identical to an unbroken one.

The defaults are the configuration that made a sink within four minutes of one CPU core: one layer, attention only
(the MLP's weights zero and frozen), four heads of 16, Bigram-Backcopy with 64 tokens, 3 triggers and 64 positions,
batches of 32, AdamW at 3e-3 with weight decay 0.01, softmax under the causal mask.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pickle
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from attnviz.errors import Diverged, InputError
from attnviz.lab import card, fields, models
from attnviz.core.loading import runs
from attnviz.core.loading.runs import last  # noqa: F401 - a run's last checkpoint, read by its callers
from attnviz.lab import tasks
from attnviz.lab.tasks import BigramBackcopy

RESUMABLE = ("steps", "device")  # what a resumed run may change
#: the optimizers a run takes (docs/lab.md#optimizers), each from the setup and the trained parameters: AdamW's weight
#: decay decoupled (Loshchilov & Hutter 2019), Adam without one (Kingma & Ba 2015), SGD's as an L2 term in its gradient
OPTIMIZERS = {
    "adamw": lambda setup, params: torch.optim.AdamW(params, lr=setup.lr, weight_decay=setup.weight_decay),
    "adam": lambda setup, params: torch.optim.Adam(params, lr=setup.lr),
    "sgd": lambda setup, params: torch.optim.SGD(params, lr=setup.lr, momentum=setup.momentum,
                                                 weight_decay=setup.weight_decay),
}
SEEDS = fields.SEED_MAX + 1  # seeds are 0 to SEEDS - 1, the ones torch's generators take (lab/fields.py)
WEIGHT_DECAY = {"adamw": 0.01, "adam": 0.0, "sgd": 0.01}  # each optimizer's weight decay when none is given
MOMENTUM = 0.9  # SGD's when none is given
PARTIAL = ".attnviz-partial"  # the mark of a partial checkpoint folder the trainer made (and may remove)


@dataclass(frozen=True)
class Setup:
    layers: int = 1
    width: int = 64
    heads: int = 4
    mlp: bool = False
    kind: str = "softmax"  # docs/methods.md#attention-kinds, the call syntax
    arch: str = "fwd"  # the mask, the call syntax of docs/methods.md
    positions: str = "rope"  # the only one: docs/lab.md#positions
    steps: int = 4000
    batch: int = 32
    lr: float = 3e-3
    weight_decay: float | None = None  # None: the optimizer's (WEIGHT_DECAY); adam takes none
    optimizer: str = "adamw"  # OPTIMIZERS
    momentum: float | None = None  # SGD's (None: MOMENTUM); the others take none
    warmup: int = 100
    seed: int = 0
    every: int = 500  # a checkpoint every this many steps, and log-spaced before (1, 2, 4, ...)
    task: object = field(default_factory=BigramBackcopy)  # one of tasks.TASKS
    device: str | None = None  # "cpu", "cuda", None: a GPU when there is one

    def __post_init__(self):
        """Every field checked in one place (:mod:`attnviz.lab.fields`, docs/lab.md#fields-checked), each refused in
        one line: whole numbers (never a bool), finite numbers in range, a seed a generator takes, switches that are
        bools, names from their registries."""
        for name in ("layers", "width", "heads", "steps", "batch", "every"):
            fields.whole(name, getattr(self, name))
        fields.whole("the warm-up", self.warmup, 0)
        fields.seed("the seed", self.seed)
        fields.switch("mlp", self.mlp)
        fields.number("the learning rate", self.lr, above=0)
        for name, what in (("kind", "the kind"), ("arch", "the mask (arch)"), ("positions", "positions")):
            fields.name(what, getattr(self, name))
        if self.width % self.heads:
            raise InputError(f"the width {self.width} is not a multiple of the {self.heads} heads")
        self._optimizer_fields()
        if type(self.task) not in tasks.TASKS.values():
            raise InputError(f"the task is one of {', '.join(tasks.TASKS)}, not {type(self.task).__name__}")
        if self.device not in (None, "cpu", "cuda"):
            raise InputError(f"the device is cpu, cuda or None (a GPU when there is one), not {self.device!r}")
        object.__setattr__(self, "kind", models.check(self.kind, self.arch, self.layers, self.positions))

    def _optimizer_fields(self) -> None:
        """The optimizer's weight decay and momentum made explicit (so a saved setup says them), or refused in one
        line: an unknown optimizer, a weight decay with adam, a momentum with another optimizer than sgd."""
        fields.name("the optimizer", self.optimizer, tuple(OPTIMIZERS))
        if self.weight_decay is None:
            object.__setattr__(self, "weight_decay", WEIGHT_DECAY[self.optimizer])
        fields.number("the weight decay", self.weight_decay, least=0)
        if self.optimizer == "adam" and self.weight_decay:
            raise InputError(f"adam takes no weight decay (given {self.weight_decay:g}): use adamw for a decoupled "
                             "one, or leave it out")
        if self.optimizer != "sgd" and self.momentum is not None:
            raise InputError(f"the momentum is SGD's: {self.optimizer} takes none (given {self.momentum!r})")
        if self.optimizer == "sgd":
            momentum = MOMENTUM if self.momentum is None else self.momentum
            object.__setattr__(self, "momentum", fields.number("SGD's momentum", momentum, least=0, below=1))

    def checkpoints(self) -> list[int]:
        """The steps a checkpoint is saved at: 0, powers of two below ``every``, then every ``every``, the last."""
        early = [0] + [2**k for k in range(int(math.log2(max(self.every, 1))) + 1) if 2**k < self.every]
        return sorted(set(early + list(range(self.every, self.steps + 1, self.every)) + [self.steps]))

    def as_dict(self) -> dict:
        data = asdict(self)
        data["task"] = {"name": self.task.name, **asdict(self.task)}
        return data

    @classmethod
    def from_dict(cls, saved: dict) -> "Setup":
        """The setup a checkpoint saved (:meth:`as_dict`, ``attnviz_run.json``'s ``setup``), its task rebuilt by its
        name (Bigram-Backcopy where it has none); fields it does not know are left out, those it lacks take their
        defaults (an older checkpoint's). The one way a saved setup is read back: resuming, the page, the probe."""
        if not isinstance(saved, dict):
            raise InputError(f"a saved setup is a dict of its fields, not a {type(saved).__name__}")
        given = {k: v for k, v in saved.items() if k in _known(cls)}
        task = given.get("task") or {}
        if not isinstance(task, dict):
            raise InputError(f"a saved setup's task is a dict with its name and fields, not {task!r}")
        task = dict(task)
        made = tasks.named(task.pop("name", BigramBackcopy.name))
        given["task"] = made(**{k: v for k, v in task.items() if k in _known(made)})
        return cls(**given)

    @property
    def vocab(self) -> int:
        return self.task.vocab

    def tokenizer(self):
        return self.task.tokenizer_object()


def _known(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def build(setup: Setup):
    """A new model of ``setup`` (its kind's family), seeded."""
    return models.build(setup, setup.vocab)


def weights_hash(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def save(model, optimizer, setup: Setup, step: int, loss: float, out: Path, tokenizer=None) -> Path:
    """Write a checkpoint into a partial folder, marked as the trainer's (:data:`PARTIAL`) before anything else is
    written in it, and rename it into place (the mark then removed): a checkpoint is whole or absent. Its record
    holds the SHA-256 of its weights and config (``sha256``, checked whenever it is read back). Any OSError (a full
    disk) removes the partial folder and is refused in one line; earlier checkpoints stay. A partial folder of that
    name the trainer did not make is refused, never removed
    (docs/lab.md#what-a-run-folder-holds-and-how-it-is-checked)."""
    folder = out / f"step-{step}"
    tmp = out / f".step-{step}.partial"
    _clear(tmp)
    try:
        tmp.mkdir()
        (tmp / PARTIAL).touch()
        model.save_pretrained(tmp, safe_serialization=True)
        card.write(tmp, model, setup, step, loss)  # the kind's attention implementation, README.md
        (tokenizer or setup.tokenizer()).save_pretrained(tmp)
        torch.save({"optimizer": optimizer.state_dict()}, tmp / "optimizer.pt")
        meta = {"recipe": {"kind": setup.kind, "arch": setup.arch}, "step": step,
                "loss": loss if math.isfinite(loss) else None, "hash": weights_hash(model),
                "sha256": runs.digests(tmp), "setup": setup.as_dict()}
        (tmp / runs.RUN_FILE).write_text(json.dumps(meta, indent=1))
        tmp.rename(folder)
        (folder / PARTIAL).unlink()  # after the rename: a partial folder is never without its mark
    except OSError as err:
        _clear(tmp, refuse=False)
        raise InputError(f"cannot save the checkpoint {folder}: {err.strerror or err}; the earlier checkpoints in "
                         f"{out} are kept") from None
    except BaseException:  # Ctrl-C while saving: no half checkpoint
        _clear(tmp, refuse=False)
        raise
    return folder


def _clear(tmp: Path, refuse: bool = True) -> None:
    """Remove the partial folder ``tmp`` where it is the trainer's (marked :data:`PARTIAL`, or empty); one it did not
    make is refused in one line (``refuse``) or left as it is."""
    if (tmp / PARTIAL).is_file():
        shutil.rmtree(tmp, ignore_errors=True)
    elif tmp.is_dir() and not any(tmp.iterdir()):
        tmp.rmdir()
    elif tmp.exists() and refuse:
        raise InputError(f"{tmp} is not the trainer's (it lacks its {PARTIAL} mark) and the run writes a checkpoint "
                         "through it: move it out of the run's folder")


def _check_same(setup: Setup, found: Path) -> int:
    """The step of checkpoint ``found``, checked whole (:func:`attnviz.core.loading.runs.check`); refused in one
    line when its saved setup differs from ``setup``."""
    meta = runs.check(found, "resume")
    saved, given = Setup.from_dict(meta["setup"]).as_dict(), setup.as_dict()
    differ = [k for k in sorted(set(saved) | set(given)) if k not in RESUMABLE and saved.get(k) != given.get(k)]
    if differ:
        k = differ[0]
        raise InputError(f"{found.parent} holds a run with {k} {saved.get(k)!r}, not {given.get(k)!r}: give the "
                         "same setup to resume it (only the steps may grow), or another folder")
    if meta["step"] > setup.steps:
        raise InputError(f"{found.parent} is already at step {meta['step']}, past the {setup.steps} steps asked")
    return int(meta["step"])


def _in_the_way(setup: Setup, out: Path, found: Path | None, start: int) -> None:
    """Before anything is written: a ``step-N`` the run will write that is there without its record (a checkpoint
    cut short, or not the trainer's), or a partial folder the run writes through that the trainer did not make, is
    refused in one line; the trainer's own partial folders (left by a killed process) are removed, others left."""
    if not out.is_dir():
        return
    ahead = {s for s in setup.checkpoints() if s > start or found is None}
    then = f"resume from {found.name}" if found else "train the run from step 0"
    for step in sorted(ahead):
        if (out / f"step-{step}").exists():
            raise InputError(f"{out / f'step-{step}'} holds no {runs.RUN_FILE} (a checkpoint cut short, or not the "
                             f"trainer's) and the run writes its step {step} there: move it aside to {then}")
    for tmp in out.glob(".step-*.partial"):
        number = tmp.name[len(".step-"):-len(".partial")]
        _clear(tmp, refuse=number.isdigit() and int(number) in ahead)


def _optimizer_state(found: Path, device) -> dict:
    """The optimizer's state a checkpoint saved; a file missing or cut short is refused in one line."""
    path = found / "optimizer.pt"
    try:
        return torch.load(path, map_location=device)["optimizer"]
    except (OSError, RuntimeError, EOFError, KeyError, TypeError, ValueError, pickle.UnpicklingError):
        what = "is missing" if not path.is_file() else "cannot be read (cut short, or changed since it was saved)"
        raise runs.damaged(found, f"its optimizer.pt {what}", "resume") from None


def _diverged(step: int, loss: float, kept: Path) -> Diverged:
    what = f"its loss is {loss}" if not math.isfinite(loss) else "its weights are no longer finite"
    return Diverged(f"the run diverged at step {step} ({what}): the checkpoints up to {kept.name}, each finite, are "
                    f"kept in {kept.parent}; train it again with a lower learning rate in another folder", step, kept)


def run_folder(out) -> Path:
    """``out`` as a run's folder, refused in one line before anything is written where it cannot be one: empty, an
    existing file, a model folder (a checkpoint), or under a file
    (docs/lab.md#inputs-checked-before-anything-is-written)."""
    if out is None or not str(out).strip():
        raise InputError("the run's folder is empty: name a folder for its checkpoints")
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise InputError(f"'{out}' is a file, not a folder: name a folder for the run's checkpoints")
    if (out / "config.json").is_file():
        raise InputError(f"'{out}' is a model folder (a checkpoint), not a run's folder: give its run ('{out.parent}') "
                         "to resume it, or a new folder")
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise InputError(f"'{out}' is under '{above}', which is a file, not a folder")
    return out


def device_of(setup: Setup) -> torch.device:
    if setup.device == "cuda" and not torch.cuda.is_available():
        raise InputError("the device cuda was asked for, but this machine has no CUDA GPU")
    return torch.device(setup.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def loss_of(built, loaded, x: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of ``x`` under the built recipe (its mask and kind), the graph kept."""
    from attnviz.core import engine

    logits = built.forward(loaded, x, feed=engine.Feed(grad=True))[0]
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def optimizer_of(setup: Setup, model, state: dict | None = None, start: int = 0):
    """The setup's optimizer over the model's trained parameters (with a resumed run's ``state``) and its linear
    warm-up, step s (from 1) at lr · min(1, s / warmup), standing at step ``start``: what :func:`train` steps and
    bench/lab_step.py times."""
    optimizer = OPTIMIZERS[setup.optimizer](setup, [p for p in model.parameters() if p.requires_grad])
    if state is not None:
        optimizer.load_state_dict(state)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / setup.warmup) if setup.warmup else 1.0, last_epoch=start - 1)
    return optimizer, schedule


def one_step(built, loaded, optimizer, schedule, x: torch.Tensor) -> torch.Tensor:
    """One training step on the batch ``x``: the loss through the recipe (:func:`loss_of`), its gradients, the
    optimizer's and the schedule's step. Returns the loss, detached, on the device (bench/lab_step.py times it)."""
    loss = loss_of(built, loaded, x)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    schedule.step()
    return loss.detach()


def train(setup: Setup, out, on_step: Callable[[int, int, float], None] | None = None) -> Path:
    """Train ``setup`` into ``out`` (resuming from its last checkpoint); returns the last checkpoint's folder.
    Refused in one line before anything is written (a setup refuses its own fields when it is made, lab/fields.py): a
    damaged last checkpoint, a folder in the way of a checkpoint the run writes (:func:`_in_the_way`). A loss or
    weights that stop being finite stop the run (:class:`~attnviz.errors.Diverged`): no checkpoint after the last
    finite one is written. Ctrl-C (KeyboardInterrupt) propagates with every checkpoint saved so far kept whole."""
    from attnviz import recipe
    from attnviz.core.engine import prepare
    from attnviz.core.loading.models import LoadedModel

    out = run_folder(out)
    fields.sized(setup.task, setup.batch)  # a batch past the memory budget refused before anything is made
    device = device_of(setup)
    found = last(out) if out.is_dir() else None
    start = _check_same(setup, found) if found else 0
    if found and start == setup.steps:
        return found
    state = _optimizer_state(found, device) if found else None
    _in_the_way(setup, out, found, start)
    tokenizer = setup.tokenizer()
    setup.task.batch(1, start + 1)  # the task can make its batches (a text file read, long enough) before any write
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"cannot make the run folder '{out}': {err.strerror or err}") from None
    model = (models.load(setup, found) if found else build(setup)).to(device)
    prepare(model)
    loaded = LoadedModel(model, tokenizer, str(out), None, 0.0)
    built = recipe.build(loaded, setup.arch)
    optimizer, schedule = optimizer_of(setup, model, state, start)
    saved = set(setup.checkpoints())
    model.train()
    if start == 0:
        found = save(model, optimizer, setup, 0, float("nan"), out, tokenizer)
    for step in range(start + 1, setup.steps + 1):
        x = setup.task.batch(setup.batch, step).to(device)
        loss = float(one_step(built, loaded, optimizer, schedule, x))
        if not math.isfinite(loss) or (step in saved and not all(p.isfinite().all() for p in model.parameters())):
            raise _diverged(step, loss, found)
        if step in saved:
            found = save(model, optimizer, setup, step, loss, out, tokenizer)
        if on_step:
            on_step(step, setup.steps, loss)
    return found
