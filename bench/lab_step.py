"""A lab training step against a plain stock loop, for every attention kind, in one run (docs/benchmarks.md#a-lab-step).

    python bench/lab_step.py [--steps 60] [--warmup 5] [--kinds softmax,sink(logit=0),...] [--device cpu]
                             [--threads N] [--cpu-time] [--width 64] [--heads 4] [--batch 32] [--length 64]
                             [--stock-mlps run|skip]

For each kind, the lab's step (:func:`attnviz.lab.train.one_step`: the forward through the recipe, its mask and kind,
the loss, the backward, AdamW and the schedule) of the lab's default setup, and the step of a plain stock loop of the
same model (``model(input_ids, labels=...)``, the same optimizer and schedule, no recipe): transformers' SDPA, except
for gpt-oss (``sink``), which has no SDPA: its stock loop runs transformers' eager attention. The stock softmax loop
(Llama, SDPA) is the common denominator of every kind. Every loop is built first, then the steps are taken in
rounds, one step of each loop a round, so that a busy machine slows each alike; the batch of a step is made before
its clock starts and timed on its own (the task makes it in a Python loop over positions, the same work in the lab
and the stock loop). One line a kind,
``lab_step kind=<k> stock=<family>/<sdpa|eager> lab_s=<s> stock_s=<s> ratio_family=<lab/stock>
ratio_softmax=<lab/stock softmax> ratio_softmax_batch=<the same, the batch counted on both sides>``, medians,
then ``lab_step kinds=<N> softmax_s=<stock softmax s> batch_s=<s> worst=<kind> worst_ratio_softmax=<r>``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402 - the settings, read once as the CLI does

KINDS = ("softmax", "sink(logit=0)", "sink", "softpick", "sigmoid", "gate")


def default_kinds() -> list[str]:
    """Every kind the lab trains (a kind registered later, relu, included), gate(headwise) left out (refused)."""
    from attnviz.core.spec import kinds

    extra = [name for name in kinds.names() if name not in {k.split("(")[0] for k in KINDS}]
    return list(KINDS) + extra


def lab_loop(setup):
    """The lab's step of ``setup``: a function of the batch."""
    from attnviz import recipe
    from attnviz.core.engine import prepare
    from attnviz.core.loading.models import LoadedModel
    from attnviz.lab.train import build, device_of, one_step, optimizer_of

    model = build(setup).to(device_of(setup))
    prepare(model)
    loaded = LoadedModel(model, setup.tokenizer(), "lab", None, 0.0)
    built = recipe.build(loaded, setup.arch)
    optimizer, schedule = optimizer_of(setup, model)
    model.train()
    return lambda x: float(one_step(built, loaded, optimizer, schedule, x)), model


def stock_loop(setup, mlps: str = "run"):
    """A plain stock loop of the same model: transformers' SDPA, or its eager attention where the family has no
    SDPA (gpt-oss). Without MLPs (the lab's default) its zero and frozen MLPs run, as plain transformers runs them
    (``mlps="run"``), or are skipped as the lab skips them (``"skip"``: the attention's cost alone). Returns the
    step, the model and the attention it runs."""
    from attnviz.lab import models
    from attnviz.lab.train import build, device_of, optimizer_of

    model = build(setup).to(device_of(setup))  # the lab's build skips its zero MLPs
    if mlps == "run":
        models.stock_mlps(model)
    attention = "eager" if models.family(setup.kind) == "gpt_oss" else "sdpa"
    model.set_attn_implementation(attention)
    optimizer, schedule = optimizer_of(setup, model)
    model.train()

    def step(x):
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        return float(loss.detach())

    return step, model, attention


def main() -> None:
    import torch

    from attnviz.lab import models
    from attnviz.lab.tasks import BigramBackcopy
    from attnviz.lab.train import Setup, device_of

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60, help="timed steps of each loop")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps of each loop first")
    parser.add_argument("--kinds", default=None, help="comma-separated (default: every kind the lab trains)")
    parser.add_argument("--device", default=None, choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's own)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time each step by the process's CPU time (steadier on a busy machine; with --threads 1)")
    parser.add_argument("--width", type=int, default=Setup.width)
    parser.add_argument("--heads", type=int, default=Setup.heads)
    parser.add_argument("--batch", type=int, default=Setup.batch)
    parser.add_argument("--length", type=int, default=BigramBackcopy.length)
    parser.add_argument("--stock-mlps", default="run", choices=("run", "skip"),
                        help="the stock loops' zero MLPs (attention only): run, as plain transformers does, or "
                             "skipped as the lab skips them")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    wanted = default_kinds() if args.kinds is None else [k.strip() for k in args.kinds.split(",") if k.strip()]
    task = BigramBackcopy(length=args.length)

    def setup_of(kind):
        return Setup(kind=kind, width=args.width, heads=args.heads, batch=args.batch, task=task, device=args.device)

    loops = {"stock softmax": stock_loop(setup_of("softmax"), args.stock_mlps)[0]}
    names = {}
    for kind in wanted:
        setup = setup_of(kind)
        stock, _, attention = stock_loop(setup, args.stock_mlps)
        loops[f"lab {setup.kind}"], _ = lab_loop(setup)
        loops[f"stock {setup.kind}"] = stock
        names[setup.kind] = f"{models.family(setup.kind)}/{attention}"
    device = device_of(setup_of("softmax"))
    clock = time.process_time if args.cpu_time else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in loops}
    batch_times = []
    for step in range(1, args.warmup + args.steps + 1):
        started = clock()
        x = task.batch(args.batch, step).to(device)
        batch_times.append(clock() - started)
        for name, loop in loops.items():  # one step of every loop a round: a busy machine slows each alike
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = clock()
            loop(x)  # reads the loss on the host: the step's work is done when it returns
            if step > args.warmup:
                times[name].append(clock() - started)
    median = {name: statistics.median(spent) for name, spent in times.items()}
    batch = statistics.median(batch_times)
    softmax = median["stock softmax"]
    worst = None
    for kind, family in names.items():
        lab, stock = median[f"lab {kind}"], median[f"stock {kind}"]
        ratio = lab / softmax
        worst = max(worst or (ratio, kind), (ratio, kind))
        print(f"lab_step kind={kind} stock={family} lab_s={lab:.4f} stock_s={stock:.4f} ratio_family={lab / stock:.2f} "
              f"ratio_softmax={ratio:.2f} ratio_softmax_batch={(lab + batch) / (softmax + batch):.2f}", flush=True)
    if "sink" in names:
        print("# gpt-oss (sink) has no SDPA in transformers: its stock loop runs eager attention", flush=True)
    print(f"lab_step kinds={len(names)} stock_mlps={args.stock_mlps} softmax_s={softmax:.4f} batch_s={batch:.4f} "
          f"worst={worst[1]} worst_ratio_softmax={worst[0]:.2f}")


if __name__ == "__main__":
    main()
