"""The causal scan of every block against (2L + 1) plain forwards of the same text, same run.

    python bench/scan.py [--model default] [--n 313] [--repeat 3]

The model is loaded once and warmed up; then, alternating, ``plain`` runs one plain forward of the text (SDPA, the
logits of every position: what a perplexity reads) and ``scan`` runs the whole scan without attribution's leaders
(the one unpatched forward, then one batched, resumed forward per layer). Ends with
``scan model=<M> n=<N> layers=<L> forward_s=<s> scan_s=<s> ratio=<scan / ((2L + 1) forwards)>`` (the goal: ratio
<= 0.75). The text is the first ``--n`` tokens of ``specialnames`` (Python's reference docs). Run it on a quiet
machine: anything else running moves both sides.

With ``--patching N`` it also times activation patching of the residual stream (every layer, every one of the
first N positions: one batched, resumed forward a layer) from that text into the same text with its second token
changed, against one plain forward of the N tokens: ``patching model=<M> n=<N> layers=<L> forward_s=<s>
patching_s=<s> ratio=<patching / (L N forwards)>``.
"""

from __future__ import annotations

import argparse
import statistics

from common import ids_on, timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--n", type=int, default=313)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default=None, help="cpu | cuda (default: as attnviz.load chooses)")
    parser.add_argument("--patching", type=int, default=0, help="also time activation patching on this many tokens")
    args = parser.parse_args()

    import torch

    from attnviz import corpus, load
    from attnviz.effects.causal import scan

    lm = load(args.model, device=args.device)
    ids = corpus.head_ids(lm.tokenizer, corpus.stdlib("specialnames").text, args.n)
    text = corpus.text_of(lm.tokenizer, ids)
    tensor = ids_on(lm.model, lm.tokenizer(text)["input_ids"])

    def plain():
        with torch.inference_mode():
            for _ in range(3):
                lm.model(tensor)

    def scanned():
        scan(lm, text, leaders=False)

    plain()
    scanned()
    times: dict[str, list[float]] = {"plain": [], "scan": []}
    for _ in range(args.repeat):
        times["plain"].append(timed(lm.model, plain) / 3)
        times["scan"].append(timed(lm.model, scanned))
    forward_s, scan_s = statistics.median(times["plain"]), statistics.median(times["scan"])
    L = lm.n_layers
    print(f"scan model={args.model} device={lm.model.device} n={tensor.shape[1]} layers={L} forward_s={forward_s:.3f} "
          f"scan_s={scan_s:.2f} ratio={scan_s / ((2 * L + 1) * forward_s):.2f}")
    if args.patching:
        patching_case(lm, args.model, ids[:args.patching], args.repeat)


def patching_case(lm, model: str, ids: list[int], repeat: int) -> None:
    import torch

    from attnviz import corpus
    from attnviz.effects.patching import patching

    clean = corpus.text_of(lm.tokenizer, ids)
    corrupted = corpus.text_of(lm.tokenizer, ids[:1] + [ids[1] + 1] + ids[2:])
    tensor = ids_on(lm.model, lm.tokenizer(clean)["input_ids"])

    def plain():
        with torch.inference_mode():
            lm.model(tensor)

    def patched():
        patching(lm, clean, corrupted, site="resid", metric=lambda logits: logits[:, 0])

    plain()
    patched()
    forward = statistics.median(timed(lm.model, plain) for _ in range(repeat))
    seconds = statistics.median(timed(lm.model, patched) for _ in range(repeat))
    n, L = tensor.shape[1], lm.n_layers
    print(f"patching model={model} device={lm.model.device} n={n} layers={L} forward_s={forward:.4f} "
          f"patching_s={seconds:.3f} ratio={seconds / (L * n * forward):.3f}")


if __name__ == "__main__":
    main()
