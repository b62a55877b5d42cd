"""``attnviz compress``: the KV-cache compression what-if, every press at every ratio against the dense cache
(docs/methods.md#kv-cache-compression)."""

from __future__ import annotations

from attnviz.cli import common


def options(p):
    from attnviz import defaults
    from attnviz.kv import compress, presses

    run_ = defaults.of(compress.compress)
    common.model_args(p, text=False).add_argument("--text", help="the text (default: the stdlib corpus)")
    p.add_argument("--press", action="append",
                   help=f"{' | '.join(presses.DEFAULTS)}; repeat for several (default: all {len(presses.DEFAULTS)})")
    p.add_argument("--ratios", default=",".join(f"{r:g}" for r in run_["ratios"]),
                   help="compression ratios in [0, 1), separated by commas (default %(default)s)")
    p.add_argument("--context", type=int, default=run_["context"],
                   help="context tokens C, prefilled and compressed (%(default)s)")
    p.add_argument("--max-tokens", type=int, default=compress.MAX_TOKENS,
                   help="use at most this many tokens (default %(default)s)")


def run(args) -> dict:
    from attnviz import options
    from attnviz.effects.evaluate import token_ids
    from attnviz.kv import compress, presses

    chosen = [presses.parse(p) for p in (args.press or presses.DEFAULTS)]
    ratios = options.ratios(args.ratios)
    text = common.corpus(args).text
    loaded = common.load(args)
    ids = token_ids(loaded, text, args.max_tokens)
    bar, update = common.progress("compress")
    with bar:
        common.kindless(args, "KV-cache compression")
        result = compress.compress(loaded, ids, args.context, chosen, ratios, args.arch, on_step=update)
    return result.as_json()
