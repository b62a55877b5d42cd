"""``attnviz sinks``: attention-sink metrics of every layer and head, of one text or over a dataset
(docs/methods.md#sink-metrics)."""

from __future__ import annotations

import math

from attnviz.cli import common
from attnviz.errors import AttnvizError

N_ALPHA_KEYS = 8
SINKS_REPORT = ("alpha", "column_mean", "discarded")  # what the sinks JSON reads: no entropy or allocation pass


def options(p):
    from attnviz import defaults
    from attnviz.effects import dataset

    run_, report = defaults.of(dataset.sinks), defaults.of(dataset.DatasetSinks.as_json)
    common.model_args(p, corpus=True)
    common.intervene_args(p, bos=True)
    p.add_argument("--eps", type=float, default=report["eps"], help="sink threshold on alpha (%(default)s)")
    p.add_argument("--residual", default=None, help=common.RESIDUAL_HELP)
    unit = p.add_mutually_exclusive_group()
    unit.add_argument("--per-doc", action="store_true", help="dataset mode: one sample per document (default)")
    unit.add_argument("--per-line", action="store_true", help="dataset mode: one sample per non-empty line")
    # noted when given: a corpus-only option beside --text is refused, never ignored
    p.add_argument("--max-len", type=int, default=run_["max_len"], action=common.Given,
                   help="dataset mode: first N tokens of each sample (%(default)s)")
    p.add_argument("--samples", type=int, default=run_["n_samples"], action=common.Given,
                   help="dataset mode: at most N samples (%(default)s)")
    p.add_argument("--key", type=common.position_or("auto"), default=report["key"],
                   help="the key position whose sink rate is read, or 'auto': in dataset mode the first key each "
                        "layer's mask leaves open to its queries (0 under fwd, m under nosink-fwd(m)); of one text, a "
                        "position adds its rate to those of keys 0 and 1 (a key past the text's end is refused); "
                        "default %(default)s")


def run(args) -> dict:
    from attnviz.capture import prepare
    from attnviz.core.engine.hooks import layer_input_norms
    from attnviz.effects.valley import layer_entropies
    from attnviz.plan import Keep

    if not 0 <= args.eps <= 1:
        raise AttnvizError(f"--eps must be between 0 and 1, got {args.eps}")
    if args.corpus or args.per_doc or args.per_line:
        return _dataset(args)
    given = sorted(getattr(args, "given", ()))
    if given:
        raise AttnvizError(f"{' and '.join(given)} {'take' if len(given) > 1 else 'takes'} samples from a corpus (--corpus, --per-doc, --per-line); "
                           "one text is measured whole")
    text = common.text(args)
    common.check_intervene(args)
    loaded = common.load(args)
    prepared = prepare(loaded, text, common.recipe(args, loaded), Keep(statistics=SINKS_REPORT, value_norms=True))
    if args.key != "auto" and args.key >= prepared.n_tokens:
        raise AttnvizError(f"--key {args.key} is past the text's end: it has {prepared.n_tokens} tokens "
                           f"(keys 0 to {prepared.n_tokens - 1})")
    # n floats a layer and each layer's input entropy from a d x d matrix: no hidden state kept, whatever the length
    with layer_input_norms(loaded.model) as norms, layer_entropies(loaded.model) as entropies:
        cap = prepared.run()
    return sinks_report(cap, args.eps, norms, None if args.key == "auto" else args.key, entropies)


