"""What one cell computes: the same library calls as the CLI's commands, as table rows.

Each measure returns a list of rows (dicts of plain values); a measure with layers gives one row per
layer. The driver adds the cell's parameters, versions and timing (:mod:`.store`).
"""

from __future__ import annotations

from attnviz import corpus as corpus_mod
from attnviz.core.loading.models import LoadedModel
from attnviz.sweep.spec import Cell


def documents(name: str) -> corpus_mod.Corpus:
    """A spec's corpus name: "stdlib", "stdlib:TOPIC" or "file:PATH"."""
    if name.startswith("file:"):
        return corpus_mod.load(None, name[5:])
    return corpus_mod.load(name)


def recipe(lm: LoadedModel, cell: Cell):
    """The cell's recipe: its architecture and intervention on the loaded model."""
    from attnviz.recipe import Recipe

    return Recipe.of(lm, cell.arch, cell.intervention or None)


def sinks(lm: LoadedModel, cell: Cell) -> list[dict]:
    """Sink rates over a dataset, docs/methods.md#sink-rate (``attnviz sinks --corpus C --max-len T --samples S
    --eps E --key K``); each row says the key it was read at."""
    from attnviz.effects import dataset

    o = cell.options
    result = dataset.sinks(lm, documents(cell.corpus).documents, recipe(lm, cell), unit=o["unit"],
                           max_len=o["max_len"], n_samples=o["samples"])
    doc = result.as_json(o["key"], o["eps"])
    model = doc["model_rate"]
    rows = []
    for layer in doc["layers"]:
        rate = layer["sink_rate"]
        rows.append({"layer": layer["layer"], "mask": layer["mask"], "key": layer["key"], "sink_rate": rate["mean"],
                     "ci_low": (rate["ci95"] or [None, None])[0], "ci_high": (rate["ci95"] or [None, None])[1],
                     "n": rate["n"], "model_rate": model["mean"], "model_ci_low": (model["ci95"] or [None, None])[0],
                     "model_ci_high": (model["ci95"] or [None, None])[1], "samples": doc["samples"]})
    return rows


def evaluate(lm: LoadedModel, cell: Cell) -> list[dict]:
    """Perplexity and accuracy, docs/methods.md#perplexity (``attnviz eval --window W --max-tokens N``)."""
    from attnviz.effects.evaluate import evaluate as run
    from attnviz.effects.evaluate import token_ids

    o = cell.options
    ids = token_ids(lm, documents(cell.corpus).text, o["max_tokens"])
    result = run(lm, ids, recipe(lm, cell), window=o["window"])
    doc = result.as_json()
    return [{k: doc[k] for k in ("perplexity", "accuracy", "nll", "tokens", "windows")}]


def embed(lm: LoadedModel, cell: Cell) -> list[dict]:
    """The embedding probe (``attnviz embed --m M --max-docs D``)."""
    from attnviz.effects import embedding

    o = cell.options
    result = embedding.probe(lm, documents(cell.corpus).documents, cell.arch, m=o["m"], max_docs=o["max_docs"])
    return [{"recall_at_1": result.recall_at_1, "mrr": result.mrr, "n_docs": result.n_docs}]


def compress(lm: LoadedModel, cell: Cell) -> list[dict]:
    """KV-cache compression, docs/methods.md#kv-cache-compression (``attnviz compress --press ... --ratios ... --context C --max-tokens N``): one row per
    (press, ratio), the dense cache as press "dense" at ratio 0."""
    from attnviz.effects.evaluate import token_ids
    from attnviz.kv import compress as run
    from attnviz.kv import presses

    o = cell.options
    chosen = [presses.parse(p) for p in (o["presses"] or presses.DEFAULTS)]
    ids = token_ids(lm, documents(cell.corpus).text, o["max_tokens"])
    doc = run.compress(lm, ids, o["context"], chosen, [float(r) for r in o["ratios"]], cell.arch).as_json()
    rows = [{"press": "dense", "ratio": 0.0, "perplexity": doc["dense"]["perplexity"],
             "accuracy": doc["dense"]["accuracy"], "kl": 0.0, "kept_key0": 1.0}]
    return rows + [dict(r) for r in doc["presses"]]


