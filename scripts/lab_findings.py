"""The lab's finding (docs/findings.md#making-a-sink-which-attention-forms-one) from the emergence tables of its runs:
per kind and mask, over seeds, whether and when a sink forms on the first token, in which heads, the value drain,
the residual peak and the loss at the end.

    attnviz emergence runs/KIND-MASK-sSEED --out tables/KIND-MASK-sSEED.parquet   # for each run
    python scripts/lab_findings.py tables/*.parquet
    python scripts/lab_findings.py tables/*.parquet --by weight_decay    # one row per kind, mask and weight decay
    python scripts/lab_findings.py results/emergence/                    # a sweep's table of trained runs

``--by FIELD`` (repeatable) groups by a training setting besides the kind and the mask: a column of the table where
it has one (a sweep's axes), else the setting in each run's ``attnviz_run.json`` (``weight_decay``, ``optimizer``,
``lr``, ``task.p_trigger``: a dot reads the task's).

A head's sink has formed at the first checkpoint where the queries that need no attention put more than half their
attention on the first token (``first_token`` > 0.5; a uniform row gives it 1/64 … 1). Ranges are over heads
(within a seed) and over seeds (min–max of the seeds' values)."""
import argparse
import json
from collections import defaultdict
from pathlib import Path

import pandas as pd

from attnviz.lab.train import Setup
from attnviz.lab.emergence import FORMED  # the lab's one threshold (0.5), the Sweeps page's grid reads it too


def setting(frame: pd.DataFrame, field: str):
    """A run's training setting ``field``: the table's column where it has one, else its last checkpoint's saved
    setup (``task.NAME`` for the task's)."""
    if field in frame.columns:
        return frame[field].iloc[0]
    saved = json.loads((Path(frame.checkpoint.iloc[-1]) / "attnviz_run.json").read_text())["setup"]
    saved = Setup.from_dict(saved).as_dict()  # an older run's missing settings at their defaults (adamw ...)
    for part in field.split("."):
        saved = saved.get(part) if isinstance(saved, dict) else None
    return saved


def one(frame: pd.DataFrame, by=()) -> dict:
    last = frame[frame.step == frame.step.max()]
    formed = []
    for _, rows in frame.groupby(["layer", "head"]):
        over = rows[rows.first_token > FORMED].step
        formed.append(int(over.min()) if len(over) else None)
    return {"kind": last.kind.iloc[0], "arch": last.arch.iloc[0], "seed": int(last.seed.iloc[0]),
            "steps": int(last.step.iloc[0]), "loss": float(last.loss.mean()),
            "first": (float(last.first_token.min()), float(last.first_token.max())),
            "mass": (float(last.row_mass.min()), float(last.row_mass.max())),
            "alpha0": (float(last.alpha0.min()), float(last.alpha0.max())), "rate": float(last.sink_rate.mean()),
            "drain": (float(last.value_drain.min()), float(last.value_drain.max())),
            "peak": float(last.residual_peak.mean()), "formed": formed,
            "start": float(frame[frame.step == 0].first_token.mean()),
            "by": tuple(setting(frame, f) for f in by)}


def tables(paths) -> list[pd.DataFrame]:
    """One frame per run: each Parquet file given, or every file under a folder given (a sweep's table), split by
    checkpoint folder's run."""
    frames = []
    for path in map(Path, paths):
        files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
        frames += [pd.read_parquet(f) for f in files if not f.name.endswith(".failed.parquet")]
    whole = pd.concat(frames, ignore_index=True)
    run = whole.checkpoint.map(lambda c: str(Path(c).parent))
    return [frame.reset_index(drop=True) for _, frame in whole.groupby(run, sort=True)]


def span(values, whole: bool = False) -> str:
    lo, hi = min(values), max(values)
    if whole:
        return f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"
    return f"{lo:.2f}" if abs(hi - lo) < 0.005 else f"{lo:.2f}–{hi:.2f}"


parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("tables", nargs="+", help="emergence tables (.parquet) or folders of them")
parser.add_argument("--by", action="append", default=[], help="group by this training setting too")
args = parser.parse_args()
runs = [one(frame, args.by) for frame in tables(args.tables)]
groups = defaultdict(list)
for r in runs:
    groups[(r["kind"], r["arch"], *r["by"])].append(r)
extra = "".join(f" · {f}" for f in args.by)
print(f"| kind · mask{extra} | seeds | first token at step 0 | first token at the end | heads with a sink | formed at step | "
      "row mass at the end | value drain at the end | residual peak | sink rate | probe loss |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
def order(value):
    return (0, float(value), "") if isinstance(value, (int, float)) else (1, 0.0, str(value))


for (kind, arch, *by), rs in sorted(groups.items(), key=lambda g: tuple(map(order, g[0]))):
    rs.sort(key=lambda r: r["seed"])
    heads = [sum(f is not None for f in r["formed"]) for r in rs]
    steps = [min(f for f in r["formed"] if f is not None) for r in rs if any(f is not None for f in r["formed"])]
    n_heads = len(rs[0]["formed"])
    print(f"| {' · '.join(map(str, (kind, arch, *by)))} | {', '.join(str(r['seed']) for r in rs)} | {span([r['start'] for r in rs])} | "
          f"{span([v for r in rs for v in r['first']])} | {', '.join(f'{h}/{n_heads}' for h in heads)} | "
          f"{span(steps, True) if steps else 'never'}{'' if len(steps) == len(rs) or not steps else f' ({len(steps)} of {len(rs)} seeds)'} | "
          f"{span([v for r in rs for v in r['mass']])} | {span([v for r in rs for v in r['drain']])} | {span([r['peak'] for r in rs])} | "
          f"{span([r['rate'] for r in rs])} | {span([r['loss'] for r in rs])} |")
