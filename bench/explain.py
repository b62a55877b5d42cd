"""Score attribution on a long text against a plain capture of the same text, in one process.

    python bench/explain.py [--n 2048] [--repeat 3] [--model default]

On a model (the default one unless ``--model`` names another, on the device ``attnviz.load`` chooses), a text of
``--n`` tokens from Python's reference docs:
- ``capture``: ``attnviz.capture(lm, text, "fwd")``, the default capture (every layer's full maps);
- ``cell``: ``attnviz.explain`` of one score (the last layer, head 3 or the last head where there are fewer:
  layer 29, head 3 on the default model; query n-1, key 0): one forward with the residual stream kept, then the
  attribution;
- ``key``: the same for key 0 over every query that sees it (``query="all"``);
- ``view``: the query-key view of that head on an already recorded residual stream (transform, PCA and
  the Plotly figure; without Plotly installed, as on a GPU machine here, the view alone).
Medians of ``--repeat`` runs. Ends with ``explain n=<N> cell_ratio=<cell/capture> key_ratio=<key/capture>
view_s=<s>`` (goals: both ratios <= 1.5; the view within 2 s). Measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # ATTNVIZ_* read as the CLI reads them (attnviz.settings)


def timed(model, fn):
    """(seconds, result) of ``fn()``, the device's queued work included."""
    common.sync(model)
    start = time.perf_counter()
    out = fn()
    common.sync(model)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", default="default", help="'default', a Hugging Face id or a saved model's folder")
    args = parser.parse_args()
    import attnviz
    from attnviz import corpus
    from attnviz.effects.explain import KeptForward, query_key_view

    try:  # the view's figure needs Plotly, which a GPU machine may lack: the view is then timed without it
        from attnviz.figures.why import query_key_figure
    except ImportError:
        query_key_figure = None

    lm = attnviz.load(args.model)
    layer, head = lm.n_layers - 1, min(3, lm.n_heads - 1)
    ids = corpus.head_ids(lm.tokenizer, corpus.stdlib().text, args.n)
    text = corpus.text_of(lm.tokenizer, ids)
    attnviz.capture(lm, "warm up", "fwd")
    times: dict[str, list[float]] = {"capture": [], "cell": [], "key": [], "view": []}
    for _ in range(args.repeat):
        t, cap = timed(lm.model, lambda: attnviz.capture(lm, text, "fwd"))
        times["capture"].append(t)
        n = cap.n_tokens
        del cap
        cell = dict(layer=layer, head=head, key=0)
        times["cell"].append(timed(lm.model, lambda: attnviz.explain(lm, text, "fwd", query=n - 1, **cell))[0])
        times["key"].append(timed(lm.model, lambda: attnviz.explain(lm, text, "fwd", query="all", **cell))[0])
        kept = KeptForward(lm, text, "fwd")
        draw = query_key_figure or (lambda view: view)
        times["view"].append(timed(lm.model, lambda: draw(query_key_view(kept, layer, head)))[0])
        print({k: round(v[-1], 3) for k, v in times.items()}, flush=True)
    m = {k: statistics.median(v) for k, v in times.items()}
    print(f"explain n={n} capture_s={m['capture']:.2f} cell_s={m['cell']:.2f} key_s={m['key']:.2f} "
          f"cell_ratio={m['cell'] / m['capture']:.2f} key_ratio={m['key'] / m['capture']:.2f} view_s={m['view']:.2f}")


if __name__ == "__main__":
    main()