def heads(lm: LoadedModel, cell: Cell) -> list[dict]:
    """Head classes over a dataset, docs/methods.md#head-classes (``attnviz heads --samples S --max-len T``): per layer, how many heads of
    each class."""
    from attnviz.effects import heads as heads_mod

    o = cell.options
    texts = heads_mod.dataset_texts(lm, documents(cell.corpus).documents, o["samples"], o["max_len"])
    result = heads_mod.taxonomy(lm, texts, cell.arch, o["sink"], o["window"], o["eps"], o["tau_stream"],
                                o["tau_inactive"])
    sink, streaming, inactive = result.sink, result.streaming, result.inactive
    return [{"layer": layer, "heads": int(sink.shape[1]), "sink_heads": int(sink[layer].sum()),
             "streaming_heads": int(streaming[layer].sum()), "inactive_heads": int(inactive[layer].sum())}
            for layer in range(sink.shape[0])]


def explain(lm: LoadedModel, cell: Cell) -> list[dict]:
    """The sink's diagnosis per layer (docs/methods.md#the-sinks-diagnosis) on the corpus's first ``max_tokens``
    tokens: the source that leads the key side of the sink-key score in the most heads, in how many, and
    its mean share of those heads' scores."""
    from attnviz.effects.evaluate import token_ids
    from attnviz.effects.explain import KeptForward, diagnose

    ids = token_ids(lm, documents(cell.corpus).text, cell.options["max_tokens"])
    run = KeptForward(lm, corpus_mod.text_of(lm.tokenizer, ids), recipe(lm, cell))
    rows = []
    for layer in range(lm.n_layers):
        d = diagnose(run, layer)
        name, count = d.leading()
        shares = [dict(h["key_sources"])[name] / h["score"] for h in d.heads
                  if h["key_sources"][0][0] == name and h["score"]]
        rows.append({"layer": layer, "top_source": name, "top_heads": count, "heads": len(d.heads),
                     "top_share": float(sum(shares) / len(shares)) if shares else None})
    return rows


def causal(lm: LoadedModel, cell: Cell) -> list[dict]:
    """The causal check (docs/methods.md#the-causal-check) on the corpus's first ``max_tokens`` tokens: every block
    (the causal scan, docs/methods.md#the-causal-scan; ``leads`` names the layers attribution says it leads),
    patched at the sink token; per source and layer above it, the sink's attention before and after, and the
    perplexity before and after (``attnviz explain --test``)."""
    from attnviz.core.spec.syntax import ranges
    from attnviz.effects import causal as causal_mod
    from attnviz.effects.evaluate import token_ids

    ids = token_ids(lm, documents(cell.corpus).text, cell.options["max_tokens"])
    checks = causal_mod.check(lm, corpus_mod.text_of(lm.tokenizer, ids), recipe(lm, cell), value=cell.options["value"])
    return [{"source": c.source, "leads": ranges(c.leads), "patch": c.patch, "layer": row["layer"], "key": row["key"],
             "sink_before": row["before"], "sink_after": row["after"], "perplexity_before": c.before.perplexity,
             "perplexity_after": c.after.perplexity} for c in checks for row in c.as_json()["layers"]]


def routes(lm: LoadedModel, cell: Cell) -> list[dict]:
    """The sink's share of the attention flow per layer (docs/methods.md#routes) on the corpus's first ``max_tokens``
    tokens: over every query, and in the last token's contribution graph (``attnviz routes``)."""
    from attnviz import flow
    from attnviz.effects.evaluate import token_ids

    ids = token_ids(lm, documents(cell.corpus).text, cell.options["max_tokens"])
    traced = flow.trace(lm, corpus_mod.text_of(lm.tokenizer, ids), recipe(lm, cell))
    threshold = cell.options["threshold"]
    every, last = flow.sink_share_all(traced, threshold), flow.graph(traced, -1, threshold).sink_share()
    return [{"layer": layer, "key": traced.sink_keys[layer], "sink_share_all": a, "sink_share_last": b,
             "threshold": threshold} for layer, (a, b) in enumerate(zip(every, last))]


