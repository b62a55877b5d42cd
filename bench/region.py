"""A full-resolution region of a long capture, from the text's start against from the capture's kept
layer inputs, on a model.

    python bench/region.py [--n 4096] [--layer 29] [--checkpoints 8] [--repeat 3] [--model default]

One process: the model (the default one unless ``--model`` names another, on the device ``attnviz.load``
chooses) captures the first N tokens of the stdlib corpus as the app does for a long text (statistics, 512-px
pooled maps) keeping ``--checkpoints`` layer inputs (at most one fewer than the model's layers: layer 0's input
is never kept); then the region of the last 96 queries x the first 96 keys (every query x every key where N is
under 96) of ``--layer`` (by default the model's last: 29 on the default model) is made
- ``from_start``: :func:`attnviz.regions.region`, the forward from the embeddings up to the layer (the
  baseline: what every region cost before);
- ``resumed``: :func:`attnviz.regions.of_capture`, from the capture's nearest kept input below the layer.
Medians of ``--repeat`` runs, alternating; the two regions are checked equal. Ends with
``region n=<N> layer=<L> from_start_s=<s> resumed_s=<s> speedup=<x> checkpoints_mb=<MB> capture_s=<s>``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import common  # noqa: F401,E402 - ATTNVIZ_* read as the CLI reads them (attnviz.settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--layer", type=int, default=None, help="default: the model's last layer")
    parser.add_argument("--checkpoints", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", default="default", help="'default', a Hugging Face id or a saved model's folder")
    args = parser.parse_args()

    from attnviz import corpus, load, regions
    from attnviz.capture import capture
    from attnviz.plan import checkpoint_bytes
    from attnviz.plan import Keep

    lm = load(args.model)
    layer = lm.n_layers - 1 if args.layer is None else args.layer
    checkpoints = min(args.checkpoints, lm.n_layers - 1)
    ids = corpus.head_ids(lm.tokenizer, corpus.stdlib().text, args.n)
    text = corpus.text_of(lm.tokenizer, ids)
    start = time.perf_counter()
    cap = capture(lm, text, "fwd", Keep(statistics=True, pool=512, checkpoints=checkpoints))
    capture_s = time.perf_counter() - start
    n = cap.n_tokens
    side = min(96, n)
    where = (layer, (n - side, n), (0, side))
    times = {"from_start": [], "resumed": []}
    made = {}
    for _ in range(args.repeat):
        for name, make in (("from_start", lambda: regions.region(lm, text, "fwd", *where)),
                           ("resumed", lambda: regions.of_capture(lm, cap, *where))):
            t0 = time.perf_counter()
            made[name] = make()
            times[name].append(time.perf_counter() - t0)
    # equal to float noise: the capture's recorded layers computed P·V block by block, the plain
    # forward's unrecorded layers by SDPA, so the kept inputs differ from SDPA's by ~1e-6
    np.testing.assert_allclose(made["resumed"].values, made["from_start"].values, atol=1e-5)
    a, b = statistics.median(times["from_start"]), statistics.median(times["resumed"])
    kept = len(cap.checkpoints) * checkpoint_bytes(lm, n) / 2**20
    print(f"# kept layer inputs: {sorted(cap.checkpoints)}")
    print(f"region n={n} layer={layer} from_start_s={a:.2f} resumed_s={b:.2f} speedup={a / b:.1f} "
          f"checkpoints_mb={kept:.0f} capture_s={capture_s:.1f}")


if __name__ == "__main__":
    main()
