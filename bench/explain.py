"""Score attribution on a long text against a plain capture of the same text, in one process.

    python bench/explain.py [--n 2048] [--repeat 3]

On the default model, a text of ``--n`` tokens from Python's reference docs:
- ``capture``: ``attnviz.capture(lm, text, "fwd")``, the default capture (every layer's full maps);
- ``cell``: ``attnviz.explain`` of one score (layer 29, head 3, query n-1, key 0): one forward with the
  residual stream kept, then the attribution;
- ``key``: the same for key 0 over every query that sees it (``query="all"``);
- ``view``: the query-key view of that head on an already recorded residual stream (transform, PCA and
  the Plotly figure).
Medians of ``--repeat`` runs. Ends with ``explain n=<N> cell_ratio=<cell/capture> key_ratio=<key/capture>
view_s=<s>`` (goals: both ratios <= 1.5; the view within 2 s). Measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
import common  # noqa: F401,E402 - ATTNVIZ_* read as the CLI reads them (attnviz.settings)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    import attnviz
    from attnviz import corpus
    from attnviz.effects.explain import KeptForward, query_key_view
    from attnviz.figures.why import query_key_figure

    lm = attnviz.load("default")
    ids = corpus.head_ids(lm.tokenizer, corpus.stdlib().text, args.n)
    text = corpus.text_of(lm.tokenizer, ids)
    attnviz.capture(lm, "warm up", "fwd")
    times: dict[str, list[float]] = {"capture": [], "cell": [], "key": [], "view": []}
    for _ in range(args.repeat):
        t, cap = timed(lambda: attnviz.capture(lm, text, "fwd"))
        times["capture"].append(t)
        n = cap.n_tokens
        del cap
        times["cell"].append(timed(lambda: attnviz.explain(lm, text, "fwd", layer=29, head=3, query=n - 1, key=0))[0])
        times["key"].append(timed(lambda: attnviz.explain(lm, text, "fwd", layer=29, head=3, query="all", key=0))[0])
        kept = KeptForward(lm, text, "fwd")
        times["view"].append(timed(lambda: query_key_figure(query_key_view(kept, 29, 3)))[0])
        print({k: round(v[-1], 3) for k, v in times.items()}, flush=True)
    m = {k: statistics.median(v) for k, v in times.items()}
    print(f"explain n={n} capture_s={m['capture']:.2f} cell_s={m['cell']:.2f} key_s={m['key']:.2f} "
          f"cell_ratio={m['cell'] / m['capture']:.2f} key_ratio={m['key'] / m['capture']:.2f} view_s={m['view']:.2f}")


if __name__ == "__main__":
    main()