def valley(lm: LoadedModel, cell: Cell) -> list[dict]:
    """The compression valley per layer (docs/methods.md#the-compression-valley) on the corpus's first ``max_tokens``
    tokens: the matrix-based entropy of the layer's input, its first token's norm and the sink rate at the layer's
    sink key and at key 0, from one forward (``attnviz sinks --json``'s ``entropy``)."""
    from attnviz.effects import valley as valley_mod
    from attnviz.effects.evaluate import token_ids

    ids = token_ids(lm, documents(cell.corpus).text, cell.options["max_tokens"])
    found = valley_mod.measure(lm, corpus_mod.text_of(lm.tokenizer, ids), recipe(lm, cell))
    return found.rows(cell.options["eps"])


def paths(lm: LoadedModel, cell: Cell) -> list[dict]:
    """Path patching (docs/methods.md#path-patching) on the corpus's first ``max_tokens`` tokens: each sender (the
    causal scan's necessary writers unless named) cut from each receiver (``receivers``; by default ``groups``: each
    kind above it at once, and everything); per path and layer, the sink's attention before and after, the path's drop and
    the perplexity before and after (``attnviz paths``)."""
    from attnviz.effects import paths as paths_mod
    from attnviz.effects.evaluate import token_ids

    ids = token_ids(lm, documents(cell.corpus).text, cell.options["max_tokens"])
    o = cell.options
    found = paths_mod.paths(lm, corpus_mod.text_of(lm.tokenizer, ids), recipe(lm, cell), o["senders"] or None,
                            o["receivers"] or None, o["value"])
    return [{"sender": s, "receiver": r, "layer": layer, "key": found.before.keys[layer],
             "sink_before": found.before.attention[layer], "sink_after": after.attention[layer],
             "sink_drop": found.drop(s, r),
             "sink_drop_reached": found.reached(s, r) if found.reaches(s, r) else float("nan"),
             "perplexity_before": found.before.perplexity, "perplexity_after": after.perplexity}
            for (s, r), after in found.after.items() for layer in range(len(found.before.keys))]


def emergence(lm: LoadedModel, cell: Cell) -> list[dict]:
    """The emergence measures (docs/methods.md#emergence-measures) of one checkpoint per layer and head
    (``attnviz emergence``): on ``samples`` sequences of the run's own task, or, for a model without the lab's task,
    on the corpus's first ``max_tokens`` tokens; the step, hash, kind and seed from the checkpoint's metadata."""
    from pathlib import Path

    from attnviz.lab import emergence as lab
    from attnviz.effects.evaluate import token_ids

    o = cell.options
    folder = Path(cell.model)
    checkpoint = lab.Checkpoint.of(folder) if folder.is_dir() else lab.Checkpoint(folder, 0, {})
    if checkpoint.setup.get("task"):
        probe = lab.task_probe(checkpoint.setup, o["samples"])
    else:
        probe = lab.Probe.of(token_ids(lm, documents(cell.corpus).text, o["max_tokens"]), "text")
    rows = lab.checkpoint_rows(checkpoint, lm, probe, recipe(lm, cell), o["eps"], arch=cell.arch)
    # the cell's own arch column is the architecture measured under
    return [{k: v for k, v in r.items() if k != "arch"} for r in rows]


RUN = {"sinks": sinks, "eval": evaluate, "embed": embed, "compress": compress, "heads": heads, "explain": explain,
       "causal": causal, "routes": routes, "valley": valley, "paths": paths,
       "emergence": emergence}


