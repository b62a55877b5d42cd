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

from .errors import AttnvizError

N_ALPHA_KEYS = 8


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other bad input
        self.exit(2, f"attnviz: error: {message}\n")


def _masks(args) -> dict:
    if args.n < 1:
        raise AttnvizError(f"--n must be at least 1, got {args.n}")
    from . import arch as arch_mod

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
    else:
        text = args.text
    if not text or not text.strip():
        raise AttnvizError("the text is empty: give --text or --text-file with some words")
    return text


def _corpus(args):
    from . import corpus

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

    from .models import load

    hub_logging.set_verbosity_error()  # the one-line error below says it; no retry chatter

    return load(args.model, dtype=args.dtype, device=args.device, device_map=args.device_map,
                trust_remote_code=args.trust_remote_code,
                progress=lambda message: print(message, file=sys.stderr) if sys.stderr.isatty() else None)


def _check_intervene(args) -> None:
    """The intervention string's form, before a model is loaded (its layers and heads are checked
    against the model once it is)."""
    from . import interventions

    interventions.parse(getattr(args, "intervene", None), 10**6, 10**6)


def _intervene_json(args, loaded) -> dict:
    from . import interventions

    spec = interventions.parse(args.intervene, loaded.n_layers, loaded.n_heads).spec
    return {"intervene": spec} if spec else {}


def _prepend(args) -> str | None:
    return "bos" if getattr(args, "bos", False) else getattr(args, "prepend", None)


def _null(x: float):
    return None if math.isnan(x) else round(float(x), 6)


def sinks_report(capture, eps: float) -> dict:
    """The `attnviz sinks --json` document for a capture (all layers recorded)."""
    from . import metrics

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
        })
    return {"model": capture.meta["model"], "arch": capture.arch, "n_tokens": capture.n_tokens,
            **({"residual": capture.meta["residual"]} if capture.meta.get("residual") else {}),
            **{key: capture.meta[key] for key in ("intervene", "prepend") if capture.meta.get(key)},
            "tokens": capture.tokens, "layers": layers}


def _sinks(args) -> dict:
    from .capture import capture

    if not 0 <= args.eps <= 1:
        raise AttnvizError(f"--eps must be between 0 and 1, got {args.eps}")
    if args.corpus or args.per_doc or args.per_line:
        return _dataset_sinks(args)
    text = _text(args)
    _check_intervene(args)
    loaded = _load(args)
    return sinks_report(capture(loaded, text, args.arch, reduce=True, residual=args.residual,
                                intervene=args.intervene, prepend=_prepend(args)), args.eps)


def _dataset_sinks(args) -> dict:
    """Gu et al.'s protocol over many samples (SPEC §6): per-layer rates with 95% intervals."""
    from . import dataset

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
        result = dataset.sinks(loaded, documents, args.arch, "line" if args.per_line else "doc", args.max_len,
                               args.samples, on_progress=update, intervene=args.intervene)
    return result.as_json(args.key, eps=args.eps) | _intervene_json(args, loaded)


def _capture(args) -> dict:
    from .capture import capture

    text = _text(args)
    _check_intervene(args)
    loaded = _load(args)
    if loaded.is_encoder_decoder or args.attention not in (None, "self"):
        if args.intervene or _prepend(args):
            raise AttnvizError("--intervene, --bos and --prepend are for decoder-only models")
        return _capture_seq2seq(args, loaded, text)
    result = capture(loaded, text, args.arch or "fwd", layers=args.layers, hidden_states=args.hidden,
                     residual=args.residual, intervene=args.intervene, prepend=_prepend(args))
    path = result.save(args.out)
    return {"out": str(path), "model": result.meta["model"], "arch": result.arch,
            **({"intervene": result.meta["intervene"]} if result.meta.get("intervene") else {}),
            "n_tokens": result.n_tokens, "layers": result.layers,
            "forward_s": round(result.timing["forward_s"], 4)}


def _capture_seq2seq(args, loaded, text) -> dict:
    """Encoder-decoders: the three kinds (or the one asked for), one .npz each."""
    from . import seq2seq

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
    from .evaluate import evaluate, token_ids

    text = _corpus(args).text
    _check_intervene(args)
    loaded = _load(args)
    ids = token_ids(loaded, text, args.max_tokens)
    bar, update = _progress(f"eval {args.arch}")
    with bar:
        window = min(512, len(ids)) if args.window is None else args.window
        result = evaluate(loaded, ids, args.arch, window=window, stride=args.stride, on_window=update,
                          residual=args.residual, intervene=args.intervene)
    return result.as_json()


