"""Command line: ``attnviz masks | sinks | capture | eval | embed | stream | generate`` (also ``python -m attnviz``).

The JSON shapes printed here are a contract other tools rely on (docs/cli.md); bad input exits
non-zero with one line on stderr, never a traceback (``ATTNVIZ_DEBUG=1`` shows it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from attnviz.errors import AttnvizError

N_ALPHA_KEYS = 8


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other bad input
        self.exit(2, f"attnviz: error: {message}\n")


def _masks(args) -> dict:
    if args.n < 1:
        raise AttnvizError(f"--n must be at least 1, got {args.n}")
    from attnviz.core import arch as arch_mod

    architecture = arch_mod.parse(args.arch, args.layers)
    return {
        "arch": architecture.spec,
        "layers": [{"layer": i, "mask": m.name, "allow": m.matrix(args.n).astype(int).tolist()}
                   for i, m in enumerate(architecture.layers)],
    }


def _text(args) -> str:
    if args.text_file:
        try:
            text = Path(args.text_file).read_text(encoding="utf-8")
        except OSError as err:
            raise AttnvizError(f"cannot read --text-file '{args.text_file}': {err.strerror}") from None
        except UnicodeDecodeError as err:
            raise AttnvizError(f"--text-file '{args.text_file}' is not UTF-8 text (byte {err.start}: "
                               f"{err.object[err.start:err.start + 1]!r}): save it as UTF-8") from None
    else:
        text = args.text
    if not text or not text.strip():
        raise AttnvizError("the text is empty: give --text or --text-file with some words")
    return text


def _corpus(args):
    from attnviz import corpus

    if getattr(args, "text", None) is not None:
        return corpus.from_text(args.text, "--text")
    return corpus.load(getattr(args, "corpus", None), args.text_file)


def _progress(description: str):
    """A tqdm bar on stderr and the ``(done, total)`` callback the library reports progress with."""
    from tqdm.auto import tqdm

    bar = tqdm(desc=description, file=sys.stderr, unit="", leave=False, disable=not sys.stderr.isatty())

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    return bar, update


def _load(args):
    """The model; every handler reads its input first, so bad input fails before a model is loaded."""
    from huggingface_hub.utils import logging as hub_logging

    from attnviz.core.models import load

    hub_logging.set_verbosity_error()  # the one-line error below says it; no retry chatter

    return load(args.model, dtype=args.dtype, device=args.device, device_map=args.device_map,
                trust_remote_code=args.trust_remote_code,
                progress=lambda message: print(message, file=sys.stderr) if sys.stderr.isatty() else None)


def _check_intervene(args) -> None:
    """The intervention string's form, before a model is loaded (its layers and heads are checked
    against the model once it is)."""
    from attnviz.core import interventions

    interventions.parse(getattr(args, "intervene", None), 10**6, 10**6)


def _intervene_json(args, loaded) -> dict:
    from attnviz.core import interventions

    spec = interventions.parse(args.intervene, loaded.n_layers, loaded.n_heads).spec
    return {"intervene": spec} if spec else {}


def _prepend(args) -> str | None:
    return "bos" if getattr(args, "bos", False) else getattr(args, "prepend", None)


def _recipe(args, loaded, arch: str | None = None):
    """The recipe a command's options make: ``--arch`` (or ``arch``), ``--intervene``, ``--bos`` / ``--prepend``
    and ``--residual``, where the command has them."""
    from attnviz.recipe import Recipe

    return Recipe.of(loaded, arch or getattr(args, "arch", None) or "fwd", getattr(args, "intervene", None),
                     _prepend(args), getattr(args, "residual", None))


def _finite(value):
    """``value`` with every NaN or infinite float as None (null): strict JSON parsers take no NaN. Each command
    says why a number is undefined beside it where it can (a ``*_undefined`` field)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def dumps(result) -> str:
    """A command's JSON: never NaN (:func:`_finite`)."""
    return json.dumps(_finite(result), allow_nan=False)


def _null(x: float):
    return None if math.isnan(x) else round(float(x), 6)


SINKS_REPORT = ("alpha", "column_mean", "discarded")  # what the sinks JSON reads: no entropy or allocation pass


def sinks_report(capture, eps: float, residual_norms: dict | None = None) -> dict:
    """The `attnviz sinks --json` document for a capture (all layers recorded); ``residual_norms`` by layer, the
    stream's norm entering it (:func:`attnviz.core.hooks.layer_input_norms`), for each sink's ``residual_norm``."""
    from attnviz.stats import metrics

    layers = []
    for layer in capture.layers:
        alphas = capture.stat(layer, "alpha")
        probs_keys = capture.stat(layer, "column_mean").argmax(-1)
        discarded = capture.stat(layer, "discarded").mean(-1)
        layers.append({
            "layer": layer,
            "mask": capture.layer_masks[layer],
            "sink_rate": {str(k): _null(metrics.sink_rate(alphas[:, k], eps)) if k < capture.n_tokens else None
                          for k in (0, 1)},
            "heads": [{
                "head": h, "kv_group": capture.kv_groups[h], "sink_key": int(probs_keys[h]),
                "alpha": [_null(alphas[h, k]) if k < capture.n_tokens else None for k in range(N_ALPHA_KEYS)],
                "discarded_mass": _null(discarded[h]),
            } for h in range(capture.n_heads)],
            # every key that acts as a sink (docs/methods.md#sinks-at-any-key)
            "sinks": capture.sinks(layer, eps, (residual_norms or {}).get(layer)),
        })
    return {"model": capture.meta["model"], "arch": capture.arch, "n_tokens": capture.n_tokens,
            **({"residual": capture.meta["residual"]} if capture.meta.get("residual") else {}),
            **{key: capture.meta[key] for key in ("intervene", "prepend") if capture.meta.get(key)},
            **({"recipe": capture.recipe.to_dict()} if capture.recipe else {}),
            "tokens": capture.tokens, "layers": layers}


