"""``attnviz linformer``: the Linformer what-if on one layer of a real capture, its error against k
(docs/methods.md#linformer-what-if); the Effects page runs the same :func:`attnviz.effects.linformer.prepare`."""

from __future__ import annotations

from attnviz.cli import common


def options(p):
    from attnviz import defaults
    from attnviz.effects import linformer

    common.model_args(p)
    p.add_argument("--layer", default="-1", help="the layer (default: the top one; negative counts from the top)")
    p.add_argument("--ks", default=",".join(map(str, linformer.KS)),
                   help="comma-separated k values, each 1 <= k < n (default %(default)s)")
    p.add_argument("--projection", choices=list(linformer.PROJECTIONS),
                   default=defaults.one(linformer.whatif, "method"))


def run(args) -> dict:
    from attnviz import options
    from attnviz.effects import linformer

    ks = options.ks(args.ks)
    text = common.text(args)
    loaded = common.load(args)
    return linformer.prepare(loaded, text, common.recipe(args, loaded), args.layer, ks, args.projection).run().as_json()
