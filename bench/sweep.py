"""The cost of Ray for a sweep: the same grid in one plain process, then on a local Ray
with 1 and with 2 workers, each run a fresh `attnviz sweep` into an empty folder.

    python bench/sweep.py [--cells 4] [--samples 8] [--max-len 64]

Prints each run's wall time (the command: model loads, Ray's start, the cells), Ray's start-up, the
per-task overhead of Ray against the plain process with one torch thread, which is what a Ray task
of one CPU gets ((ray1 - startup - plain) / cells, one model load each), and the speed-up of 2
workers over 1. The plain process with torch on every core is printed too. Ends with
``sweep cells=<n> plain_s=<a> ray1_s=<b> ray2_s=<c> overhead_per_task_s=<d> speedup_2_workers=<e>``.
Measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CORPORA = ["stdlib", "stdlib:specialnames", "stdlib:assert", "stdlib:lambda", "stdlib:for", "stdlib:if"]


def run(spec: Path, out: Path, extra: list[str], threads: int | None = None) -> tuple[float, dict]:
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "attnviz", "sweep", str(spec), "--out", str(out), *extra],
                          capture_output=True, text=True, check=True, env=env)
    return time.perf_counter() - start, json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=4, help="cells (2 architectures × cells/2 corpora)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=64)
    args = parser.parse_args()
    corpora = CORPORA[: max(1, args.cells // 2)]
    spec_text = (f'models = ["default"]\narchs = ["fwd", "nosink-fwd"]\ncorpora = {json.dumps(corpora)}\n'
                 f'[measures.sinks]\nsamples = {args.samples}\nmax_len = {args.max_len}\n')
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.toml"
        spec.write_text(spec_text)
        plain_all, _ = run(spec, Path(tmp) / "plain-all", ["--local"])  # torch on every core
        plain, s0 = run(spec, Path(tmp) / "plain", ["--local"], threads=1)  # one thread, as a 1-CPU Ray task
        ray1, s1 = run(spec, Path(tmp) / "ray1", ["--workers", "1"])
        ray2, s2 = run(spec, Path(tmp) / "ray2", ["--workers", "2"])
    cells = s0["cells"]
    overhead = (ray1 - s1["startup_s"] - plain) / cells
    print(f"plain process, torch on every core: {plain_all:.1f} s ({cells} cells)")
    print(f"plain process, one thread (what a 1-CPU Ray task gets): {plain:.1f} s")
    print(f"Ray, 1 worker: {ray1:.1f} s (Ray start-up {s1['startup_s']:.1f} s)")
    print(f"Ray, 2 workers: {ray2:.1f} s (Ray start-up {s2['startup_s']:.1f} s)")
    print(f"sweep cells={cells} plain_s={plain:.2f} ray1_s={ray1:.2f} ray2_s={ray2:.2f} "
          f"overhead_per_task_s={overhead:.2f} speedup_2_workers={ray1 / ray2:.2f}")


if __name__ == "__main__":
    main()
