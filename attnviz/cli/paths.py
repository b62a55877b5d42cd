"""``attnviz paths``: path patching between blocks (docs/methods.md#path-patching): through which later block a
write makes the sink."""

from __future__ import annotations

import sys

from attnviz.cli import common


def options(p):
    from attnviz import defaults
    from attnviz.effects import paths

    given = defaults.of(paths.paths)
    common.model_args(p)
    common.intervene_args(p, bos=True)
    p.add_argument("--senders", default=given["senders"],
                   help="the senders, e.g. mlp.0,mlp.11 or embed (default: the causal scan's necessary writers)")
    p.add_argument("--receivers", default=given["receivers"],
                   help="the receivers, e.g. attn.3,keys.5,mlp.7,head; a group cut at once, keys.12-29, mlp.*, all "
                        "(the scan's removal), or parts joined by +; 'groups': attn.*, keys.*, queries.*, mlp.*, all "
                        "(default: every single receiver above each sender, and the groups); one head's keys, queries "
                        "or values: keys.27.h1, queries.27.h4, values.27.h1 (a key-value head where heads share them), "
                        "or every head of a layer, each its own path: keys.27.h*")
    p.add_argument("--value", choices=["zero", "mean"], default=given["value"],
                   help="what the receiver reads in place of the sender's write at the sink token (%(default)s)")


def run(args) -> dict:
    from attnviz.effects import paths

    text = common.text(args)
    common.check_intervene(args)
    loaded = common.load(args)
    bar, update = common.progress("path patching")  # bad names are refused before any forward
    with bar:
        result = paths.paths(loaded, text, common.recipe(args, loaded), args.senders, args.receivers, args.value,
                             on_step=update, on_plan=bar.plan)
    if result.note:  # an empty result says why, on stderr as in the JSON
        print(f"attnviz: note: {result.note}", file=sys.stderr)
    return result.as_json()
