"""The Effects figures of docs/benchmarks.md, computed on the default model and exported as paper PNGs.

    .venv/bin/python scripts/effects_figures.py [--out assets/effects]

Perplexity of FWD against NoSink-FWD (stdlib, 2,048 tokens, W = 512); StreamingLLM's window break
against sink + window (1,000 tokens of ``stdlib:specialnames``, as docs/methods.md#cache-policies measures); the embedding
k-sweep of MASK0-BIDIR and INPLACE-BIDIR (M = 32, 48 documents, every other k). About 15 minutes
on a 2-core CPU. Prints each figure's numbers as JSON lines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnviz import corpus, load
from attnviz.effects import embedding
from attnviz.figures import export
from attnviz.effects.evaluate import evaluate, token_ids
from attnviz.figures import k_sweep, perplexity_bars, streaming_curves
from attnviz.effects.streaming import stream

ROOT = Path(__file__).resolve().parent.parent


def save(fig, meta: dict, path: Path) -> None:
    path.write_bytes(export.figure_bytes(fig, "png", meta, preset="paper-double"))
    print(f"wrote {path}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "assets" / "effects"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lm = load("default")
    meta = {"tool": "attnviz", "model": lm.model_id}

    ids = token_ids(lm, corpus.stdlib().text, 2048)
    evals = [evaluate(lm, ids, a, window=512) for a in ("fwd", "nosink-fwd", "nosink-fwd(m=4)")]
    for e in evals:
        print(json.dumps(e.as_json()), flush=True)
    save(perplexity_bars(evals), {**meta, "figure": "perplexity", "corpus": "stdlib", "tokens": 2048},
         out / "perplexity.png")

    ids = token_ids(lm, corpus.stdlib("specialnames").text, 1000)
    streams = [stream(lm, ids, p) for p in ("dense", "window(w=128)", "sink(s=4, w=124)")]
    for s in streams:
        print(json.dumps(s.as_json()), flush=True)
    save(streaming_curves(streams), {**meta, "figure": "streaming", "corpus": "stdlib:specialnames"},
         out / "streaming.png")

    docs = corpus.stdlib().documents
    ks = list(range(0, lm.n_layers + 1, 2))
    rows = {t: embedding.sweep(lm, docs, t, ks, m=32, max_docs=48,
                               on_row=lambda r: print(json.dumps(r.as_json()), flush=True))
            for t in ("mask0-bidir", "inplace-bidir")}
    save(k_sweep(rows), {**meta, "figure": "k-sweep", "corpus": "stdlib", "m": 32, "docs": 48},
         out / "k_sweep.png")


if __name__ == "__main__":
    main()