def sinks_report(capture, eps: float, residual_norms: dict | None = None, key: int | None = None,
                 entropies: dict | None = None) -> dict:
    """The `attnviz sinks --json` document for a capture (all layers recorded); ``residual_norms`` by layer, the
    stream's norm entering it (:func:`attnviz.core.engine.hooks.layer_input_norms`), for each sink's ``residual_norm``;
    ``key``, a position whose sink rate each layer adds to those of keys 0 and 1 (the document and each layer then
    name it, as the dataset's do). A model with a learned sink (gpt-oss) adds, per layer, its sink rate
    (``learned_sink_rate``) and, per head, its alpha (``learned_sink``, beside ``alpha`` of each key); each layer's
    ``sinks`` list it as key -1 of category "learned" (docs/methods.md#the-learned-sink-as-a-key)."""
    from attnviz.effects.valley import VARIANT  # ``entropies`` by layer (layer_entropies): each layer's "entropy"
    from attnviz.stats import metrics

    rated = (0, 1) if key is None else tuple(dict.fromkeys((0, 1, key)))
    layers = []
    for layer in capture.layers:
        alphas = capture.stat(layer, "alpha")
        probs_keys = capture.stat(layer, "column_mean").argmax(-1)
        discarded = capture.stat(layer, "discarded").mean(-1)
        learned = capture.learned_alpha(layer)  # the model's learned sink, where it has one (gpt-oss)
        layers.append({
            "layer": layer,
            "mask": capture.layer_masks[layer],
            **({} if key is None else {"key": key}),
            "sink_rate": {str(k): _null(metrics.sink_rate(alphas[:, k], eps)) if k < capture.n_tokens else None
                          for k in rated},
            **({} if learned is None else {"learned_sink_rate": _null(metrics.sink_rate(learned, eps))}),
            "heads": [{
                "head": h, "kv_group": capture.kv_groups[h], "sink_key": int(probs_keys[h]),
                "alpha": [_null(alphas[h, k]) if k < capture.n_tokens else None for k in range(N_ALPHA_KEYS)],
                **({} if learned is None else {"learned_sink": _null(learned[h])}),
                "discarded_mass": _null(discarded[h]),
            } for h in range(capture.n_heads)],
            # every key that acts as a sink (docs/methods.md#sinks-at-any-key)
            "sinks": capture.sinks(layer, eps, (residual_norms or {}).get(layer)),
            # the matrix-based entropy of the layer's input (docs/methods.md#the-compression-valley)
            **({} if entropies is None else {"entropy": _null(entropies.get(layer, math.nan))}),
        })
    why = _null_reasons(capture.n_tokens, layers)
    return {"model": capture.meta["model"], "arch": capture.arch, "n_tokens": capture.n_tokens,
            **({"null_reasons": why} if why else {}),
            **({} if key is None else {"key": key}),
            **({"residual": capture.meta["residual"]} if capture.meta.get("residual") else {}),
            **{name: capture.meta[name] for name in ("intervene", "prepend") if capture.meta.get(name)},
            **({"recipe": capture.recipe.to_dict()} if capture.recipe else {}),
            "tokens": capture.tokens, "layers": layers, **({} if entropies is None else {"entropy_variant": VARIANT})}


def _null_reasons(n: int, layers: list[dict]) -> dict:
    """Why the document's nulls are null, one line a field that has one (docs/cli.md#what-each-command-prints)."""
    why = {}
    if any(v is None for layer in layers for v in layer["sink_rate"].values()):
        why["sink_rate"] = ("a sink rate is null at a key past the text's end, or where no head's alpha is defined "
                            "there" + (": a one-token text has no query after its one key" if n < 2 else ""))
    if any(a is None for layer in layers for head in layer["heads"] for a in head["alpha"]):
        why["alpha"] = (f"alpha lists keys 0-{N_ALPHA_KEYS - 1}: null past the text's end ({n} token{'s' if n != 1 else ''}) and where no "
                        "later query may see the key (alpha averages over the queries after it, "
                        "docs/methods.md#sink-metrics)")
    if any("entropy" in layer and layer["entropy"] is None for layer in layers):
        why["entropy"] = ("a one-token text has no spread to measure (the entropy needs two or more tokens)" if n < 2
                          else "the layer's input was not finite (an overflow) or was not read")
    return why


def _null(x: float):
    return None if math.isnan(x) else round(float(x), 6)


def _dataset(args) -> dict:
    """Gu et al.'s protocol over many samples (docs/methods.md#sink-metrics): per-layer rates with 95% intervals."""
    from attnviz.effects import dataset

    if args.samples <= 0:
        raise AttnvizError(f"--samples must be positive, got {args.samples}")
    if args.max_len < 2:
        raise AttnvizError(f"--max-len must be at least 2, got {args.max_len}")
    if args.key != "auto" and args.key >= args.max_len:
        raise AttnvizError(f"--key {args.key} is outside the samples' {args.max_len} tokens (--max-len)")
    documents = common.corpus(args).documents
    common.check_intervene(args)
    if common.prepend(args):
        raise AttnvizError("--bos / --prepend are for one text; the dataset protocol takes the samples as they are")
    loaded = common.load(args)
    bar, update = common.progress(f"sinks {args.arch}")
    with bar:
        result = dataset.sinks(loaded, documents, common.recipe(args, loaded), "line" if args.per_line else "doc",
                               args.max_len, args.samples, on_progress=update)
    return result.as_json(args.key, eps=args.eps) | common.intervene_json(args, loaded)
