"""Fine-tune the baseline and every residual method with the same settings, then print the table.

    .venv/bin/python scripts/residual_runs.py [--steps 25] [--out ~/.cache/attnviz/finetune] [--only method3.1,...]

Each run starts from the default model, uses the same seed, batches, schedule and held-out split
(docs/methods.md#residual-variants; `attnviz finetune`), and writes OUT/NAME with its metrics.json, which the Effects page's
"Residual methods" table reads. On a 2-core CPU a step of 4 x 64 tokens takes ~6 s, so the default
is a short run: it measures how fast each method recovers from the change, not the seed's 5 epochs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnviz import corpus, load
from attnviz.effects.evaluate import token_ids
from attnviz.effects.finetune import finetune
from attnviz.core.loading.models import cache_dir
from attnviz.core.engine.residual import METHODS, results_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--max-tokens", type=int, default=12_000)
    parser.add_argument("--out", default=str(cache_dir() / "finetune"))
    parser.add_argument("--only", default=None, help="comma-separated runs, e.g. baseline,method3.1 (default: all)")
    args = parser.parse_args()
    names = [None, *METHODS]
    if args.only:
        names = [None if n == "baseline" else n for n in args.only.split(",")]
    for name in names:
        lm = load("default")  # a fresh copy of the pretrained weights for every run
        ids = token_ids(lm, corpus.stdlib().text, args.max_tokens)
        result = finetune(lm, ids, Path(args.out) / (name or "baseline"), name, steps=args.steps,
                          seq_len=args.seq_len, batch=args.batch, lr=args.lr, save_every=args.steps + 1)
        keep = {k: result.metrics[k] for k in ("residual", "eval_perplexity", "eval_accuracy", "eval_runtime")}
        print(json.dumps({**keep, "before": result.metrics["before"]["eval_perplexity"]}), flush=True)
    for row in results_table(args.out):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
