"""``attnviz explain``: score attribution of one cell or one key (docs/methods.md#score-attribution), or with
``--test`` the causal check (docs/methods.md#the-causal-check)."""

from __future__ import annotations

from attnviz.cli import common
from attnviz.errors import AttnvizError


def options(p):
    common.model_args(p)
    common.intervene_args(p, bos=True)
    p.add_argument("--layer", type=int, help="the layer (negative counts from the top)")
    p.add_argument("--head", type=int, help="the query head")
    p.add_argument("--query", type=common.position_or("all"), default="all",
                   help="the query position, or 'all': the mean over every query the mask lets see the key "
                        "(%(default)s)")
    p.add_argument("--key", type=int, help="the key position")
    p.add_argument("--test", action="store_true",
                   help="the causal check instead: remove every block's write (or --sources') at the sink token and "
                        "report the sink's attention and the perplexity before and after, the necessary writers and "
                        "their chains (docs/methods.md#the-causal-scan)")
    p.add_argument("--sources", default=None,
                   help="with --test: the sources to patch, e.g. mlp.2,mlp.11 (default: every block, the leaders "
                        "marked)")
    p.add_argument("--value", choices=["zero", "mean"], default="zero",
                   help="with --test: what replaces the source's output at the sink token (%(default)s)")


def run(args) -> dict:
    from attnviz.effects.explain import explain

    text = common.text(args)
    common.check_intervene(args)
    if args.test:
        return _causal(args, text)
    missing = [f"--{name}" for name in ("layer", "head", "key") if getattr(args, name) is None]
    if missing:
        raise AttnvizError(f"give {', '.join(missing)} (one cell's attribution), or --test (the causal check)")
    loaded = common.load(args)
    result = explain(loaded, text, common.recipe(args, loaded), layer=args.layer, head=args.head, query=args.query,
                     key=args.key)
    return result.as_json()


def _causal(args, text: str) -> dict:
    """The causal check: every block (the causal scan), or the named sources, patched at the sink token."""
    from attnviz.effects import causal

    # a bad or empty source list refused before the model loads
    sources = causal.sources_of(args.sources) if args.sources is not None else None
    loaded = common.load(args)
    recipe = common.recipe(args, loaded)
    if sources is None:  # every block: the causal scan, its necessary writers and their chains
        bar, update = common.progress("causal scan")
        with bar:
            return causal.scan(loaded, text, recipe, args.value, on_step=update, on_plan=bar.plan).as_json()
    bar, update = common.progress("causal check")
    with bar:
        checks = causal.check(loaded, text, recipe, sources, args.value, on_step=update)
    return causal.CausalReport(recipe.to_dict(), checks[0].before.tokens, checks).as_json()