def _sinks(args) -> dict:
    from attnviz.capture import capture
    from attnviz.plan import Keep

    if not 0 <= args.eps <= 1:
        raise AttnvizError(f"--eps must be between 0 and 1, got {args.eps}")
    if args.corpus or args.per_doc or args.per_line:
        return _dataset_sinks(args)
    text = _text(args)
    _check_intervene(args)
    loaded = _load(args)
    recipe = _recipe(args, loaded)
    from attnviz.core.hooks import layer_input_norms

    with layer_input_norms(loaded.model) as norms:  # n floats a layer: no hidden state kept, whatever the length
        cap = capture(loaded, text, recipe, Keep(statistics=SINKS_REPORT, value_norms=True))
    return sinks_report(cap, args.eps, norms)


def _dataset_sinks(args) -> dict:
    """Gu et al.'s protocol over many samples (docs/methods.md#sink-metrics): per-layer rates with 95% intervals."""
    from attnviz.effects import dataset

    if args.samples <= 0:
        raise AttnvizError(f"--samples must be positive, got {args.samples}")
    if args.max_len < 2:
        raise AttnvizError(f"--max-len must be at least 2, got {args.max_len}")
    documents = _corpus(args).documents
    _check_intervene(args)
    if _prepend(args):
        raise AttnvizError("--bos / --prepend are for one text; the dataset protocol takes the samples as they are")
    loaded = _load(args)
    bar, update = _progress(f"sinks {args.arch}")
    with bar:
        result = dataset.sinks(loaded, documents, _recipe(args, loaded), "line" if args.per_line else "doc",
                               args.max_len, args.samples, on_progress=update)
    return result.as_json(args.key, eps=args.eps) | _intervene_json(args, loaded)


def _capture(args) -> dict:
    from attnviz.capture import capture
    from attnviz.plan import Keep

    text = _text(args)
    _check_intervene(args)
    loaded = _load(args)
    if loaded.is_encoder_decoder or args.attention not in (None, "self"):
        if args.intervene or _prepend(args):
            raise AttnvizError("--intervene, --bos and --prepend are for decoder-only models")
        return _capture_seq2seq(args, loaded, text)
    recipe = _recipe(args, loaded)
    result = capture(loaded, text, recipe, Keep(layers=args.layers, hidden_states=args.hidden))
    path = result.save(args.out)
    return {"out": str(path), "model": result.meta["model"], "arch": result.arch,
            **({"intervene": result.meta["intervene"]} if result.meta.get("intervene") else {}),
            "n_tokens": result.n_tokens, "layers": result.layers, "recipe": result.recipe.to_dict(),
            "forward_s": round(result.timing["forward_s"], 4)}


def _capture_seq2seq(args, loaded, text) -> dict:
    """Encoder-decoders: the three kinds (or the one asked for), one .npz each."""
    from attnviz import seq2seq

    seq2seq.require(loaded)
    if args.attention == "self":
        raise AttnvizError("--attention self is for decoder-only models; choose encoder, decoder, cross or all")
    bar, update = _progress("capture")
    with bar:
        result = seq2seq.capture_seq2seq(loaded, text, args.target, args.arch or seq2seq.STOCK_ENCODER,
                                         on_layer=update)
    kinds = list(seq2seq.KINDS) if args.attention in (None, "all") else [args.attention]
    out = Path(args.out)
    stem = out.name.removesuffix(".npz")
    paths = {k: str(result.view(k).save(out if len(kinds) == 1 else out.with_name(f"{stem}.{k}.npz"))) for k in kinds}
    return {"out": paths, "model": loaded.model_id, "encoder_arch": result.encoder.arch, "target": result.target,
            "generated": result.generated, "n_source_tokens": result.encoder.n_tokens,
            "n_target_tokens": result.decoder.n_tokens, "forward_s": round(result.encoder.timing["forward_s"], 4)}


def _eval(args) -> dict:
    from attnviz.effects.evaluate import DEFAULT_WINDOW, evaluate, token_ids

    text = _corpus(args).text
    _check_intervene(args)
    loaded = _load(args)
    ids = token_ids(loaded, text, args.max_tokens)
    bar, update = _progress(f"eval {args.arch}")
    with bar:
        window = min(DEFAULT_WINDOW, len(ids)) if args.window is None else args.window
        result = evaluate(loaded, ids, _recipe(args, loaded), window=window, stride=args.stride, on_window=update)
    return result.as_json()


def _embed(args) -> dict | None:
    """One JSON document, or with ``--sweep k`` one JSON line per k, printed as each finishes."""
    from attnviz.effects import embedding

    if args.max_docs is not None and args.max_docs < 2:
        raise AttnvizError(f"--max-docs must be at least 2 (the probe ranks targets), got {args.max_docs}")
    if args.sweep is None and args.ks is not None:
        raise AttnvizError("--ks needs --sweep k")
    documents = _corpus(args).documents
    loaded = _load(args)
    bar, update = _progress(f"embed {args.arch}")
    with bar:
        if args.sweep is None:
            return embedding.probe(loaded, documents, args.arch, m=args.m, max_docs=args.max_docs,
                                   on_progress=update).as_json()
        embedding.sweep(loaded, documents, args.arch, args.ks, m=args.m, max_docs=args.max_docs,
                        on_row=lambda row: print(dumps(row.as_json()), flush=True), on_progress=update)
    return None


