"""The lab's default run (docs/lab.md): the time to the step where the first token becomes a sink, against a plain
training loop measured in the same run.

    python bench/lab_sink.py [--steps 4000] [--probe 250] [--kind softmax] [--arch fwd] [--seed 0] [--device cpu]
                             [--baseline-steps 50] [--out DIR]

Trains the lab's default setup (:class:`attnviz.lab.train.Setup`, with ``--kind``, ``--arch`` and ``--seed``) with a
checkpoint every ``--probe`` steps, then reads, at each checkpoint, the attention the non-trigger queries of 64 fresh
Bigram-Backcopy sequences put on the first token (the mean over heads; the checkpoint read with the engine's own
forward written out, the model's plain forward). The baseline: the same model trained ``--baseline-steps`` steps by
a plain stock loop (``model(input_ids, labels=...)``, transformers' SDPA, no recipe), in the same process. Ends with
``lab_sink steps=<S> sink_step=<step or none> sink_s=<s> step_s=<lab s/step> baseline_step_s=<s/step>
ratio=<lab/baseline>``: the time to the sink (checkpoints included), and the lab's cost a step over a plain loop's
(medians of a step's time: masks and kinds through the recipe, no checkpoint; the baseline's steps counted the same
way, the batch included, which both loops make in every step), then ``baseline=<family>/<sdpa|eager>`` (gpt-oss has
no SDPA: its baseline runs eager attention) and ``softmax_step_s=<s> ratio_softmax=<lab/that>``: the stock softmax
loop (Llama, SDPA) of the same size, the common denominator of every kind. Run it on a quiet machine;
bench/lab_step.py compares every kind's step in one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402 - the settings, read once as the CLI does
import lab_step  # noqa: E402 - the stock loop, shared with bench/lab_step.py

from attnviz.lab.emergence import FORMED as THRESHOLD  # noqa: E402 - the lab's one threshold


def baseline(setup, steps: int) -> float:
    """Seconds a step of a plain stock training loop of the same model takes (:func:`lab_step.stock_loop`: SDPA, or
    eager attention for gpt-oss, which has no SDPA; the loss transformers computes), counted as the lab's steps are
    (the time between one step's end and the next's): the batch made in the step, as :func:`train` makes it."""
    step, model, _ = lab_step.stock_loop(setup)
    device = next(model.parameters()).device
    ends = []
    for i in range(1, max(steps, 2) + 1):
        step(setup.task.batch(setup.batch, i).to(device))  # reads the loss on the host, as train() does
        common.sync(model)
        ends.append(time.perf_counter())
    return statistics.median(b - a for a, b in zip(ends, ends[1:]))


def first_token(setup, folder) -> float:
    """The attention non-trigger queries put on the first token, mean over heads and queries, at ``folder``."""
    import torch

    from attnviz.lab import models

    model = models.load(setup, folder)
    model.set_attn_implementation("eager")
    x = setup.task.batch(64, 10**6)
    quiet = ~setup.task.needs_attention(x)
    quiet[:, 0] = False
    with torch.no_grad():
        a = model(x, output_attentions=True).attentions[0][..., 0]  # (B, H, n): on key 0
    return float(a.permute(0, 2, 1)[quiet].mean())


def main() -> None:
    from attnviz.core.loading.runs import steps_of
    from attnviz.lab.tasks import BigramBackcopy
    from attnviz.lab.train import Setup, train

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=Setup.steps)
    parser.add_argument("--probe", type=int, default=250, help="a checkpoint (and a reading) every this many steps")
    parser.add_argument("--kind", default="softmax")
    parser.add_argument("--arch", default="fwd")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, choices=("cpu", "cuda"))
    parser.add_argument("--baseline-steps", type=int, default=50)
    parser.add_argument("--out", default=None, help="the run's folder (default: a temporary one)")
    args = parser.parse_args()
    setup = Setup(steps=args.steps, every=args.probe, kind=args.kind, arch=args.arch, seed=args.seed,
                  task=BigramBackcopy(seed=args.seed), device=args.device)
    base = baseline(setup, args.baseline_steps)
    from attnviz.lab import models

    own = models.family(setup.kind)
    softmax = base if own == "llama" and setup.kind == "softmax" else baseline(
        dataclasses.replace(setup, kind="softmax"), args.baseline_steps)
    with tempfile.TemporaryDirectory(prefix="attnviz-lab-") as tmp:
        out = Path(args.out or tmp)
        clock: dict[int, float] = {}
        started = time.perf_counter()
        train(setup, out, on_step=lambda step, total, loss: clock.__setitem__(step, time.perf_counter() - started))
        spent = time.perf_counter() - started
        sink_step, sink_s = None, None
        for step in steps_of(out):
            share = first_token(setup, out / f"step-{step}")
            print(f"step {step}: first-token attention {share:.3f}", flush=True)
            if sink_step is None and share > THRESHOLD:
                sink_step, sink_s = step, clock.get(step, 0.0)
    gaps = [clock[s] - clock[s - 1] for s in sorted(clock) if s - 1 in clock]
    step_s = statistics.median(gaps) if gaps else spent / setup.steps  # a step's time: the checkpoints' left out
    print(f"lab_sink steps={setup.steps} sink_step={sink_step if sink_step is not None else 'none'} "
          f"sink_s={f'{sink_s:.1f}' if sink_s is not None else 'none'} step_s={step_s:.4f} "
          f"baseline_step_s={base:.4f} baseline={own}/{'eager' if own == 'gpt_oss' else 'sdpa'} "
          f"ratio={step_s / base:.2f} softmax_step_s={softmax:.4f} ratio_softmax={step_s / softmax:.2f}")


if __name__ == "__main__":
    main()
