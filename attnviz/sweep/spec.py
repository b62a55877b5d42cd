"""A sweep's spec (TOML, read with the stdlib's ``tomllib``) and the grid of cells it names.

```toml
models = ["default"]                 # required: 'default', Hugging Face ids or local directories
archs = ["fwd", "nosink-fwd"]        # default ["fwd"]
interventions = ["", "sinkscale(beta=0.3)@20-29"]   # default [""]: none (sinks and eval only)
corpora = ["stdlib"]                 # default ["stdlib"]: "stdlib", "stdlib:TOPIC" or "file:PATH"
[measures.sinks]                     # at least one measure, each with its options (all optional)
samples = 4
max_len = 32
```

A ``[train]`` table (or several, ``[[train]]``) adds training cells (:mod:`.train`): ``models`` may then be left out,
and the measures default to ``[measures.emergence]``.

The grid is the product models × archs × interventions × corpora × measures; a measure that takes no
intervention (embed, compress, heads) runs once per (model, arch, corpus). Every key is checked
before anything runs: an unknown key, measure or option, a value of the wrong type, an architecture
or intervention that does not parse, an unknown corpus and an empty grid are refused naming the key.
"""

from __future__ import annotations

import functools
import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from attnviz.errors import AttnvizError, InputError

#: Syntax checks before any model is loaded: a layer count no model reaches (a k past the real
#: model's layers fails in its own cells, recorded with the reason).
ANY_LAYERS = ANY_HEADS = 4096

@functools.cache
def measure_options() -> dict[str, dict[str, tuple[type | tuple[type, ...], object]]]:
    """measure -> {option: (type, default)}: each default read from the library function the measure
    calls (:mod:`attnviz.defaults`), the same the CLI's options and the app's widgets read."""
    from attnviz.defaults import of
    from attnviz import flow
    from attnviz.effects import causal, dataset, embedding, evaluate, explain, heads
    from attnviz.effects import paths
    from attnviz.kv import compress
    from attnviz.lab import emergence

    run, report = of(dataset.sinks), of(dataset.DatasetSinks.as_json)
    ev, probe, kv = of(evaluate.evaluate), of(embedding.probe), of(compress.compress)
    tax, texts = of(heads.taxonomy), of(heads.dataset_texts)
    return {
        "sinks": {"samples": (int, run["n_samples"]), "max_len": (int, run["max_len"]), "eps": (float, report["eps"]),
                  "unit": (str, run["unit"]), "key": ((int, str), report["key"])},
        "eval": {"window": (int, ev["window"]), "max_tokens": (int, ev["max_tokens"])},
        "embed": {"m": (int, probe["m"]), "max_docs": (int, probe["max_docs"])},
        "compress": {"presses": (list, None), "ratios": (list, list(kv["ratios"])), "context": (int, kv["context"]),
                     "max_tokens": (int, compress.MAX_TOKENS)},
        "heads": {"samples": (int, texts["samples"]), "max_len": (int, texts["max_len"]), "eps": (float, tax["eps"]),
                  "tau_stream": (float, tax["tau_stream"]), "tau_inactive": (float, tax["tau_inactive"]),
                  "sink": (int, tax["s"]), "window": (int, tax["w"])},
        "explain": {"max_tokens": (int, explain.DIAGNOSIS_TOKENS)},
        "causal": {"max_tokens": (int, explain.DIAGNOSIS_TOKENS), "value": (str, of(causal.check)["value"])},
        "routes": {"max_tokens": (int, explain.DIAGNOSIS_TOKENS), "threshold": (float, of(flow.routes)["threshold"])},
        "valley": {"max_tokens": (int, explain.DIAGNOSIS_TOKENS), "eps": (float, report["eps"])},
        "paths": {"max_tokens": (int, explain.DIAGNOSIS_TOKENS), "senders": (str, ""),
                  "receivers": (str, "groups"), "value": (str, of(paths.paths)["value"])},
        "emergence": {"samples": (int, of(emergence.table)["size"]), "eps": (float, of(emergence.table)["eps"]),
                      "max_tokens": (int, explain.DIAGNOSIS_TOKENS)},
    }


#: measures whose library call takes an intervention (docs/methods.md#interventions)
INTERVENES = {"sinks", "eval", "explain", "causal", "routes", "valley", "paths", "emergence"}
TOP_KEYS = {"models", "archs", "interventions", "corpora", "measures", "train"}
#: The example of docs/sweeps.md: the sink-rate table of two architectures (the Sweeps page starts from it).
EXAMPLE = """models = ["default"]
archs = ["fwd", "nosink-fwd"]
corpora = ["stdlib"]
[measures.sinks]
samples = 4
max_len = 32
"""


