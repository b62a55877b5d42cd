"""``attnviz eval``: perplexity and next-token accuracy under an architecture (docs/methods.md#evaluation)."""

from __future__ import annotations

from attnviz.cli import common


def options(p):
    from attnviz import defaults
    from attnviz.effects import evaluate

    run_ = defaults.of(evaluate.evaluate)
    common.model_args(p, text=False)
    common.intervene_args(p)
    p.add_argument("--window", type=int, default=None,
                   help=f"window W in tokens (default {run_['window']}, or the text if shorter)")
    p.add_argument("--stride", type=int, default=None, help="stride S <= W (default W)")
    p.add_argument("--max-tokens", type=int, default=run_["max_tokens"],
                   help="evaluate at most this many tokens (default %(default)s)")
    p.add_argument("--residual", default=None, help=common.RESIDUAL_HELP)


def run(args) -> dict:
    from attnviz.effects.evaluate import DEFAULT_WINDOW, evaluate, token_ids

    text = common.corpus(args).text
    common.check_intervene(args)
    loaded = common.load(args)
    ids = token_ids(loaded, text, args.max_tokens)
    bar, update = common.progress(f"eval {args.arch}")
    with bar:
        window = min(DEFAULT_WINDOW, len(ids)) if args.window is None else args.window
        result = evaluate(loaded, ids, common.recipe(args, loaded), window=window, stride=args.stride,
                          on_window=update)
    return result.as_json()