def _stream(args) -> dict:
    from attnviz.effects.evaluate import token_ids
    from attnviz.effects.streaming import parse_policy, stream

    policies = [parse_policy(p) for p in (args.policy or ["dense"])]
    if len(policies) > 1 and not args.compare:
        raise AttnvizError("several --policy values need --compare")
    text = _corpus(args).text
    _check_intervene(args)
    loaded = _load(args)
    ids = token_ids(loaded, text, args.max_tokens)
    for policy in policies:  # every policy is checked before the first one runs
        policy.check(loaded, len(ids))
    results = []
    for policy in policies:
        bar, update = _progress(f"stream {policy.spec}")
        with bar:
            results.append(stream(loaded, ids, policy, _recipe(args, loaded), on_step=update))
    if not args.compare:
        return results[0].as_json()
    return {"model": loaded.model_id, "arch": results[0].arch, "tokens": results[0].tokens,
            "policies": [r.as_json(curve=True) for r in results]}


def _generate(args) -> dict:
    from attnviz.effects.generate import generate

    text = _text(args)
    _check_intervene(args)
    loaded = _load(args)
    bar, update = _progress("generate")
    with bar:
        result = generate(loaded, text, _recipe(args, loaded), args.policy, args.max_new_tokens, record=set(),
                          on_step=update)
    return {"model": loaded.model_id, "arch": result.arch, "policy": result.policy, "text": result.text,
            **_intervene_json(args, loaded),
            "new_ids": result.new_ids, "prompt_tokens": len(result.prompt_ids)}


def _compress(args) -> dict:
    """KV-cache compression what-if (docs/methods.md#kv-cache-compression): every press at every ratio against the dense cache."""
    from attnviz.effects.evaluate import token_ids
    from attnviz.kv import compress, presses

    chosen = [presses.parse(p) for p in (args.press or presses.DEFAULTS)]
    try:
        ratios = [float(x) for x in args.ratios.split(",") if x.strip()]
    except ValueError:
        raise AttnvizError(f"--ratios must be numbers separated by commas, got '{args.ratios}'") from None
    if not ratios:
        raise AttnvizError("--ratios needs at least one ratio in [0, 1)")
    text = _corpus(args).text
    loaded = _load(args)
    ids = token_ids(loaded, text, args.max_tokens)
    bar, update = _progress("compress")
    with bar:
        result = compress.compress(loaded, ids, args.context, chosen, ratios, args.arch, on_step=update)
    return result.as_json()


def _heads(args) -> dict:
    """Head taxonomy (docs/methods.md#head-classes): sink, streaming and inactive heads of one text or a dataset."""
    from attnviz.effects import heads

    for name in ("eps", "tau_stream", "tau_inactive"):
        if getattr(args, name) < 0:
            raise AttnvizError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.samples is not None and args.samples < 2:
        raise AttnvizError(f"--samples must be at least 2 (a dataset's scores are averaged), got {args.samples}")
    dataset = not (args.text or args.text_file)  # one text given: that text; else the corpus as a dataset
    source = _corpus(args)
    loaded = _load(args)
    texts = (heads.dataset_texts(loaded, source.documents, args.samples, args.max_len) if dataset
             else [source.text])
    bar, update = _progress("heads")
    with bar:
        result = heads.taxonomy(loaded, texts, args.arch, args.sink, args.window, args.eps, args.tau_stream,
                                args.tau_inactive, on_progress=update)
    return result.as_json()


def _linformer(args) -> dict:
    """Linformer what-if on one layer of a real capture (docs/methods.md#linformer-what-if)."""
    from attnviz.capture import capture, parse_layers
    from attnviz.plan import Keep
    from attnviz.effects import linformer

    try:
        ks = [int(x) for x in args.ks.split(",") if x.strip()]
    except ValueError:
        raise AttnvizError(f"--ks must be whole numbers separated by commas, got '{args.ks}'") from None
    text = _text(args)
    loaded = _load(args)
    layer = parse_layers(str(args.layer), loaded.n_layers)[0]
    cap = capture(loaded, text, args.arch, Keep(layers=[layer], qkv=True, statistics=True))  # q, k, v: no n × n map
    results = linformer.error_curve(cap.layer_qkv(layer), cap.allowed[layer],
                                    [linformer.check_k(k, cap.n_tokens) for k in ks], args.projection)
    return {"model": loaded.model_id, "arch": cap.arch, "layer": layer, "n_tokens": cap.n_tokens,
            "projection": args.projection,
            "rows": [{"k": r.k, "error_full": round(r.error_full, 6), "error_masked": round(r.error_masked, 6)}
                     for r in results]}


def _finetune(args) -> dict:
    """Fine-tune with a residual variant (seed 003) and report the seed's eval metrics."""
    from attnviz.effects.evaluate import token_ids
    from attnviz.effects.finetune import check_out, finetune

    if args.steps <= 0:
        raise AttnvizError(f"--steps must be positive, got {args.steps}")
    check_out(args.out)
    text = _corpus(args).text
    loaded = _load(args)
    ids = token_ids(loaded, text, args.max_tokens)
    bar, update = _progress(f"finetune {args.residual or 'baseline'}")
    with bar:
        result = finetune(loaded, ids, args.out, args.residual, args.arch, args.steps, args.seq_len, args.batch,
                          args.lr, args.seed, on_step=lambda step, total, loss: (update(step, total),
                                                                                 bar.set_postfix(loss=f"{loss:.3f}")))
    if result.interrupted:
        raise AttnvizError(f"interrupted after {result.steps} steps; the last complete checkpoint is in {result.out}")
    keep = ("residual", "arch", "steps", "seed", "eval_loss", "eval_perplexity", "eval_accuracy", "eval_runtime",
            "eval_samples", "before")
    return {"out": result.out, **{k: result.metrics[k] for k in keep}, "train_loss_first": result.losses[0],
            "train_loss_last": result.losses[-1]}


