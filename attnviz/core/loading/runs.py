"""A lab run's folder (docs/lab.md#loading), written by attnviz.lab.train: ``step-N`` checkpoints, each a Hugging
Face folder with ``attnviz_run.json`` and a tokenizer. The one place that lists a run's steps, finds one of them and
reads a checkpoint's metadata: ``attnviz.load(RUN)`` loads the run's last checkpoint, ``attnviz.load(RUN/step-N)``
that one; a step the run does not have is refused in one line naming the steps it has, and a lab checkpoint saved
without a tokenizer (before checkpoints carried one) in one line saying so. A lab checkpoint is checked whole
before it is used (:func:`check`: docs/lab.md#what-a-run-folder-holds-and-how-it-is-checked)."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

from attnviz.errors import AttnvizError, InputError

RUN_FILE = "attnviz_run.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
WEIGHTS = "model.safetensors"
#: the files of a checkpoint whose SHA-256 its record (``attnviz_run.json``'s ``sha256``) holds: what the model is
SEALED = (WEIGHTS, "config.json")
#: the setup's sizes beside the config's keys that hold them
SIZES = (("layers", "num_hidden_layers"), ("width", "hidden_size"), ("heads", "num_attention_heads"))


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
        found = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read '{path}': {str(err).splitlines()[0]}") from None
    if not isinstance(found, dict):
        raise InputError(f"'{path}' is not a JSON object: the checkpoint is damaged")
    return found


@functools.lru_cache(maxsize=256)
def _sha256(path: str, mtime_ns: int, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256(path) -> str:
    """A file's SHA-256 (hex), computed once for each version of it (its modification time and size)."""
    stat = Path(path).stat()
    return _sha256(str(path), stat.st_mtime_ns, stat.st_size)


def digests(folder) -> dict[str, str]:
    """The SHA-256 of a checkpoint's :data:`SEALED` files, as the trainer records them when it saves."""
    return {name: sha256(Path(folder) / name) for name in SEALED}


def check(folder, purpose: str = "load") -> dict:
    """A lab checkpoint's metadata, once the checkpoint is whole: its ``attnviz_run.json`` a JSON object with a step
    and a setup, its weights and config present and the very files whose SHA-256 it records (a checkpoint saved
    before it recorded them: its weights not cut short), its kind, mask and sizes the ones its config was built
    with. Else refused in one line naming the checkpoint, what is wrong and what to do (``purpose``: ``"resume"``,
    ``"measure"`` or ``"load"``); nothing is chosen in its place."""
    folder = Path(folder).expanduser()
    try:
        found = json.loads((folder / RUN_FILE).read_text())
    except (OSError, ValueError) as err:
        found, problem = {}, f"its {RUN_FILE} cannot be read ({str(err).splitlines()[0]})"
    else:
        problem = _problem(folder, found) if isinstance(found, dict) else f"its {RUN_FILE} is not a JSON object"
    if problem:
        raise damaged(folder, problem, purpose)
    return found


def damaged(folder, problem: str, purpose: str = "load") -> InputError:
    """The one-line refusal of a damaged checkpoint: which, what is wrong, and what to do for ``purpose``."""
    return InputError(f"the checkpoint {folder} is damaged: {problem}; {_advice(Path(folder), purpose)}")


def _advice(folder: Path, purpose: str) -> str:
    name, step = folder.name, re.fullmatch(r"step-(\d+)", folder.name)
    steps = steps_of(folder.parent) if step else []
    before = [s for s in steps if s < int(step.group(1))] if step else []
    later = [s for s in steps if s > int(step.group(1))] if step else []
    if purpose == "measure":
        return f"move {name} aside to measure the run without it"
    if not before:
        return f"move {name} aside and train the run again"
    if purpose == "resume" or not later:
        verb = "resume from" if purpose == "resume" else "use the run up to"
        return f"move {name} aside to {verb} step-{before[-1]}"
    return f"load another of its steps, or move {name} aside"


def _problem(folder: Path, found: dict) -> str | None:
    """What is wrong with the checkpoint ``folder`` whose record is ``found`` (None: nothing)."""
    if not isinstance(found.get("setup"), dict):
        return f"its {RUN_FILE} has no setup"
    if not isinstance(found.get("step"), int) or isinstance(found.get("step"), bool):
        return f"its {RUN_FILE} has no step"
    for name in SEALED:
        if not (folder / name).is_file():
            return f"its {name} is missing"
    sealed = found.get("sha256")
    if sealed is not None:
        changed = [n for n in SEALED if not isinstance(sealed, dict) or sealed.get(n) != sha256(folder / n)]
        if changed:
            return (f"its {changed[0]} is not the file its {RUN_FILE} records (another SHA-256: changed or cut short "
                    "since it was saved)")
    elif _cut_short(folder / WEIGHTS):
        return f"its {WEIGHTS} is cut short or is no safetensors file"
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "its config.json cannot be read"
    return _unlike(found, config if isinstance(config, dict) else {})


def _cut_short(path: Path) -> bool:
    """Whether a safetensors file is shorter than its header says (or has no header)."""
    size = path.stat().st_size
    try:
        with path.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if size < 8 + length:
                return True
            header = json.loads(handle.read(length))
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return True
    return size < 8 + length + end


def _unlike(found: dict, config: dict) -> str | None:
    """Where the record ``found`` says another kind, mask or size than the checkpoint's ``config`` was built with."""
    from attnviz.core.spec import kinds

    setup, recipe = found["setup"], found.get("recipe") if isinstance(found.get("recipe"), dict) else {}
    for key in ("kind", "arch"):
        said = {str(v) for v in (setup.get(key), recipe.get(key)) if v is not None}
        if len(said) > 1:
            return f"its {RUN_FILE} names two {key}s, {' and '.join(sorted(said))}"
    kind = setup.get("kind") or recipe.get("kind")
    if kind is not None:
        try:
            parsed = kinds.parse(kind)
            family = parsed.trained_as()
        except AttnvizError:
            return f"its {RUN_FILE}'s kind {kind!r} is no kind the lab trains"
        built = kinds.own(SimpleNamespace(**config))
        if config.get("model_type") != family or (family == "llama" and built.spec != parsed.spec):
            return f"its {RUN_FILE} says kind {parsed.spec}, but its weights were trained as {built.spec} (config.json)"
    arch = setup.get("arch") or recipe.get("arch")
    if arch is not None and config.get("attnviz_arch") not in (None, arch):
        return f"its {RUN_FILE} says mask {arch}, but its weights were trained under {config['attnviz_arch']}"
    for key, held in SIZES:
        if setup.get(key) is not None and config.get(held) not in (None, setup[key]):
            return f"its {RUN_FILE} says {key} {setup[key]}, but its weights have {config[held]}"
    return None


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
    if is_checkpoint(path):
        check(path)
    if is_checkpoint(path) and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise InputError(f"the lab checkpoint '{name}' has no tokenizer (saved before checkpoints carried one): "
                         "train the run again to load it")
    return path
