"""``attnviz report``: one self-contained HTML file of a text under several architectures (attnviz.reports)."""

from __future__ import annotations

import sys

from attnviz.cli import common
from attnviz.errors import AttnvizError


def options(p):
    from attnviz import defaults
    from attnviz.reports import html

    run_ = defaults.of(html.report_html)
    common.model_args(p)
    common.intervene_args(p)
    p.set_defaults(arch="fwd; nosink-fwd; mask0-bidir(k=8)")
    p.add_argument("--out", required=True, help="the .html file to write")
    p.add_argument("--size", type=int, default=run_["size"], help="map images' side in pixels, 16..512 (%(default)s)")
    p.add_argument("--images", choices=["webp", "png"], default=run_["image_format"],
                   help="webp: lossy, small (default); png: lossless, ~2x larger")
    p.add_argument("--quality", type=int, default=run_["quality"], help="WebP quality, 1..100 (%(default)s)")


def run(args) -> dict:
    """The viewer, sink shifting, sink profiles, provenance; prints what it wrote (the file, its size)."""
    import shlex

    from attnviz.reports import html as report_mod
    from attnviz.reports import write_atomic

    common.kindless(args, "a report")
    archs = report_mod.split_archs(args.arch)
    out = common.out_file(args.out, (".html", ".htm"), "an .html file")
    if not 16 <= args.size <= 512:
        raise AttnvizError(f"--size must be 16 to 512 pixels, got {args.size}")
    if not 1 <= args.quality <= 100:
        raise AttnvizError(f"--quality must be 1 to 100, got {args.quality}")
    common.check_intervene(args)
    text = common.text(args)
    loaded = common.load(args)
    bar, update = common.progress(f"report: {len(archs)} architectures")
    with bar:
        caps = report_mod.captures(loaded, text, archs, args.intervene, on_progress=update)
    page = report_mod.report_html(caps, size=args.size, image_format=args.images, quality=args.quality,
                                  command="attnviz " + shlex.join(args.argv))
    data = page.encode("utf-8")
    write_atomic(out, data)
    print(f"wrote {out} ({len(data) / 2**20:.1f} MB)", file=sys.stderr)
    return {"out": str(out), "bytes": len(data), "mb": round(len(data) / 2**20, 2), "n_tokens": caps[0].n_tokens,
            "archs": [c.arch for c in caps]}