@dataclass(frozen=True)
class Cell:
    """One task of the grid; ``id`` names its result file."""
    measure: str
    model: str
    arch: str
    intervention: str
    corpus: str
    options: dict = field(hash=False, compare=False)
    #: a trained run's cell (:meth:`.train.TrainCell.info`: its run, step, named keys and setup); empty for a model's
    train: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def params(self) -> dict:
        return {"measure": self.measure, "model": self.model, "arch": self.arch, "intervention": self.intervention,
                "corpus": self.corpus, "options": self.options}

    @property
    def id(self) -> str:
        """A hash of the parameters; a trained run's cells are named by their run and step instead of the folder the
        runs are in (``<run>`` records the run itself, ``<run>-step<N>-<hash>`` a measure of a checkpoint)."""
        if not self.train:
            return hashlib.sha1(json.dumps(self.params, sort_keys=True).encode()).hexdigest()[:16]
        if self.measure == "train":
            return self.train["run"]
        step = self.train["step"]
        params = {**self.params, "model": f"{self.train['run']}/step-{step}"}
        return f"{self.train['run']}-step{step}-{hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:8]}"


@dataclass
class Spec:
    models: list[str]
    archs: list[str]
    interventions: list[str]
    corpora: list[str]
    measures: dict[str, dict]
    train: list = field(default_factory=list)  # the training cells (:class:`.train.TrainCell`), [train]'s grid

    def cells(self) -> list[Cell]:
        """The models' grid, model by model (a worker then loads each model once for its run of cells); the
        training cells' measures are :func:`.train.measure_cells`."""
        out = []
        for model in self.models:
            for measure, options in self.measures.items():
                acts = self.interventions if measure in INTERVENES else [""]
                for arch in self.archs:
                    for act in dict.fromkeys(acts):
                        for corpus in self.corpora:
                            out.append(Cell(measure, model, arch, act, corpus, options))
        return out

    def run_cells(self, run, runs: str) -> list[Cell]:
        """The measure cells of one training cell ``run`` (:class:`.train.TrainCell`) whose run is in the folder
        ``runs``: each checkpoint (:meth:`~attnviz.lab.train.Setup.checkpoints`, known before it is trained) ×
        measure (× intervention where the measure takes one) × corpus, under the run's own mask."""
        out = []
        for step in run.setup.checkpoints():
            for measure, options in self.measures.items():
                for act in dict.fromkeys(self.interventions if measure in INTERVENES else [""]):
                    for corpus in self.corpora:
                        out.append(Cell(measure, f"{runs}/{run.id}/step-{step}", run.setup.arch, act, corpus, options,
                                        train=run.info(step)))
        return out


def run_marker(run, runs: str) -> Cell:
    """The cell that records a trained run itself (``train/<run id>.parquet``: its last step, loss and hash; a failed
    run's error), written once the run is trained."""
    return Cell("train", f"{runs}/{run.id}", run.setup.arch, "", "", {}, train=run.info())


def _strings(raw: dict, key: str, default: list[str] | None) -> list[str]:
    value = raw.get(key, default)
    if value is None:
        raise InputError(f"spec: '{key}' is required (a list of strings)")
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InputError(f"spec: '{key}' must be a list of strings, got {value!r}")
    return list(dict.fromkeys(v.strip() for v in value))


def _option(measure: str, name: str, value, expected: type):
    where = f"measures.{measure}.{name}"
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if expected is list:
        if not isinstance(value, list):
            raise InputError(f"spec: '{where}' must be a list, got {value!r}")
        return value
    if not isinstance(value, expected) or isinstance(value, bool):
        names = " or ".join(k.__name__ for k in (expected if isinstance(expected, tuple) else (expected,)))
        raise InputError(f"spec: '{where}' must be {names}, got {value!r}")
    if isinstance(value, (int, float)) and value < 0:
        raise InputError(f"spec: '{where}' must be >= 0, got {value}")
    return value


def _check_corpus(name: str) -> None:
    from attnviz import corpus

    if name.startswith("file:"):
        path = Path(name[5:]).expanduser()
        if not path.is_file():
            raise InputError(f"spec: corpora: the file '{path}' does not exist")
        return
    if name == "stdlib":
        return
    if name.startswith("stdlib:"):
        if name[7:] not in corpus.stdlib_topics():
            raise InputError(f"spec: corpora: no stdlib topic '{name[7:]}'")
        return
    raise InputError(f"spec: corpora: unknown corpus '{name}' (stdlib, stdlib:TOPIC or file:PATH)")


