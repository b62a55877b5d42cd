"""A training sweep (a spec with ``[train]``, docs/sweeps.md#training-cells) on a local Ray with 2 workers against the
same spec ``--local`` (one process, one run after another), each a fresh `attnviz sweep` into an empty folder, in
the same run of this script.

    python bench/sweep_train.py examples/lab_grid.toml [--workers 2] [--local-threads N]

``--local`` gets torch on ``--local-threads`` threads (default 1: what a 1-CPU Ray task gets; 0: every core). Checks
that both give the same weights for every run (their last checkpoints' hashes), prints each wall time and ends with
``sweep_train runs=<n> steps=<total> local_s=<a> ray_s=<b> startup_s=<c> ratio=<local/ray>``. Measure on a quiet
machine.
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


def run(spec: str, out: Path, extra: list[str], threads: int | None = None) -> tuple[float, dict]:
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "attnviz", "sweep", spec, "--out", str(out), *extra],
                          capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"attnviz sweep {' '.join(extra)} failed: {done.stderr.strip().splitlines()[-1]}")
    return time.perf_counter() - start, json.loads(done.stdout.strip().splitlines()[-1])


def hashes(out: Path) -> dict[str, str]:
    from attnviz.sweep import store

    rows = store.read(str(out), "train")
    return dict(zip(rows["run"], rows["hash"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="a sweep spec with [train] (examples/lab_grid.toml: the 21 runs of the finding)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--local-threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="attnviz-sweep-train-") as tmp:
        local, s_local = run(args.spec, Path(tmp) / "local", ["--local"], threads=args.local_threads or None)
        ray, s_ray = run(args.spec, Path(tmp) / "ray", ["--workers", str(args.workers)])
        same = hashes(Path(tmp) / "local") == hashes(Path(tmp) / "ray")
    if not same:
        sys.exit("the Ray sweep's runs differ from --local's (weights hashes)")
    print(f"--local ({args.local_threads or 'every'} torch thread(s)): {local:.1f} s, {s_local['cells']} cells")
    print(f"Ray, {args.workers} workers: {ray:.1f} s (Ray start-up {s_ray['startup_s']:.1f} s); same weights: {same}")
    print(f"sweep_train runs={s_local['cells']} steps={s_local['trained_steps']} local_s={local:.2f} ray_s={ray:.2f} "
          f"startup_s={s_ray['startup_s']:.2f} ratio={local / ray:.2f}")


if __name__ == "__main__":
    main()
