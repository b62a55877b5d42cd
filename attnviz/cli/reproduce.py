"""``attnviz reproduce``: the papers' headline figures on this model, one PDF (attnviz.reports.reproduce)."""

from __future__ import annotations

import sys

from attnviz.cli import common


def options(p):
    common.model_option(p)
    common.load_args(p)
    p.add_argument("--out", required=True, help="the .pdf file to write")
    p.add_argument("--only", default=None, help="comma-separated sections: shifting, streaming, sinkrate, ksweep, "
                                                "residual (default: all)")
    p.add_argument("--quick", action="store_true", help="the same protocols on less data (under a minute here)")


def run(args) -> dict:
    from attnviz.reports import reproduce as repro

    only = repro.parse_only(args.only)
    out = common.out_file(args.out, (".pdf",), "a .pdf file")
    loaded = common.load(args)
    bar, update = common.progress("reproduce")
    with bar:
        path, done = repro.reproduce(loaded, out, only, quick=args.quick, model=args.model,
                                     on_progress=lambda i, n, name: (update(i, n), bar.set_postfix_str(name)))
    print(f"wrote {path} ({len(done)} pages)", file=sys.stderr)
    return {"out": str(path), "sections": {s.name: s.numbers for s in done}}
