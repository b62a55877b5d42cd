"""``attnviz train``: train a small decoder from scratch under a mask and an attention kind, whole checkpoints as
Hugging Face folders in ``--out``, resumed from the last one when run again (docs/lab.md)."""

from __future__ import annotations

from attnviz.cli import common
from attnviz.errors import AttnvizError


def options(p):
    from attnviz.core.spec import kinds
    from attnviz.lab.tasks import TASKS, BigramBackcopy
    from attnviz.lab.train import MOMENTUM, OPTIMIZERS, SEEDS, WEIGHT_DECAY, Setup

    setup = Setup.__dataclass_fields__

    def default(fields, name):
        f = fields[name]
        return f.default

    p.add_argument("--out", required=True, help="the run's folder: step-N checkpoints; the same command again "
                                                "resumes from the last one")
    p.add_argument("--kind", default=default(setup, "kind"), help=f"attention kind: {kinds.help(trained=True)} "
                   "(docs/methods.md#attention-kinds; default %(default)s)")
    p.add_argument("--arch", default=default(setup, "arch"), help="the mask, as an architecture string "
                   "(docs/methods.md#the-call-syntax; default %(default)s)")
    p.add_argument("--positions", default=default(setup, "positions"), help="positions: rope (the only one)")
    for name, what in (("layers", "decoder layers"), ("width", "hidden size"), ("heads", "attention heads"),
                       ("steps", "optimizer steps"), ("batch", "sequences per step"), ("warmup", "warm-up steps"),
                       ("every", "a checkpoint every this many steps (log-spaced before)")):
        p.add_argument(f"--{name}", type=int, default=default(setup, name), help=f"{what} (default %(default)s)")
    p.add_argument("--seed", type=seed, default=default(setup, "seed"),
                   help=f"seed of the weights and the batches, 0 to {SEEDS - 1} (default %(default)s)")
    p.add_argument("--mlp", action="store_true", help="with MLPs (default: attention only, the MLP zero and frozen)")
    p.add_argument("--lr", type=float, default=default(setup, "lr"), help="peak learning rate (default %(default)s)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default=default(setup, "optimizer"),
                   help="adamw (decoupled weight decay), adam (no weight decay) or sgd (with momentum), each at --lr "
                        "with the same warm-up (docs/lab.md#optimizers; default %(default)s)")
    p.add_argument("--weight-decay", type=float, default=default(setup, "weight_decay"),
                   help="adamw's decoupled weight decay or sgd's L2 term; refused with adam (default: the "
                        f"optimizer's, {', '.join(f'{k} {v:g}' for k, v in WEIGHT_DECAY.items())})")
    p.add_argument("--momentum", type=float, default=default(setup, "momentum"),
                   help=f"sgd's momentum, refused with the others (default {MOMENTUM:g} with sgd)")
    p.add_argument("--task", choices=tuple(t.option for t in TASKS.values()), default=BigramBackcopy.option,
                   help="bigram: Bigram-Backcopy; repeat: repeated random tokens (train it with --layers 2); text: "
                        "next-token prediction on text (docs/lab.md#tasks-and-tokenizers; default %(default)s)")
    # the task's options default to the chosen task's own (None here): an option the task does not take is refused
    p.add_argument("--text-file", default=None, help="--task text: a UTF-8 file (default: the stdlib corpus)")
    p.add_argument("--tokenizer", choices=("default", "bytes"), default=None,
                   help="--task text: bytes, or the default model's tokenizer (default bytes)")
    def own(name):  # each task's own default of an option, read from the registry's dataclasses
        return ", ".join(f"{t.option} {t.__dataclass_fields__[name].default}" for t in TASKS.values()
                         if name in t.__dataclass_fields__)

    p.add_argument("--vocab", type=int, default=None, help="tokens, BOS (and Bigram-Backcopy's triggers) included "
                   f"(default: the task's, {own('vocab')})")
    p.add_argument("--triggers", type=int, default=None, help=f"Bigram-Backcopy's triggers (default: {own('triggers')})")
    p.add_argument("--p-trigger", type=float, default=None, help="Bigram-Backcopy's probability of a trigger after an "
                   f"ordinary token, at least 0 and below 1 (default: {own('p_trigger')})")
    p.add_argument("--length", type=int, default=None, help=f"tokens a sequence (default: the task's, {own('length')})")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: a GPU when there is one")


def seed(text: str) -> int:
    """An argparse type: a seed, a whole number from 0 below :data:`attnviz.lab.train.SEEDS`."""
    import argparse

    from attnviz.lab.train import SEEDS

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if not 0 <= value < SEEDS:
        raise argparse.ArgumentTypeError(f"a seed is a whole number from 0 to {SEEDS - 1}, not {value}")
    return value


def setup_of(args):
    import dataclasses

    from attnviz.lab.tasks import TASKS
    from attnviz.lab.train import Setup

    made = next(t for t in TASKS.values() if t.option == args.task)  # the registry's task of that option
    options = {"source": "--text-file", "tokenizer": "--tokenizer", "vocab": "--vocab", "triggers": "--triggers",
               "length": "--length", "p_trigger": "--p-trigger"}
    given = {k: getattr(args, "text_file" if k == "source" else k) for k in options}
    given = {k: v for k, v in given.items() if v is not None}  # the others: the task's own defaults
    known = {f.name for f in dataclasses.fields(made)}
    foreign = [options[k] for k in given if k not in known]
    if foreign:
        takes = ", ".join(options[k] for k in options if k in known) or "none of them"
        raise AttnvizError(f"{foreign[0]} is not an option of --task {args.task} (it takes {takes})")
    task = made(**given, seed=args.seed)
    return Setup(layers=args.layers, width=args.width, heads=args.heads, mlp=args.mlp, kind=args.kind,
                 arch=args.arch, positions=args.positions, steps=args.steps, batch=args.batch, lr=args.lr,
                 weight_decay=args.weight_decay, optimizer=args.optimizer, momentum=args.momentum, warmup=args.warmup,
                 seed=args.seed, every=args.every, task=task, device=args.device)


def shown(bar, update, step: int, total: int, loss: float) -> None:
    """The step and the loss: on the bar (a terminal), in each progress line (elsewhere)."""
    bar.description = f"{bar.description.split(', loss')[0]}, loss {loss:.3f}"
    bar.set_postfix(loss=f"{loss:.3f}")
    update(step, total)


def run(args) -> dict:
    import time

    from attnviz.core.loading import runs
    from attnviz.lab.train import run_folder, train

    if not args.out.strip():
        raise AttnvizError("--out is empty: name the run's folder")
    out = run_folder(args.out)
    setup = setup_of(args)
    started = time.perf_counter()
    bar, update = common.progress(f"train {setup.kind} {setup.arch}")
    try:
        with bar:
            end = train(setup, out, on_step=lambda step, total, loss: shown(bar, update, step, total, loss))
    except KeyboardInterrupt:
        kept = runs.last(out)
        what = f"the checkpoints up to {kept.name} are kept in {out}" if kept else f"no checkpoint in {out} yet"
        raise AttnvizError(f"interrupted: {what}; run the same command again to resume") from None
    meta = runs.meta(end)
    return {"out": str(out), "last": str(end), "step": meta["step"], "loss": meta["loss"], "hash": meta["hash"],
            "recipe": meta["recipe"], "checkpoints": runs.steps_of(out),
            "seconds": round(time.perf_counter() - started, 3)}
