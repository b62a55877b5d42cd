"""The lab's finding (docs/findings.md#making-a-sink-which-attention-forms-one) from the emergence tables of its runs:
per kind and mask, over seeds, whether and when a sink forms on the first token, in which heads, the value drain,
the residual peak and the loss at the end.

    attnviz emergence runs/KIND-MASK-sSEED --out tables/KIND-MASK-sSEED.parquet   # for each run
    python scripts/lab_findings.py tables/*.parquet

A head's sink has formed at the first checkpoint where the queries that need no attention put more than half their
attention on the first token (``first_token`` > 0.5; a uniform row gives it 1/64 … 1). Ranges are over heads
(within a seed) and over seeds (min–max of the seeds' values)."""
import sys
from collections import defaultdict

import pandas as pd

from attnviz.lab.emergence import FORMED  # the lab's one threshold (0.5), the Sweeps page's grid reads it too


def one(frame: pd.DataFrame) -> dict:
    last = frame[frame.step == frame.step.max()]
    formed = []
    for head, rows in frame.groupby("head"):
        over = rows[rows.first_token > FORMED].step
        formed.append(int(over.min()) if len(over) else None)
    return {"kind": last.kind.iloc[0], "arch": last.arch.iloc[0], "seed": int(last.seed.iloc[0]),
            "steps": int(last.step.iloc[0]), "loss": float(last.loss.mean()),
            "first": (float(last.first_token.min()), float(last.first_token.max())),
            "mass": (float(last.row_mass.min()), float(last.row_mass.max())),
            "alpha0": (float(last.alpha0.min()), float(last.alpha0.max())), "rate": float(last.sink_rate.mean()),
            "drain": (float(last.value_drain.min()), float(last.value_drain.max())),
            "peak": float(last.residual_peak.mean()), "formed": formed,
            "start": float(frame[frame.step == 0].first_token.mean())}


def span(values, whole: bool = False) -> str:
    lo, hi = min(values), max(values)
    if whole:
        return f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"
    return f"{lo:.2f}" if abs(hi - lo) < 0.005 else f"{lo:.2f}–{hi:.2f}"


runs = [one(pd.read_parquet(path)) for path in sys.argv[1:]]
groups = defaultdict(list)
for r in runs:
    groups[(r["kind"], r["arch"])].append(r)
print("| kind · mask | seeds | first token at step 0 | first token at the end | heads with a sink | formed at step | "
      "row mass at the end | value drain at the end | residual peak | sink rate | probe loss |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for (kind, arch), rs in sorted(groups.items()):
    rs.sort(key=lambda r: r["seed"])
    heads = [sum(f is not None for f in r["formed"]) for r in rs]
    steps = [min(f for f in r["formed"] if f is not None) for r in rs if any(f is not None for f in r["formed"])]
    n_heads = len(rs[0]["formed"])
    print(f"| {kind} · {arch} | {', '.join(str(r['seed']) for r in rs)} | {span([r['start'] for r in rs])} | "
          f"{span([v for r in rs for v in r['first']])} | {', '.join(f'{h}/{n_heads}' for h in heads)} | "
          f"{span(steps, True) if steps else 'never'}{'' if len(steps) == len(rs) or not steps else f' ({len(steps)} of {len(rs)} seeds)'} | "
          f"{span([v for r in rs for v in r['mass']])} | {span([v for r in rs for v in r['drain']])} | {span([r['peak'] for r in rs])} | "
          f"{span([r['rate'] for r in rs])} | {span([r['loss'] for r in rs])} |")