def _explain(args) -> dict:
    """Score attribution of one cell, or of one key over every query that sees it (docs/methods.md#score-attribution)."""
    from attnviz.effects.explain import explain

    text = _text(args)
    _check_intervene(args)
    if args.test:
        return _causal(args, text)
    missing = [f"--{name}" for name in ("layer", "head", "key") if getattr(args, name) is None]
    if missing:
        raise AttnvizError(f"give {', '.join(missing)} (one cell's attribution), or --test (the causal check)")
    loaded = _load(args)
    result = explain(loaded, text, _recipe(args, loaded), layer=args.layer, head=args.head, query=args.query,
                     key=args.key)
    return result.as_json()


def _causal(args, text: str) -> dict:
    """The causal check (docs/methods.md#the-causal-check): every block (the causal scan), or the named sources,
    patched at the sink token."""
    from attnviz.effects import causal

    # a bad or empty source list refused before the model loads
    sources = causal.sources_of(args.sources) if args.sources is not None else None
    loaded = _load(args)
    recipe = _recipe(args, loaded)
    if sources is None:  # every block: the causal scan, its necessary writers and their chains
        from attnviz.effects.causal import scan

        bar, update = _progress("causal scan")
        with bar:
            return scan(loaded, text, recipe, args.value, on_step=update).as_json()
    bar, update = _progress("causal check")
    with bar:
        checks = causal.check(loaded, text, recipe, sources, args.value, on_step=update)
    return causal.Report(recipe.to_dict(), checks[0].before.tokens, checks).as_json()


def _routes(args) -> dict:
    """A token's contribution graph and the sink's share of the attention flow (docs/methods.md#routes)."""
    from attnviz import flow

    text = _text(args)
    _check_intervene(args)
    flow.check(args.threshold, args.heads)
    loaded = _load(args)
    bar, update = _progress("routes")
    with bar:
        graph = flow.routes(loaded, text, _recipe(args, loaded), args.token, args.threshold, args.heads,
                            on_layer=update)
    return graph.as_json()


def _patching(args) -> dict:
    """Activation patching between two texts (docs/methods.md#activation-patching)."""
    from attnviz.effects import patching

    if args.site not in patching.SITES:  # refused before a model loads
        raise AttnvizError(f"unknown site '{args.site}': expected one of {', '.join(patching.SITES)}")
    if args.metric == "logit_diff" and (args.answer is None or args.wrong is None):
        raise AttnvizError("the logit difference needs --answer and --wrong (one token each), or choose "
                           "--metric kl or sink")
    for name in ("clean", "corrupted"):
        if not getattr(args, name).strip():
            raise AttnvizError(f"--{name} is empty: give the text")
    _check_intervene(args)
    loaded = _load(args)
    bar, update = _progress("patching")
    with bar:
        result = patching.patching(loaded, args.clean, args.corrupted, args.answer, args.wrong, args.site,
                                   args.metric, _recipe(args, loaded), on_layer=update)
    return result.as_json()


def _doctor(args) -> int:
    """Environment, equivalence on this model and device, speed: one line per check (attnviz.doctor)."""
    from attnviz import doctor

    if args.tokens < 16:
        raise AttnvizError(f"--tokens must be at least 16, got {args.tokens}")
    device = doctor.pick_device(args.device)
    args.device = device
    loaded = _load(args)
    say = (lambda message: print(f"doctor: {message}…", file=sys.stderr)) if sys.stderr.isatty() else None
    report = doctor.run(loaded, args.tokens, progress=say)
    print(dumps(report.as_json()) if args.json else report.text())
    return 0 if report.ok else 1


def _out_file(arg: str, suffixes: tuple[str, ...], kind: str) -> Path:
    """``--out`` as a file of one of ``suffixes`` (``kind``: "an .html file") in a folder that exists,
    checked before anything runs."""
    out = Path(arg)
    if out.suffix.lower() not in suffixes:
        raise AttnvizError(f"--out must name {kind}, got '{arg}'")
    if not out.parent.is_dir():
        raise AttnvizError(f"--out: the folder '{out.parent}' does not exist")
    return out


def _report(args) -> dict:
    """One self-contained HTML file: the viewer, sink shifting, sink profiles, provenance."""
    import shlex

    from attnviz.reports import html as report_mod
    from attnviz.reports import write_atomic

    archs = report_mod.split_archs(args.arch)
    out = _out_file(args.out, (".html", ".htm"), "an .html file")
    if not 16 <= args.size <= 512:
        raise AttnvizError(f"--size must be 16 to 512 pixels, got {args.size}")
    if not 1 <= args.quality <= 100:
        raise AttnvizError(f"--quality must be 1 to 100, got {args.quality}")
    _check_intervene(args)
    text = _text(args)
    loaded = _load(args)
    bar, update = _progress(f"report: {len(archs)} architectures")
    with bar:
        caps = report_mod.captures(loaded, text, archs, args.intervene, on_progress=update)
    page = report_mod.report_html(caps, size=args.size, image_format=args.images, quality=args.quality,
                                  command="attnviz " + shlex.join(args.argv))
    data = page.encode("utf-8")
    write_atomic(out, data)
    print(f"wrote {out} ({len(data) / 2**20:.1f} MB)", file=sys.stderr)
    return {"out": str(out), "bytes": len(data), "mb": round(len(data) / 2**20, 2), "n_tokens": caps[0].n_tokens,
            "archs": [c.arch for c in caps]}


