"""Contributions of every layer (routes) against a plain capture of every layer's full maps, same text, same run.

    python bench/routes.py [--n 1024] [--repeat 1]

The default model is loaded once and warmed up with a short pass of each; then, alternating, ``capture`` keeps
every layer's full attention maps (what the Heatmaps page asks), and ``trace`` measures every layer's
contributions (what ``attnviz routes`` and the Routes page run). Ends with
``routes n=<N> capture_s=<s> routes_s=<s> ratio=<routes/capture>`` (the goal at 1,024 tokens: ratio <= 3).
Run it on a quiet machine: anything else running moves both sides.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()

    from attnviz import corpus, load
    from attnviz.capture import capture
    from attnviz.flow.trace import trace

    lm = load("default")
    capture(lm, "warm up", "fwd")
    trace(lm, "warm up")
    ids = corpus.head_ids(lm.tokenizer, corpus.stdlib().text, args.n)
    text = corpus.text_of(lm.tokenizer, ids)
    times: dict[str, list[float]] = {"capture": [], "routes": []}
    for _ in range(args.repeat):
        start = time.perf_counter()
        cap = capture(lm, text, "fwd")
        times["capture"].append(time.perf_counter() - start)
        del cap
        start = time.perf_counter()
        flow = trace(lm, text)
        times["routes"].append(time.perf_counter() - start)
        del flow
    capture_s, routes_s = statistics.median(times["capture"]), statistics.median(times["routes"])
    print(f"routes n={args.n} capture_s={capture_s:.2f} routes_s={routes_s:.2f} ratio={routes_s / capture_s:.2f}")


if __name__ == "__main__":
    main()