def schema():
    """The one Arrow schema of every results file: the cell's columns, then every measure's columns,
    each typed, nulls allowed (a measure leaves the others' columns null). A folder of mixed cells, a
    cell whose numbers are all undefined among them, reads as one table with any Parquet reader."""
    import pyarrow as pa

    cell = [("cell", pa.string()), ("measure", pa.string()), ("model", pa.string()), ("arch", pa.string()),
            ("intervention", pa.string()), ("corpus", pa.string()), ("options", pa.string()),
            ("recipe", pa.string()), ("recipe_json", pa.string()),
            ("run", pa.string()), ("setup", pa.string()), ("axes", pa.string()),
            ("status", pa.string()), ("error", pa.string()), ("elapsed_s", pa.float64()),
            ("versions", pa.string()), ("worker", pa.string()), ("finished", pa.string())]
    columns = {}
    for measure in COLUMNS.values():
        for name, arrow in measure.items():
            if columns.setdefault(name, arrow) != arrow:
                raise TypeError(f"results column '{name}' is typed twice: {columns[name]} and {arrow}")
    return pa.schema(cell + [(name, getattr(pa, arrow)()) for name, arrow in columns.items()])


#: the emergence table's head-class columns (attnviz.lab.formation.COLUMNS): scores and ratios, and the classes
_CLASSES = {**{f"{s}{b}": "float64" for s in ("induction", "prev_token", "duplicate") for b in ("", "_baseline")},
            "quiet_key0": "float64", "dormant_ratio": "float64",
            **{c: "bool_" for c in ("sink_head", "induction_head", "prev_token_head", "duplicate_head", "dormant")}}

#: measure -> its result columns and their Arrow types (pyarrow type names); the rows of RUN's functions
#: carry exactly these (tests check it), and :func:`schema` unites them.
COLUMNS = {
    "sinks": {"layer": "int64", "mask": "string", "key": "int64", "sink_rate": "float64", "ci_low": "float64",
              "ci_high": "float64", "n": "int64", "model_rate": "float64", "model_ci_low": "float64",
              "model_ci_high": "float64", "samples": "int64"},
    "eval": {"perplexity": "float64", "accuracy": "float64", "nll": "float64", "tokens": "int64", "windows": "int64"},
    "embed": {"recall_at_1": "float64", "mrr": "float64", "n_docs": "int64"},
    "compress": {"press": "string", "ratio": "float64", "perplexity": "float64", "accuracy": "float64",
                 "kl": "float64", "kept_key0": "float64"},
    "heads": {"layer": "int64", "heads": "int64", "sink_heads": "int64", "streaming_heads": "int64",
              "inactive_heads": "int64"},
    "explain": {"layer": "int64", "top_source": "string", "top_heads": "int64", "heads": "int64",
                "top_share": "float64"},
    "causal": {"source": "string", "leads": "string", "patch": "string", "layer": "int64", "key": "int64",
               "sink_before": "float64", "sink_after": "float64", "perplexity_before": "float64",
               "perplexity_after": "float64"},
    "routes": {"layer": "int64", "key": "int64", "sink_share_all": "float64", "sink_share_last": "float64",
               "threshold": "float64"},
    "paths": {"sender": "string", "receiver": "string", "layer": "int64", "key": "int64", "sink_before": "float64",
              "sink_after": "float64", "sink_drop": "float64", "sink_drop_reached": "float64",
              "perplexity_before": "float64", "perplexity_after": "float64"},
    "valley": {"layer": "int64", "key": "int64", "entropy": "float64", "first_norm": "float64", "sink_rate": "float64",
               "sink_rate_key0": "float64"},
    "emergence": {"step": "int64", "layer": "int64", "head": "int64", "loss": "float64", "train_loss": "float64",
                  "alpha0": "float64", "sink_rate": "float64", "first_token": "float64", "row_mass": "float64", "value_drain": "float64",
                  "residual_peak": "float64", "entropy": "float64", **_CLASSES, "kind": "string", "hash": "string",
                  "seed": "int64", "checkpoint": "string"},
    # a trained run itself (docs/sweeps.md#training-cells): its last step, training loss and weights hash, its folder
    "train": {"step": "int64", "train_loss": "float64", "hash": "string", "checkpoint": "string"},
}