def _reproduce(args) -> dict:
    """The papers' headline figures on this model, one PDF (attnviz.reports.reproduce)."""
    from attnviz.reports import reproduce as repro

    only = repro.parse_only(args.only)
    out = _out_file(args.out, (".pdf",), "a .pdf file")
    loaded = _load(args)
    bar, update = _progress("reproduce")
    with bar:
        path, done = repro.reproduce(loaded, out, only, quick=args.quick, model=args.model,
                                     on_progress=lambda i, n, name: (update(i, n), bar.set_postfix_str(name)))
    print(f"wrote {path} ({len(done)} pages)", file=sys.stderr)
    return {"out": str(path), "sections": {s.name: s.numbers for s in done}}


def _sweep(args) -> dict:
    """A grid of cells on Ray (attnviz.sweep): models × archs × interventions × corpora × measures."""
    import time

    from attnviz.sweep import run, spec

    grid = spec.load(args.spec)  # every key checked before anything runs
    if args.workers is not None and args.workers < 1:
        raise AttnvizError(f"--workers must be at least 1, got {args.workers}")
    out = args.out
    if "://" not in out and Path(out).exists() and not Path(out).is_dir():
        raise AttnvizError(f"--out: '{out}' is a file, not a folder")
    start = time.perf_counter()
    bar, update = _progress(f"sweep: {len(grid.cells())} cells")

    def on_cell(done: int, total: int, result: dict) -> None:
        update(done, total)
        left = (time.perf_counter() - start) / done * (total - done)
        if not sys.stderr.isatty():  # a log line per cell where no bar is drawn
            print(f"cell {done}/{total} {result['status']} ({result['elapsed_s']:.1f} s) · ETA {left:.0f} s",
                  file=sys.stderr, flush=True)
        else:
            bar.set_postfix_str(f"ETA {left:.0f} s")

    with bar:
        summary = run.sweep(grid, out, address=args.address, workers=args.workers, local=args.local, on_cell=on_cell)
    result = summary.as_json(out)
    if summary.failed:
        first = next(iter(summary.errors.values()))
        print(dumps(result))
        raise AttnvizError(f"{summary.failed} of {summary.total} cells failed (recorded in {out}); the first: {first}")
    return result


def _position_or(word: str):
    """An argparse type: a token position, or ``word`` ('auto' for --key, 'all' for --query)."""
    def parse(text: str):
        if text.strip().lower() == word:
            return word
        if not text.strip().isdigit():
            raise argparse.ArgumentTypeError(f"'{text}' is neither a token position nor '{word}'")
        return int(text)
    return parse


# --- options ----------------------------------------------------------------------------------
# One function per command adds its options. Every default comes from the library function that uses
# it (attnviz.defaults), never a literal here; help texts print it with %(default)s. A command's
# options are built only when that command runs (or for --help of it), so `attnviz --help` and
# `attnviz masks` import no model code.

def _model_args(p, text: bool = True, corpus: bool = False):
    """The options of every command that runs a model."""
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), 'gemma3-270m' (Gemma 3 270M), "
                                                                "a Hugging Face id or a local directory")
    p.add_argument("--arch", default="fwd", help="architecture string (docs/methods.md#the-call-syntax)")
    _load_args(p)
    p.add_argument("--json", action="store_true", help="JSON output (the default)")
    source = p.add_mutually_exclusive_group(required=text)
    if text:
        source.add_argument("--text", help="the text to capture")
    if corpus or not text:
        source.add_argument("--corpus", default=None if text else "stdlib",
                            help="'stdlib' (Python's reference docs, offline) or 'stdlib:TOPIC'")
    source.add_argument("--text-file", help="read the text from this file (UTF-8)")
    return source


def _load_args(p):
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: float32 on CPU)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    p.add_argument("--device-map", default=None,
                   help="'auto' (or balanced, sequential): spread the model over GPUs, the CPU and disk "
                        "with accelerate, for models larger than one device")
    p.add_argument("--trust-remote-code", action="store_true", help="allow a model's own Python code")


def _intervene_args(p, bos: bool = False):
    from attnviz.core.interventions import USAGE

    p.add_argument("--intervene", default=None,
                   help=f"interventions (docs/methods.md#interventions), e.g. 'sinkscale(beta=0.3)@20-29; "
                        f"ablate(heads=0,3)@5': {USAGE}".replace("%", "%%"))
    if bos:
        first = p.add_mutually_exclusive_group()
        first.add_argument("--bos", action="store_true", help="prepend the tokenizer's BOS token to the text")
        first.add_argument("--prepend", default=None, metavar="TOKEN", help="prepend this token to the text")


RESIDUAL_HELP = "a residual variant (docs/methods.md#residual-variants): method1, method2, method3.1, method3.2, " \
                "method4.1, method4.2 (sequential pre-norm decoders: docs/methods.md#residual-variants)"


