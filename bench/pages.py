"""How long the app's figures take at N tokens, against the capture that feeds them (same run).

    python bench/pages.py --n 1024

A page stays responsive when moving a slider (figures only; captures are cached) costs a fraction
of a capture. Prints each figure's median time over ``--repeat`` runs and its JSON size, and ends
with ``figures_vs_capture N=<N> heatmap_ratio=<heatmap/capture> sinks_page_ratio=<sinks figures/capture>``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from attnviz import capture, load
from attnviz.figures import allocation_bars, alpha_grid, heatmap, key_profile, overview, sink_grid, sink_map
import common  # noqa: F401,E402 - ATTNVIZ_* read as the CLI reads them (attnviz.settings)

TEXT = "Attention sinks take a large share of attention whatever the token means, mostly the first one. "


def timed(fn, repeat: int):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    lm = load("default")
    ids = lm.tokenizer(TEXT * (args.n // 15 + 1))["input_ids"][: args.n]
    text = lm.tokenizer.decode(ids)
    t_capture, cap = timed(lambda: capture(lm, text, "fwd"), 1)
    print(f"capture                N={cap.n_tokens} time_s={t_capture:.3f}")
    t_heat, fig = timed(lambda: heatmap(cap, 29, 3), args.repeat)
    print(f"heatmap                time_s={t_heat:.3f} json_kb={len(fig.to_json()) / 1024:.0f}")
    t_over, fig = timed(lambda: (cap._memo.clear(), overview(cap))[1], args.repeat)
    print(f"overview               time_s={t_over:.3f} json_kb={len(fig.to_json()) / 1024:.0f}")

    def sinks_page():
        cap._summaries.clear()  # the first visit pays for the per-layer statistics
        cap._memo.clear()
        return [sink_map(cap), key_profile(cap, 0), alpha_grid(cap, 0), sink_grid(cap, 0), allocation_bars(cap)]

    t_sinks, figs = timed(sinks_page, args.repeat)
    print(f"sinks_page_figures     time_s={t_sinks:.3f} json_kb={sum(len(f.to_json()) for f in figs) / 1024:.0f}")
    t_map, fig = timed(lambda: (cap._summaries.clear(), sink_map(cap))[1], args.repeat)  # where the sinks are, alone
    print(f"sink_map               time_s={t_map:.3f} json_kb={len(fig.to_json()) / 1024:.0f}")
    print(f"figures_vs_capture N={cap.n_tokens} heatmap_ratio={t_heat / t_capture:.3f} "
          f"sinks_page_ratio={t_sinks / t_capture:.3f}")


if __name__ == "__main__":
    main()
