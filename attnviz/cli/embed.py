"""``attnviz embed``: the embedding probe (recall@1 and MRR), or its sweep over k (docs/methods.md#evaluation)."""

from __future__ import annotations

from attnviz.cli import common
from attnviz.errors import AttnvizError


def options(p):
    from attnviz import defaults
    from attnviz.effects import embedding

    run_ = defaults.of(embedding.probe)
    common.model_args(p, text=False)
    p.add_argument("--m", type=int, default=run_["m"], help="tokens per query and per target (default %(default)s)")
    p.add_argument("--max-docs", type=int, default=run_["max_docs"], help="use at most this many documents (all)")
    p.add_argument("--sweep", choices=["k"], default=None,
                   help="run the named --arch (e.g. mask0-bidir) for every k; prints one JSON line per k")
    p.add_argument("--ks", default=None, help="with --sweep k: the k values, e.g. 0,4,8 (default 0..L)")


def run(args) -> dict | None:
    """One JSON document, or with ``--sweep k`` one JSON line per k, printed as each finishes."""
    from attnviz.effects import embedding

    if args.max_docs is not None and args.max_docs < 2:
        raise AttnvizError(f"--max-docs must be at least 2 (the probe ranks targets), got {args.max_docs}")
    if args.sweep is None and args.ks is not None:
        raise AttnvizError("--ks needs --sweep k")
    common.kindless(args, "the embedding probe")
    documents = common.corpus(args).documents
    loaded = common.load(args)
    bar, update = common.progress(f"embed {args.arch}")
    with bar:
        if args.sweep is None:
            return embedding.probe(loaded, documents, args.arch, m=args.m, max_docs=args.max_docs,
                                   on_progress=update).as_json()
        embedding.sweep(loaded, documents, args.arch, args.ks, m=args.m, max_docs=args.max_docs,
                        on_row=lambda row: print(common.dumps(row.as_json()), flush=True), on_progress=update)
    return None