def _masks_options(p):
    p.add_argument("--arch", required=True, help="architecture string, e.g. 'mask0-bidir(k=8)'")
    p.add_argument("--layers", type=int, required=True, help="number of layers")
    p.add_argument("--n", type=int, required=True, help="sequence length")
    p.add_argument("--json", action="store_true", help="JSON output (the default)")


def _sinks_options(p):
    from attnviz import defaults
    from attnviz.effects import dataset

    run, report = defaults.of(dataset.sinks), defaults.of(dataset.DatasetSinks.as_json)
    _model_args(p, corpus=True)
    _intervene_args(p, bos=True)
    p.add_argument("--eps", type=float, default=report["eps"], help="sink threshold on alpha (%(default)s)")
    p.add_argument("--residual", default=None, help=RESIDUAL_HELP)
    unit = p.add_mutually_exclusive_group()
    unit.add_argument("--per-doc", action="store_true", help="dataset mode: one sample per document (default)")
    unit.add_argument("--per-line", action="store_true", help="dataset mode: one sample per non-empty line")
    p.add_argument("--max-len", type=int, default=run["max_len"],
                   help="dataset mode: first N tokens of each sample (%(default)s)")
    p.add_argument("--samples", type=int, default=run["n_samples"], help="dataset mode: at most N samples (%(default)s)")
    p.add_argument("--key", type=_position_or("auto"), default=report["key"],
                   help="dataset mode: the key position whose sink rate is read, or 'auto': the first key each "
                        "layer's mask leaves open to its queries (0 under fwd, m under nosink-fwd(m)); "
                        "default %(default)s")


def _capture_options(p):
    _model_args(p)
    _intervene_args(p, bos=True)
    p.add_argument("--out", required=True, help="output file (.npz)")
    p.add_argument("--layers", default=None, help="layers to record: 5, -1, 20-29 or 0,5,7 (default: all)")
    p.add_argument("--hidden", action="store_true", help="also keep hidden states")
    p.add_argument("--residual", default=None, help=RESIDUAL_HELP)
    p.add_argument("--attention", choices=["self", "encoder", "decoder", "cross", "all"], default=None,
                   help="encoder-decoder models: which attention to save (default all, one .npz each)")
    p.add_argument("--target", default=None,
                   help="encoder-decoder models: the target text (default: the model's own greedy output)")
    p.set_defaults(arch=None)  # fwd for decoders; the stock bidir encoder for encoder-decoders


def _eval_options(p):
    from attnviz import defaults
    from attnviz.effects import evaluate

    run = defaults.of(evaluate.evaluate)
    _model_args(p, text=False)
    _intervene_args(p)
    p.add_argument("--window", type=int, default=None,
                   help=f"window W in tokens (default {run['window']}, or the text if shorter)")
    p.add_argument("--stride", type=int, default=None, help="stride S <= W (default W)")
    p.add_argument("--max-tokens", type=int, default=run["max_tokens"],
                   help="evaluate at most this many tokens (default %(default)s)")
    p.add_argument("--residual", default=None, help=RESIDUAL_HELP)