def checkpoint_models(models: list[str]) -> list[str]:
    """The models with each run folder among them as its checkpoints, in step order (docs/sweeps.md#checkpoints);
    two checkpoints of equal weights, of one run or of several, are refused in one line, and so are two Hub
    revisions (``id@revision``) that serve the same weight files."""
    from attnviz.core.loading import models as models_mod
    from attnviz.core.loading import runs
    from attnviz.lab import emergence

    out, found = [], {}
    for model in models:
        try:
            listed = (emergence.checkpoints(model) if runs.steps_of(model)
                      else [emergence.Checkpoint.of(model)] if runs.is_checkpoint(model) else [])
            found.update({c.folder.resolve(): c for c in listed})
        except AttnvizError as err:
            raise InputError(f"spec: models: '{model}': {err}") from None
        out += [str(c.folder.resolve()) for c in listed] if listed else [model]
    try:
        emergence.guard(list(found.values()))
    except AttnvizError as err:
        raise InputError(f"spec: models: {err}") from None
    served: dict[str, str] = {}
    for model in dict.fromkeys(out):
        if "@" not in model:
            continue
        try:
            if models_mod.local_directory(model) is not None:  # a local folder whose name has an @
                continue
            digest = models_mod.revision_hash(model)  # a Hub revision
        except AttnvizError as err:
            raise InputError(f"spec: models: {err}") from None
        if digest in served:
            raise InputError(f"spec: models: '{served[digest]}' and '{model}' serve the same weights (hash "
                             f"{digest}): a revision that serves another's weights, as hub step branches may")
        served[digest] = model
    return list(dict.fromkeys(out))


def parse(text: str) -> Spec:
    """A spec from TOML text, every key checked (see the module docstring)."""
    from attnviz.core.spec import arch as arch_mod
    from attnviz.core.spec import interventions as interventions_mod

    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise InputError(f"spec: not valid TOML: {err}") from None
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        raise InputError(f"spec: unknown key '{unknown[0]}' (expected {', '.join(sorted(TOP_KEYS))})")
    trained = []
    if "train" in raw:
        from attnviz.sweep import train

        trained = train.parse(raw["train"])
        if "archs" in raw and "models" not in raw:
            raise InputError("spec: 'archs' are the models' architectures: a trained run is measured under its own "
                             "mask (train.arch)")
    models = checkpoint_models(_strings(raw, "models", [] if trained else None))
    archs = _strings(raw, "archs", ["fwd"])
    acts = _strings(raw, "interventions", [""])
    corpora = _strings(raw, "corpora", ["stdlib"])
    for key, values in (("models", models), ("archs", archs), ("corpora", corpora)):
        if key == "models" and trained and "models" not in raw:
            continue
        if not values or any(not v for v in values):
            raise InputError(f"spec: '{key}' is empty: the grid has no cell")
    for a in archs:
        try:
            arch_mod.parse(a, ANY_LAYERS)
        except AttnvizError as err:
            raise InputError(f"spec: archs: '{a}': {err}") from None
    for act in acts:
        if act:
            try:
                interventions_mod.parse(act, ANY_LAYERS, ANY_HEADS)
            except AttnvizError as err:
                raise InputError(f"spec: interventions: '{act}': {err}") from None
    for c in corpora:
        _check_corpus(c)
    measures_raw = raw.get("measures", {"emergence": {}} if trained else None)
    if not isinstance(measures_raw, dict) or not measures_raw:
        raise InputError("spec: 'measures' is empty: name at least one, e.g. [measures.sinks]")
    measures = {}
    for name, options in measures_raw.items():
        if name not in measure_options():
            raise InputError(f"spec: unknown measure 'measures.{name}' (expected {', '.join(measure_options())})")
        if not isinstance(options, dict):
            raise InputError(f"spec: 'measures.{name}' must be a table of options")
        known = measure_options()[name]
        for option in options:
            if option not in known:
                raise InputError(f"spec: unknown option 'measures.{name}.{option}' (expected {', '.join(known)})")
        measures[name] = {option: (_option(name, option, options[option], expected) if option in options else default)
                          for option, (expected, default) in known.items()}
    if "sinks" in measures and measures["sinks"]["unit"] not in ("doc", "line"):
        raise InputError("spec: 'measures.sinks.unit' must be 'doc' or 'line'")
    if "sinks" in measures and isinstance(measures["sinks"]["key"], str) and measures["sinks"]["key"] != "auto":
        raise InputError("spec: 'measures.sinks.key' must be a token position or 'auto'")
    return Spec(models, archs, acts, corpora, measures, trained)


def load(path: str | Path) -> Spec:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise InputError(f"cannot read the spec '{path}': {err.strerror}") from None
    return parse(text)
