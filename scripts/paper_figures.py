"""One exported page of each figure type, as a paper would take it, to look at before a release.

    .venv/bin/python scripts/paper_figures.py [--out assets/paper] [--serif]

Renders, from captures of the default model, each kind of figure the app exports (heatmap, panels,
zoomed region, key profile, alpha and sink grids, allocation, sink shifting, difference, mask
small multiples) as a PDF at the double-column preset, title left out, plus a PNG preview of each. About a
minute on a 2-core CPU. (The path-patching figures that docs/findings.md shows are scripts/paths_findings.py's.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from attnviz.core.spec import arch
from attnviz import capture, load, regions
from attnviz.figures import export
from attnviz.figures import (allocation_bars, alpha_grid, architecture_masks, difference, heatmap, key_profile,
                             panels, region_heatmap, shift_panels, sink_grid)

ROOT = Path(__file__).resolve().parent.parent
TEXT = ("The old lighthouse keeper climbed the narrow stairs every evening to light the lamp. Ships passing "
        "the rocky coast relied on its steady beam, and in fifty years he had never missed a single night.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "assets" / "paper"))
    parser.add_argument("--serif", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lm = load("default")
    fwd, nosink, bidir = (capture(lm, TEXT, a) for a in ("fwd", "nosink-fwd", "mask0-bidir(k=8)"))
    figures = {
        "heatmap": heatmap(fwd, 29, None, log=True),
        "panels": panels([fwd, nosink], ["FWD", "NoSink-FWD"], 20),
        "region": region_heatmap(regions.from_capture(fwd, 29, (18, 38), (0, 20)), None),
        "key_profile": key_profile(fwd, 0),
        "alpha_grid": alpha_grid(fwd, 0),
        "sink_grid": sink_grid(fwd, 0),
        "allocation": allocation_bars(fwd),
        "shifting": shift_panels([fwd, nosink, bidir], ["FWD", "NoSink-FWD", "MASK0-BIDIR"], 29),
        "difference": difference(fwd, nosink, 29),
        "masks": architecture_masks(arch.parse("mask0&bidir(k=8, k0=4)", 30)),
    }
    font = "serif" if args.serif else "sans"
    for name, fig in figures.items():
        meta = {"tool": "attnviz", "model": lm.model_id, "figure": name}
        (out / f"{name}.pdf").write_bytes(export.figure_bytes(fig, "pdf", meta, preset="paper-double", title=False,
                                                             font=font))
        (out / f"{name}.png").write_bytes(export.figure_bytes(fig, "png", meta, preset="paper-double", title=False,
                                                             font=font, scale=1.5))
        print(f"wrote {out / name}.pdf and .png", flush=True)


if __name__ == "__main__":
    main()
