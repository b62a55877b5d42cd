"""``attnviz finetune``: fine-tune with a residual variant (seed 003) and report the seed's held-out metrics
(docs/methods.md#residual-variants)."""

from __future__ import annotations

from attnviz.cli import common
from attnviz.errors import AttnvizError


def options(p):
    from attnviz import defaults
    from attnviz.effects import finetune

    run_ = defaults.of(finetune.finetune)
    common.model_args(p, text=False)
    p.add_argument("--residual", default=None, help=common.RESIDUAL_HELP + "; default: the baseline, no variant")
    p.add_argument("--steps", type=int, default=run_["steps"], help="optimizer steps (default %(default)s)")
    p.add_argument("--out", required=True, help="directory to write; `--model DIR` loads it back")
    p.add_argument("--seq-len", type=int, default=run_["seq_len"], help="tokens per training sequence (%(default)s)")
    p.add_argument("--batch", type=int, default=run_["batch"], help="sequences per step (default %(default)s)")
    p.add_argument("--lr", type=float, default=run_["lr"], help="peak learning rate (default %(default)s)")
    p.add_argument("--seed", type=int, default=run_["seed"], help="seed for the batches and the initialisation "
                                                                 "(default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=finetune.MAX_TOKENS, help="corpus tokens to use (%(default)s)")


def run(args) -> dict:
    from attnviz.effects.evaluate import token_ids
    from attnviz.effects.finetune import check_out, finetune

    if args.steps <= 0:
        raise AttnvizError(f"--steps must be positive, got {args.steps}")
    check_out(args.out)
    text = common.corpus(args).text
    loaded = common.load(args)
    ids = token_ids(loaded, text, args.max_tokens)
    bar, update = common.progress(f"finetune {args.residual or 'baseline'}")
    with bar:
        common.kindless(args, "fine-tuning")
        result = finetune(loaded, ids, args.out, args.residual, args.arch, args.steps, args.seq_len, args.batch,
                          args.lr, args.seed, on_step=lambda step, total, loss: (update(step, total),
                                                                                 bar.set_postfix(loss=f"{loss:.3f}")))
    if result.interrupted:
        raise AttnvizError(f"interrupted after {result.steps} steps; the last complete checkpoint is in {result.out}")
    return result.as_json()