def _embed(args) -> dict | None:
    """One JSON document, or with ``--sweep k`` one JSON line per k, printed as each finishes."""
    from . import embedding

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
                        on_row=lambda row: print(json.dumps(row.as_json()), flush=True), on_progress=update)
    return None


def _stream(args) -> dict:
    from .evaluate import token_ids
    from .streaming import parse_policy, stream

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
            results.append(stream(loaded, ids, policy, args.arch, on_step=update, intervene=args.intervene))
    if not args.compare:
        return results[0].as_json()
    return {"model": loaded.model_id, "arch": results[0].arch, "tokens": results[0].tokens,
            "policies": [r.as_json(curve=True) for r in results]}


def _generate(args) -> dict:
    from .generate import generate

    text = _text(args)
    _check_intervene(args)
    loaded = _load(args)
    bar, update = _progress("generate")
    with bar:
        result = generate(loaded, text, args.arch, args.policy, args.max_new_tokens, record=set(),
                          on_step=update, intervene=args.intervene)
    return {"model": loaded.model_id, "arch": result.arch, "policy": result.policy, "text": result.text,
            **_intervene_json(args, loaded),
            "new_ids": result.new_ids, "prompt_tokens": len(result.prompt_ids)}


def _compress(args) -> dict:
    """KV-cache compression what-if (SPEC §13): every press at every ratio against the dense cache."""
    from .evaluate import token_ids
    from .kv import compress, presses

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
    """Head taxonomy (SPEC §14): sink, streaming and inactive heads of one text or a dataset."""
    from . import heads

    for name in ("eps", "tau_stream", "tau_inactive"):
        if getattr(args, name) < 0:
            raise AttnvizError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.samples is not None and args.samples < 2:
        raise AttnvizError(f"--samples must be at least 2 (a dataset's scores are averaged), got {args.samples}")
    dataset = not (args.text or args.text_file)  # one text given: that text; else the corpus as a dataset
    source = _corpus(args)
    loaded = _load(args)
    texts = (heads.dataset_texts(loaded, source.documents, args.samples or 20, args.max_len) if dataset
             else [source.text])
    bar, update = _progress("heads")
    with bar:
        result = heads.taxonomy(loaded, texts, args.arch, args.sink, args.window, args.eps, args.tau_stream,
                                args.tau_inactive, on_progress=update)
    return result.as_json()


def _linformer(args) -> dict:
    """Linformer what-if on one layer of a real capture (SPEC §10)."""
    from . import linformer
    from .capture import capture, parse_layers

    try:
        ks = [int(x) for x in args.ks.split(",") if x.strip()]
    except ValueError:
        raise AttnvizError(f"--ks must be whole numbers separated by commas, got '{args.ks}'") from None
    text = _text(args)
    loaded = _load(args)
    layer = parse_layers(str(args.layer), loaded.n_layers)[0]
    cap = capture(loaded, text, args.arch, layers=[layer], qkv=True, reduce=True)  # q, k, v: no n × n map needed
    results = linformer.error_curve(cap.layer_qkv(layer), cap.allowed[layer],
                                    [linformer.check_k(k, cap.n_tokens) for k in ks], args.projection)
    return {"model": loaded.model_id, "arch": cap.arch, "layer": layer, "n_tokens": cap.n_tokens,
            "projection": args.projection,
            "rows": [{"k": r.k, "error_full": round(r.error_full, 6), "error_masked": round(r.error_masked, 6)}
                     for r in results]}


def _finetune(args) -> dict:
    """Fine-tune with a residual variant (seed 003) and report the seed's eval metrics."""
    from .evaluate import token_ids
    from .finetune import check_out, finetune

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

    from .reports import html as report_mod
    from .reports import write_atomic

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
    from .reports import reproduce as repro

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

    from .sweep import run, spec

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
        print(json.dumps(result))
        raise AttnvizError(f"{summary.failed} of {summary.total} cells failed (recorded in {out}); the first: {first}")
    return result


