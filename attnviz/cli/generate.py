"""``attnviz generate``: greedy generation with the KV cache under an architecture and a cache policy
(docs/methods.md#cache-policies)."""

from __future__ import annotations

from attnviz.cli import common


def options(p):
    from attnviz import defaults
    from attnviz.effects import generate

    run_ = defaults.of(generate.generate)
    common.model_args(p)
    common.intervene_args(p)
    p.add_argument("--policy", default=run_["policy"], help="dense | window(w=W) | sink(s=S, w=W) (%(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=run_["max_new_tokens"],
                   help="tokens to generate (1..128, default %(default)s)")


def run(args) -> dict:
    from attnviz.effects.generate import generate

    text = common.text(args)
    common.check_intervene(args)
    loaded = common.load(args)
    bar, update = common.progress("generate")
    with bar:
        result = generate(loaded, text, common.recipe(args, loaded), args.policy, args.max_new_tokens, record=set(),
                          on_step=update)
    return result.as_json()
