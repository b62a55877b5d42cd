"""``attnviz sweep``: a grid of cells on Ray, results as Parquet (docs/sweeps.md)."""

from __future__ import annotations

import sys
from pathlib import Path

from attnviz.cli import common
from attnviz.errors import AttnvizError


def options(p):
    p.add_argument("spec", help="the spec, a TOML file (docs/sweeps.md)")
    p.add_argument("--out", required=True, help="results folder (or s3://, gs:// URI): one Parquet file per cell")
    p.add_argument("--address", default=None, help="a Ray cluster's address (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--workers", type=int, default=None, help="local Ray: at most this many cells at once "
                                                             "(default: the machine's CPUs)")
    p.add_argument("--local", action="store_true", help="run the cells in this process, without Ray")
    p.add_argument("--runs", default=None, help="a [train] spec's runs folder (default: OUT/runs; for an s3:// or "
                                                "gs:// OUT, sweep-runs/ here: the trainer writes to a file system)")


def run(args) -> dict:
    """Models × archs × interventions × corpora × measures, and [train]'s runs; a failed cell is recorded, and the run
    exits 2."""
    import time

    from attnviz.sweep import run as sweep_run
    from attnviz.sweep import spec

    grid = spec.load(args.spec)  # every key checked before anything runs
    if args.workers is not None and args.workers < 1:
        raise AttnvizError(f"--workers must be at least 1, got {args.workers}")
    out = args.out
    if "://" not in out and Path(out).exists() and not Path(out).is_dir():
        raise AttnvizError(f"--out: '{out}' is a file, not a folder")
    start = time.perf_counter()
    trains = f" ({len(grid.train)} training runs)" if grid.train else ""
    bar, update = common.progress(f"sweep: {len(grid.cells()) + len(grid.train)} cells{trains}")
    logged = not sys.stderr.isatty()

    def on_cell(done: int, total: int, result: dict) -> None:
        update(done, total)
        left = (time.perf_counter() - start) / done * (total - done)
        if logged:  # a log line per cell where no bar is drawn
            run = (f" {result['run']}: trained {result['trained'] or 0} steps, {result['measured']} measured"
                   if "run" in result else "")
            print(f"cell {done}/{total} {result['status']}{run} ({result['elapsed_s']:.1f} s) · ETA {left:.0f} s",
                  file=sys.stderr, flush=True)
        else:
            bar.set_postfix_str(f"ETA {left:.0f} s")

    def on_step(run: str, step: int, steps: int, loss: float) -> None:  # --local: the steps inside a run
        if step == steps or step % max(1, steps // 10) == 0:
            if logged:
                print(f"  {run} step {step}/{steps} loss {loss:.3f}", file=sys.stderr, flush=True)
            else:
                bar.set_postfix_str(f"{run} step {step}/{steps}")

    with bar:
        summary = sweep_run.sweep(grid, out, address=args.address, workers=args.workers, local=args.local,
                                  on_cell=on_cell, runs=args.runs, on_step=on_step)
    result = summary.as_json(out)
    if summary.failed:
        first = next(iter(summary.errors.values()))
        print(common.dumps(result))
        raise AttnvizError(f"{summary.failed} of {summary.total} cells failed (recorded in {out}); the first: {first}")
    return result