def _key(text: str):
    """``--key``: 'auto' or a token position."""
    if text.strip().lower() == "auto":
        return "auto"
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"'{text}' is neither a token position nor 'auto'")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="attnviz", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    masks = sub.add_parser("masks", help="print each layer's boolean mask (no model needed)")
    masks.add_argument("--arch", required=True, help="architecture string, e.g. 'mask0-bidir(k=8)'")
    masks.add_argument("--layers", type=int, required=True, help="number of layers")
    masks.add_argument("--n", type=int, required=True, help="sequence length")
    masks.add_argument("--json", action="store_true", help="JSON output (the default)")

    def model_args(p, text: bool = True, corpus: bool = False):  # shared by the commands that run a model
        p.add_argument("--model", default="default", help="'default', a Hugging Face id or a local directory")
        p.add_argument("--arch", default="fwd", help="architecture string (SPEC §7)")
        p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: float32 on CPU)")
        p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
        p.add_argument("--device-map", default=None,
                       help="'auto' (or balanced, sequential): spread the model over GPUs, the CPU and disk "
                            "with accelerate, for models larger than one device")
        p.add_argument("--trust-remote-code", action="store_true", help="allow a model's own Python code")
        p.add_argument("--json", action="store_true", help="JSON output (the default)")
        source = p.add_mutually_exclusive_group(required=text)
        if text:
            source.add_argument("--text", help="the text to capture")
        if corpus or not text:
            source.add_argument("--corpus", default=None if text else "stdlib",
                                help="'stdlib' (Python's reference docs, offline) or 'stdlib:TOPIC'")
        source.add_argument("--text-file", help="read the text from this file (UTF-8)")
        return source

    def intervene_args(p, bos: bool = False):  # SPEC §12: beside the architecture
        p.add_argument("--intervene", default=None,
                       help="interventions, e.g. 'sinkscale(beta=0.3)@20-29; ablate(heads=0,3)@5': sinklogit(b=B), "
                            "sinkscale(key=K, beta=B), temperature(t=T), ablate(heads=..., how=zero|mean)")
        if bos:
            first = p.add_mutually_exclusive_group()
            first.add_argument("--bos", action="store_true", help="prepend the tokenizer's BOS token to the text")
            first.add_argument("--prepend", default=None, metavar="TOKEN", help="prepend this token to the text")

    sinks = sub.add_parser("sinks", help="attention-sink metrics of every layer and head, of a text or a dataset")
    model_args(sinks, corpus=True)
    intervene_args(sinks, bos=True)
    sinks.add_argument("--eps", type=float, default=0.3, help="sink threshold on alpha (default 0.3)")
    sinks.add_argument("--residual", default=None, help="a seed-003 residual variant (method1 ... method4.2)")
    unit = sinks.add_mutually_exclusive_group()
    unit.add_argument("--per-doc", action="store_true", help="dataset mode: one sample per document (default)")
    unit.add_argument("--per-line", action="store_true", help="dataset mode: one sample per non-empty line")
    sinks.add_argument("--max-len", type=int, default=64, help="dataset mode: first N tokens of each sample (64)")
    sinks.add_argument("--samples", type=int, default=100, help="dataset mode: at most N samples (100)")
    sinks.add_argument("--key", type=_key, default="auto",
                       help="dataset mode: the key position whose sink rate is read, or 'auto': the first key each "
                            "layer's mask leaves open to its queries (0 under fwd, m under nosink-fwd(m)); default auto")

    cap = sub.add_parser("capture", help="capture attention maps and save them (.npz)")
    model_args(cap)
    intervene_args(cap, bos=True)
    cap.add_argument("--out", required=True, help="output file (.npz)")
    cap.add_argument("--layers", default=None, help="comma-separated layers to record (default: all)")
    cap.add_argument("--hidden", action="store_true", help="also keep hidden states")
    cap.add_argument("--residual", default=None, help="a seed-003 residual variant (method1 ... method4.2)")
    cap.add_argument("--attention", choices=["self", "encoder", "decoder", "cross", "all"], default=None,
                     help="encoder-decoder models: which attention to save (default all, one .npz each)")
    cap.add_argument("--target", default=None,
                     help="encoder-decoder models: the target text (default: the model's own greedy output)")
    cap.set_defaults(arch=None)  # fwd for decoders; the stock bidir encoder for encoder-decoders

    ev = sub.add_parser("eval", help="perplexity and next-token accuracy (causal-compatible architectures)")
    model_args(ev, text=False)
    intervene_args(ev)
    ev.add_argument("--window", type=int, default=None, help="window W in tokens (default 512, or the text if shorter)")
    ev.add_argument("--stride", type=int, default=None, help="stride S <= W (default W)")
    ev.add_argument("--max-tokens", type=int, default=4096, help="evaluate at most this many tokens (default 4096)")
    ev.add_argument("--residual", default=None, help="a seed-003 residual variant: method1, method2, method3.1, "
                                                    "method3.2, method4.1, method4.2 (Llama-family models)")

    ft = sub.add_parser("finetune", help="fine-tune with a residual variant (seed 003) and evaluate on held-out text")
    model_args(ft, text=False)
    ft.add_argument("--residual", default=None, help="method1 | method2 | method3.1 | method3.2 | method4.1 | "
                                                    "method4.2 (default: the baseline, no variant)")
    ft.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    ft.add_argument("--out", required=True, help="directory to write; `--model DIR` loads it back")
    ft.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence (default 128)")
    ft.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    ft.add_argument("--lr", type=float, default=5e-5, help="peak learning rate (default 5e-5)")
    ft.add_argument("--seed", type=int, default=0, help="seed for the batches and the initialisation (default 0)")
    ft.add_argument("--max-tokens", type=int, default=60_000, help="corpus tokens to use (default 60000)")

    em = sub.add_parser("embed", help="embedding probe: recall@1 and MRR of query/target halves of documents")
    model_args(em, text=False)
    em.add_argument("--m", type=int, default=64, help="tokens per query and per target (default 64)")
    em.add_argument("--max-docs", type=int, default=None, help="use at most this many documents")
    em.add_argument("--sweep", choices=["k"], default=None,
                    help="run the named --arch (e.g. mask0-bidir) for every k; prints one JSON line per k")
    em.add_argument("--ks", default=None, help="with --sweep k: the k values, e.g. 0,4,8 (default 0..L)")

    st = sub.add_parser("stream", help="streaming perplexity with a KV cache under a cache policy (StreamingLLM)")
    model_args(st, text=False)
    intervene_args(st)
    st.add_argument("--policy", action="append", help="dense | window(w=W) | sink(s=S, w=W); repeat with --compare")
    st.add_argument("--compare", action="store_true", help="run every --policy and print each running-perplexity curve")
    st.add_argument("--max-tokens", type=int, default=1000, help="stream at most this many tokens (default 1000)")

    kv = sub.add_parser("compress", help="KV-cache compression what-if: perplexity, accuracy and KL against the "
                                         "dense cache for each press and ratio (SPEC §13)")
    model_args(kv, text=False).add_argument("--text", help="the text (default: the stdlib corpus)")
    kv.add_argument("--press", action="append",
                    help="streaming(s=4) | observed | snapkv(window=64, kernel=5) | tova | knorm | random(seed=0); "
                         "repeat for several (default: all six)")
    kv.add_argument("--ratios", default="0,0.25,0.5,0.75,0.9", help="compression ratios in [0, 1) (default "
                                                                     "0,0.25,0.5,0.75,0.9)")
    kv.add_argument("--context", type=int, default=512, help="context tokens C, prefilled and compressed (512)")
    kv.add_argument("--max-tokens", type=int, default=1024, help="use at most this many tokens (default 1024)")

    hd = sub.add_parser("heads", help="head taxonomy: sink, streaming (DuoAttention) and inactive (AHON) heads, "
                                      "of one text or averaged over a dataset (SPEC §14)")
    model_args(hd, text=False).add_argument("--text", help="one text (default: the stdlib corpus as a dataset)")
    hd.set_defaults(corpus=None)
    hd.add_argument("--samples", type=int, default=None, help="dataset mode: at most N samples (default 20)")
    hd.add_argument("--max-len", type=int, default=128, help="dataset mode: first N tokens of each sample (128)")
    hd.add_argument("--eps", type=float, default=0.3, help="sink threshold on alpha_0 (0.3)")
    hd.add_argument("--tau-stream", type=float, default=0.9, help="streaming-score threshold (0.9)")
    hd.add_argument("--tau-inactive", type=float, default=0.2, help="output-norm (AHON) threshold (0.2)")
    hd.add_argument("--sink", type=int, default=4, help="s: sink keys of the streaming pattern (4)")
    hd.add_argument("--window", type=int, default=64, help="w: recent keys of the streaming pattern (64)")

    lin = sub.add_parser("linformer", help="Linformer what-if on one layer: relative error of the output against k")
    model_args(lin)
    lin.add_argument("--layer", default="-1", help="the layer (default: the top one; negative counts from the top)")
    lin.add_argument("--ks", default="2,4,8,16", help="comma-separated k values, each 1 <= k < n (default 2,4,8,16)")
    lin.add_argument("--projection", choices=["segment", "gaussian"], default="segment")

    gen = sub.add_parser("generate", help="greedy generation with the KV cache under an architecture and a policy")
    model_args(gen)
    intervene_args(gen)
    gen.add_argument("--policy", default="dense", help="dense | window(w=W) | sink(s=S, w=W)")
    gen.add_argument("--max-new-tokens", type=int, default=20, help="tokens to generate (1..128, default 20)")
    rep = sub.add_parser("report", help="one self-contained HTML file (no server, no network) of a text under "
                                        "several architectures: heatmap viewer, sink shifting, sink profiles")
    model_args(rep)
    intervene_args(rep)
    rep.set_defaults(arch="fwd; nosink-fwd; mask0-bidir(k=8)")
    rep.add_argument("--out", required=True, help="the .html file to write")
    rep.add_argument("--size", type=int, default=256, help="map images' side in pixels, 16..512 (default 256)")
    rep.add_argument("--images", choices=["webp", "png"], default="webp",
                     help="webp: lossy, small (default); png: lossless, ~2x larger")
    rep.add_argument("--quality", type=int, default=80, help="WebP quality, 1..100 (default 80)")
    rp = sub.add_parser("reproduce", help="regenerate the papers' headline figures on this model as one PDF "
                                          "(sink shifting, StreamingLLM, Gu et al.'s sink rate, k-sweep, seed 003)")
    rp.add_argument("--model", default="default", help="'default', a Hugging Face id or a local directory")
    rp.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: float32 on CPU)")
    rp.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    rp.add_argument("--device-map", default=None, help="'auto': spread the model over devices (accelerate)")
    rp.add_argument("--trust-remote-code", action="store_true", help="allow a model's own Python code")
    rp.add_argument("--out", required=True, help="the .pdf file to write")
    rp.add_argument("--only", default=None, help="comma-separated sections: shifting, streaming, sinkrate, ksweep, "
                                                 "residual (default: all)")
    rp.add_argument("--quick", action="store_true", help="the same protocols on less data (under a minute here)")
    sw = sub.add_parser("sweep", help="a grid of models x architectures x interventions x corpora x measures, one "
                                      "Ray task per cell, results as Parquet (resumable)")
    sw.add_argument("spec", help="the spec, a TOML file (README: Sweeps)")
    sw.add_argument("--out", required=True, help="results folder (or s3://, gs:// URI): one Parquet file per cell")
    sw.add_argument("--address", default=None, help="a Ray cluster's address (default: RAY_ADDRESS, else a local Ray)")
    sw.add_argument("--workers", type=int, default=None, help="local Ray: at most this many cells at once "
                                                              "(default: the machine's CPUs)")
    sw.add_argument("--local", action="store_true", help="run the cells in this process, without Ray")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command as given (a report's provenance)
    if not sys.stderr.isatty():  # progress is for people at a terminal; scripts get one line per error
        from transformers.utils import logging as tf_logging

        tf_logging.disable_progress_bar()
    handler = {"masks": _masks, "sinks": _sinks, "capture": _capture, "eval": _eval, "embed": _embed,
               "stream": _stream, "generate": _generate, "linformer": _linformer, "compress": _compress,
               "heads": _heads, "report": _report, "reproduce": _reproduce, "sweep": _sweep,
               "finetune": _finetune}[args.command]
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
    if result is not None:  # None: the command printed its rows itself (JSON lines)
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
