"""``attnviz patching``: activation patching between a clean and a corrupted text
(docs/methods.md#activation-patching)."""

from __future__ import annotations

from attnviz.cli import common
from attnviz.errors import AttnvizError


def options(p):
    from attnviz.effects import patching

    common.model_args(p, source=False)
    common.intervene_args(p, bos=True)
    p.add_argument("--clean", required=True, help="the clean text")
    p.add_argument("--corrupted", required=True, help="the corrupted text (the same number of tokens)")
    p.add_argument("--answer", default=None, help="the clean run's answer token, as it follows the text (' Paris'); "
                                                  "--metric logit_diff only")
    p.add_argument("--wrong", default=None, help="the corrupted run's answer token (' Rome'); --metric logit_diff "
                                                 "only")
    p.add_argument("--site", default="resid", help=f"where to patch: {', '.join(patching.SITES)} (%(default)s)")
    p.add_argument("--metric", default="logit_diff", choices=list(patching.METRICS),
                   help="logit(answer) - logit(wrong), the KL divergence from the clean next-token distribution, "
                        "or the last query's attention on the sink key (%(default)s)")


def run(args) -> dict:
    from attnviz.effects import patching

    if args.site not in patching.SITES:  # refused before a model loads
        raise AttnvizError(f"unknown site '{args.site}': expected one of {', '.join(patching.SITES)}")
    if args.metric == "logit_diff" and (args.answer is None or args.wrong is None):
        raise AttnvizError("the logit difference needs --answer and --wrong (one token each), or choose "
                           "--metric kl or sink")
    if args.metric != "logit_diff" and (args.answer is not None or args.wrong is not None):
        raise AttnvizError(f"the {args.metric} metric reads no answer or wrong token: give --answer and --wrong "
                           "with --metric logit_diff only")
    for name in ("clean", "corrupted"):
        if not getattr(args, name).strip():
            raise AttnvizError(f"--{name} is empty: give the text")
    common.check_intervene(args)
    loaded = common.load(args)
    bar, update = common.progress("patching")
    with bar:
        result = patching.patching(loaded, args.clean, args.corrupted, args.answer, args.wrong, args.site,
                                   args.metric, common.recipe(args, loaded), on_layer=update, on_plan=bar.plan)
    return result.as_json()