def _finetune_options(p):
    from attnviz import defaults
    from attnviz.effects import finetune

    run = defaults.of(finetune.finetune)
    _model_args(p, text=False)
    p.add_argument("--residual", default=None, help=RESIDUAL_HELP + "; default: the baseline, no variant")
    p.add_argument("--steps", type=int, default=run["steps"], help="optimizer steps (default %(default)s)")
    p.add_argument("--out", required=True, help="directory to write; `--model DIR` loads it back")
    p.add_argument("--seq-len", type=int, default=run["seq_len"], help="tokens per training sequence (%(default)s)")
    p.add_argument("--batch", type=int, default=run["batch"], help="sequences per step (default %(default)s)")
    p.add_argument("--lr", type=float, default=run["lr"], help="peak learning rate (default %(default)s)")
    p.add_argument("--seed", type=int, default=run["seed"], help="seed for the batches and the initialisation "
                                                                "(default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=finetune.MAX_TOKENS, help="corpus tokens to use (%(default)s)")


def _embed_options(p):
    from attnviz import defaults
    from attnviz.effects import embedding

    run = defaults.of(embedding.probe)
    _model_args(p, text=False)
    p.add_argument("--m", type=int, default=run["m"], help="tokens per query and per target (default %(default)s)")
    p.add_argument("--max-docs", type=int, default=run["max_docs"], help="use at most this many documents (all)")
    p.add_argument("--sweep", choices=["k"], default=None,
                   help="run the named --arch (e.g. mask0-bidir) for every k; prints one JSON line per k")
    p.add_argument("--ks", default=None, help="with --sweep k: the k values, e.g. 0,4,8 (default 0..L)")


def _stream_options(p):
    from attnviz.effects import streaming

    _model_args(p, text=False)
    _intervene_args(p)
    p.add_argument("--policy", action="append", help=f"{streaming.POLICIES.usage()}; repeat with --compare")
    p.add_argument("--compare", action="store_true", help="run every --policy and print each running-perplexity curve")
    p.add_argument("--max-tokens", type=int, default=streaming.MAX_TOKENS,
                   help="stream at most this many tokens (default %(default)s)")


def _compress_options(p):
    from attnviz import defaults
    from attnviz.kv import compress, presses

    run = defaults.of(compress.compress)
    _model_args(p, text=False).add_argument("--text", help="the text (default: the stdlib corpus)")
    p.add_argument("--press", action="append",
                   help=f"{' | '.join(presses.DEFAULTS)}; repeat for several (default: all {len(presses.DEFAULTS)})")
    p.add_argument("--ratios", default=",".join(f"{r:g}" for r in run["ratios"]),
                   help="compression ratios in [0, 1) (default %(default)s)")
    p.add_argument("--context", type=int, default=run["context"],
                   help="context tokens C, prefilled and compressed (%(default)s)")
    p.add_argument("--max-tokens", type=int, default=compress.MAX_TOKENS,
                   help="use at most this many tokens (default %(default)s)")


def _heads_options(p):
    from attnviz import defaults
    from attnviz.effects import heads

    run, texts = defaults.of(heads.taxonomy), defaults.of(heads.dataset_texts)
    _model_args(p, text=False).add_argument("--text", help="one text (default: the stdlib corpus as a dataset)")
    p.set_defaults(corpus=None)
    p.add_argument("--samples", type=int, default=texts["samples"], help="dataset mode: at most N samples "
                                                                         "(%(default)s)")
    p.add_argument("--max-len", type=int, default=texts["max_len"],
                   help="dataset mode: first N tokens of each sample (%(default)s)")
    p.add_argument("--eps", type=float, default=run["eps"], help="sink threshold on alpha_0 (%(default)s)")
    p.add_argument("--tau-stream", type=float, default=run["tau_stream"], help="streaming-score threshold (%(default)s)")
    p.add_argument("--tau-inactive", type=float, default=run["tau_inactive"],
                   help="output-norm (AHON) threshold (%(default)s)")
    p.add_argument("--sink", type=int, default=run["s"], help="s: sink keys of the streaming pattern (%(default)s)")
    p.add_argument("--window", type=int, default=run["w"], help="w: recent keys of the streaming pattern (%(default)s)")


def _explain_options(p):
    _model_args(p)
    _intervene_args(p, bos=True)
    p.add_argument("--layer", type=int, help="the layer (negative counts from the top)")
    p.add_argument("--head", type=int, help="the query head")
    p.add_argument("--query", type=_position_or("all"), default="all",
                   help="the query position, or 'all': the mean over every query the mask lets see the key (%(default)s)")
    p.add_argument("--key", type=int, help="the key position")
    p.add_argument("--test", action="store_true",
                   help="the causal check instead: remove every block's write (or --sources') at the sink token and "
                        "report the sink's attention and the perplexity before and after, the necessary writers and "
                        "their chains (docs/methods.md#the-causal-scan)")
    p.add_argument("--sources", default=None,
                   help="with --test: the sources to patch, e.g. mlp.2,mlp.11 (default: every block, the leaders marked)")
    p.add_argument("--value", choices=["zero", "mean"], default="zero",
                   help="with --test: what replaces the source's output at the sink token (%(default)s)")


def _routes_options(p):
    from attnviz import defaults, flow

    own = defaults.of(flow.routes)
    _model_args(p)
    _intervene_args(p, bos=True)
    p.add_argument("--token", type=int, default=own["token"],
                   help="the token whose routes are traced (negative counts from the end; %(default)s: the last)")
    p.add_argument("--threshold", type=float, default=own["threshold"],
                   help="keep edges whose contribution is at least this (%(default)s, Ferrando & Voita's)")
    p.add_argument("--heads", choices=["split", "sum"], default=own["heads"],
                   help="attention edges one per head, or the heads summed (%(default)s)")


def _patching_options(p):
    from attnviz.effects import patching

    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), 'gemma3-270m' (Gemma 3 270M), "
                                                       "a Hugging Face id or a local directory")
    p.add_argument("--arch", default="fwd", help="architecture string (docs/methods.md#the-call-syntax)")
    _load_args(p)
    _intervene_args(p, bos=True)
    p.add_argument("--json", action="store_true", help="JSON output (the default)")
    p.add_argument("--clean", required=True, help="the clean text")
    p.add_argument("--corrupted", required=True, help="the corrupted text (the same number of tokens)")
    p.add_argument("--answer", default=None, help="the clean run's answer token, as it follows the text (' Paris')")
    p.add_argument("--wrong", default=None, help="the corrupted run's answer token (' Rome')")
    p.add_argument("--site", default="resid", help=f"where to patch: {', '.join(patching.SITES)} (%(default)s)")
    p.add_argument("--metric", default="logit_diff", choices=list(patching.METRICS),
                   help="logit(answer) - logit(wrong), the KL divergence from the clean next-token distribution, "
                        "or the last query's attention on the sink key (%(default)s)")


def _doctor_options(p):
    from attnviz import defaults, doctor

    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                   help="where to check (auto: CUDA, else MPS, else the CPU)")
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), 'gemma3-270m' (Gemma 3 270M), "
                                                                "a Hugging Face id or a local directory")
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--tokens", type=int, default=defaults.one(doctor.run, "tokens"),
                   help="the speed checks' text length in tokens (%(default)s)")
    p.add_argument("--json", action="store_true", help="the whole report as JSON, to paste into a bug report")
    p.set_defaults(device_map=None, trust_remote_code=False)


def _linformer_options(p):
    from attnviz import defaults
    from attnviz.effects import linformer

    _model_args(p)
    p.add_argument("--layer", default="-1", help="the layer (default: the top one; negative counts from the top)")
    p.add_argument("--ks", default=",".join(map(str, linformer.KS)),
                   help="comma-separated k values, each 1 <= k < n (default %(default)s)")
    p.add_argument("--projection", choices=["segment", "gaussian"], default=defaults.one(linformer.whatif, "kind"))


def _generate_options(p):
    from attnviz import defaults
    from attnviz.effects import generate

    run = defaults.of(generate.generate)
    _model_args(p)
    _intervene_args(p)
    p.add_argument("--policy", default=run["policy"], help="dense | window(w=W) | sink(s=S, w=W) (%(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=run["max_new_tokens"],
                   help="tokens to generate (1..128, default %(default)s)")


