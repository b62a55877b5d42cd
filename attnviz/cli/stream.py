"""``attnviz stream``: streaming perplexity with a KV cache under cache policies (docs/methods.md#cache-policies)."""

from __future__ import annotations

from attnviz.cli import common
from attnviz.errors import AttnvizError


def options(p):
    from attnviz.effects import streaming

    common.model_args(p, text=False)
    common.intervene_args(p)
    p.add_argument("--policy", action="append", help=f"{streaming.POLICIES.usage()}; repeat with --compare")
    p.add_argument("--compare", action="store_true", help="run every --policy and print each running-perplexity curve")
    p.add_argument("--max-tokens", type=int, default=streaming.MAX_TOKENS,
                   help="stream at most this many tokens (default %(default)s)")


def run(args) -> dict:
    from attnviz.effects.evaluate import token_ids
    from attnviz.effects.streaming import Comparison, parse_policy, stream

    policies = [parse_policy(p) for p in (args.policy or ["dense"])]
    if len(policies) > 1 and not args.compare:
        raise AttnvizError("several --policy values need --compare")
    text = common.corpus(args).text
    common.check_intervene(args)
    loaded = common.load(args)
    ids = token_ids(loaded, text, args.max_tokens)
    for policy in policies:  # every policy is checked before the first one runs
        policy.check(loaded, len(ids))
    results = []
    for policy in policies:
        bar, update = common.progress(f"stream {policy.spec}")
        with bar:
            results.append(stream(loaded, ids, policy, common.recipe(args, loaded), on_step=update))
    return Comparison(loaded.model_id, results).as_json() if args.compare else results[0].as_json()
