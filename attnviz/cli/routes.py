"""``attnviz routes``: a token's contribution graph and the sink's share of the attention flow
(docs/methods.md#routes)."""

from __future__ import annotations

from attnviz.cli import common


def options(p):
    from attnviz import defaults, flow

    own = defaults.of(flow.routes)
    common.model_args(p)
    common.intervene_args(p, bos=True)
    p.add_argument("--token", type=int, default=own["token"],
                   help="the token whose routes are traced (negative counts from the end; %(default)s: the last)")
    p.add_argument("--threshold", type=float, default=own["threshold"],
                   help="keep edges whose contribution is at least this (%(default)s, Ferrando & Voita's)")
    p.add_argument("--heads", choices=["split", "sum"], default=own["heads"],
                   help="attention edges one per head, or the heads summed (%(default)s)")
    p.add_argument("--renormalise", action="store_true", default=own["renormalise"],
                   help="divide the edges kept into each node by their sum (the LLM Transparency Tool's "
                        "renormalising threshold); without it kept edges keep their contributions")


def run(args) -> dict:
    from attnviz import flow

    text = common.text(args)
    common.check_intervene(args)
    flow.check(args.threshold, args.heads)
    loaded = common.load(args)
    bar, update = common.progress("routes")
    with bar:
        graph = flow.routes(loaded, text, common.recipe(args, loaded), args.token, args.threshold, args.heads,
                            on_layer=update, renormalise=args.renormalise)
    return graph.as_json()