def _report_options(p):
    from attnviz import defaults
    from attnviz.reports import html

    run = defaults.of(html.report_html)
    _model_args(p)
    _intervene_args(p)
    p.set_defaults(arch="fwd; nosink-fwd; mask0-bidir(k=8)")
    p.add_argument("--out", required=True, help="the .html file to write")
    p.add_argument("--size", type=int, default=run["size"], help="map images' side in pixels, 16..512 (%(default)s)")
    p.add_argument("--images", choices=["webp", "png"], default=run["image_format"],
                   help="webp: lossy, small (default); png: lossless, ~2x larger")
    p.add_argument("--quality", type=int, default=run["quality"], help="WebP quality, 1..100 (%(default)s)")


def _reproduce_options(p):
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), 'gemma3-270m' (Gemma 3 270M), "
                                                                "a Hugging Face id or a local directory")
    _load_args(p)
    p.add_argument("--out", required=True, help="the .pdf file to write")
    p.add_argument("--only", default=None, help="comma-separated sections: shifting, streaming, sinkrate, ksweep, "
                                                "residual (default: all)")
    p.add_argument("--quick", action="store_true", help="the same protocols on less data (under a minute here)")


def _sweep_options(p):
    p.add_argument("spec", help="the spec, a TOML file (docs/sweeps.md)")
    p.add_argument("--out", required=True, help="results folder (or s3://, gs:// URI): one Parquet file per cell")
    p.add_argument("--address", default=None, help="a Ray cluster's address (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--workers", type=int, default=None, help="local Ray: at most this many cells at once "
                                                             "(default: the machine's CPUs)")
    p.add_argument("--local", action="store_true", help="run the cells in this process, without Ray")


#: command -> (one line of help, the function that adds its options, the function that runs it)
COMMANDS = {
    "masks": ("print each layer's boolean mask (no model needed)", _masks_options, _masks),
    "sinks": ("attention-sink metrics of every layer and head, of a text or a dataset", _sinks_options, _sinks),
    "capture": ("capture attention maps and save them (.npz)", _capture_options, _capture),
    "eval": ("perplexity and next-token accuracy (causal-compatible architectures)", _eval_options, _eval),
    "finetune": ("fine-tune with a residual variant and evaluate on held-out text", _finetune_options, _finetune),
    "embed": ("embedding probe: recall@1 and MRR of query/target halves of documents", _embed_options, _embed),
    "stream": ("streaming perplexity with a KV cache under a cache policy (StreamingLLM)", _stream_options, _stream),
    "compress": ("KV-cache compression what-if: perplexity, accuracy and KL against the dense cache for each press "
                 "and ratio", _compress_options, _compress),
    "heads": ("head classes: sink, streaming (DuoAttention) and inactive (AHON) heads, of one text or averaged "
              "over a dataset", _heads_options, _heads),
    "explain": ("why a head attends there: one score by rotary pair, by dimension and by source (embedding, each "
                "earlier attention and MLP block), and without rotation", _explain_options, _explain),
    "routes": ("contribution graph of a token (which tokens, through which heads and MLPs, feed it) and the share "
               "of the attention flow the sink key carries in each layer", _routes_options, _routes),
    "patching": ("activation patching between a clean and a corrupted text: every layer and position (or head) "
                 "of one site patched from the clean run, its effect on a metric at the last position",
                 _patching_options, _patching),
    "doctor": ("check attnviz on this machine: versions and devices, every route against stock transformers, "
               "speed against a plain forward; exits 1 if a check fails", _doctor_options, _doctor),
    "linformer": ("Linformer what-if on one layer: relative error of the output against k", _linformer_options,
                  _linformer),
    "generate": ("greedy generation with the KV cache under an architecture and a policy", _generate_options,
                 _generate),
    "report": ("one self-contained HTML file (no server, no network) of a text under several architectures: "
               "heatmap viewer, sink shifting, sink profiles", _report_options, _report),
    "reproduce": ("regenerate the papers' headline figures on this model as one PDF (sink shifting, StreamingLLM, "
                  "Gu et al.'s sink rate, k-sweep, residual variants)", _reproduce_options, _reproduce),
    "sweep": ("a grid of models x architectures x interventions x corpora x measures, one Ray task per cell, "
              "results as Parquet (resumable)", _sweep_options, _sweep),
}
ALL = "*"


def build_parser(command: str | None = ALL) -> argparse.ArgumentParser:
    """The parser; only ``command``'s options are built (every command's with the default ``ALL``)."""
    parser = _Parser(prog="attnviz", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (text, add_options, _) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text)
        if command in (name, ALL):
            add_options(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in given if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(given)
    args.argv = given  # the command as given (a report's provenance)
    if not sys.stderr.isatty() and args.command != "masks":  # progress is for people at a terminal
        from transformers.utils import logging as tf_logging

        tf_logging.disable_progress_bar()
    handler = COMMANDS[args.command][2]
    try:
        result = handler(args)
    except AttnvizError as err:
        print(f"attnviz: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # never a traceback for the user; ATTNVIZ_DEBUG=1 shows it
        if os.environ.get("ATTNVIZ_DEBUG"):
            raise
        print(f"attnviz: internal error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    if isinstance(result, int):  # the command printed its output and chose its exit status (doctor)
        return result
    if result is not None:  # None: the command printed its rows itself (JSON lines)
        print(dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
