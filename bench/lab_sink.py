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
(medians of a step's time: masks and kinds through the recipe, no checkpoint). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402,F401 - the settings, read once as the CLI does

from attnviz.lab.emergence import FORMED as THRESHOLD  # noqa: E402 - the lab's one threshold


def baseline(setup, steps: int) -> float:
    """Seconds a step of a plain stock training loop of the same model (SDPA, the loss transformers computes), with
    the setup's optimizer."""
    from attnviz.lab.train import OPTIMIZERS, build, device_of

    device = device_of(setup)
    model = build(setup).to(device)
    model.set_attn_implementation("sdpa")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = OPTIMIZERS[setup.optimizer](setup, params)
    model.train()
    times = []
    for step in range(1, steps + 1):
        x = setup.task.batch(setup.batch, step).to(device)
        started = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        common.sync(model)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


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
          f"baseline_step_s={base:.4f} ratio={step_s / base:.2f}")


if __name__ == "__main__":
    main()
