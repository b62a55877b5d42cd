"""Sinks of a long text: attnviz's statistics-only capture against a plain SDPA forward.

    python bench/long.py [--n 4096] [--repeat 1] [--model default]

Each side runs in its own process (so each peak is its own): the model is loaded (the default one unless
``--model`` names another, on the device ``attnviz.load`` chooses), then
- ``sdpa``: one stock forward of the text (transformers' SDPA attention, no maps);
- ``sinks``: ``capture(..., reduce=True)``, what ``attnviz sinks`` runs: every layer recorded,
  its softmax computed in query blocks and reduced to statistics block by block.
Peak memory is the process's peak resident size minus its resident size once the model is loaded
and has run one short pass (the host's memory: on a GPU the device's is not counted).
Ends with ``long n=<N> time_ratio=<sinks/sdpa> sinks_peak_mb=<MB> sdpa_peak_mb=<MB>`` (goals at
4,096 tokens: ratio <= 2, sinks peak <= 1,024 MB).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

from common import ids_on, sync


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def child(side: str, n: int, model: str) -> dict:
    import torch

    from attnviz import corpus, load
    from attnviz.capture import capture
    from attnviz.plan import Keep

    lm = load(model)
    # One short pass first: the first forward of a process pages in torch's kernels (~500 MB of
    # shared-library and workspace pages here), a cost of the loaded model, not of the long text.
    if side == "sdpa":
        lm.model.set_attn_implementation("sdpa")
        with torch.inference_mode():
            lm.model(input_ids=ids_on(lm.model, [1, 2, 3]))
    else:
        capture(lm, "warm up", "fwd", Keep(statistics=True))
    before = rss_mb()
    ids = corpus.head_ids(lm.tokenizer, corpus.stdlib().text, n)
    text = corpus.text_of(lm.tokenizer, ids)
    sync(lm.model)
    start = time.perf_counter()
    if side == "sdpa":  # stock transformers SDPA: is_causal, the fused kernel, no n x n mask
        with torch.inference_mode():
            lm.model(input_ids=ids_on(lm.model, ids))
        tokens = len(ids)
    else:
        cap = capture(lm, text, "fwd", Keep(statistics=True))
        tokens = cap.n_tokens
    sync(lm.model)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"side": side, "seconds": seconds, "peak_mb": peak - before, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--model", default="default", help="'default', a Hugging Face id or a saved model's folder")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.n, args.model)))
        return
    results: dict[str, list[dict]] = {"sdpa": [], "sinks": []}
    for _ in range(args.repeat):
        for side in ("sdpa", "sinks"):
            command = [sys.executable, __file__, "--child", side, "--n", str(args.n), "--model", args.model]
            out = subprocess.run(command, check=True, capture_output=True, text=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            results[side].append(row)
            print(json.dumps(row), flush=True)
    t = {side: statistics.median(r["seconds"] for r in rows) for side, rows in results.items()}
    peak = {side: max(r["peak_mb"] for r in rows) for side, rows in results.items()}
    print(f"long n={results['sinks'][0]['tokens']} time_ratio={t['sinks'] / t['sdpa']:.2f} "
          f"sinks_peak_mb={peak['sinks']:.0f} sdpa_peak_mb={peak['sdpa']:.0f}")


if __name__ == "__main__":
    main()
