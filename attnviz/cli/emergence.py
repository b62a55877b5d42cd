"""``attnviz emergence``: how a sink forms over training, one row per checkpoint, layer and head, as one Parquet file
(docs/methods.md#emergence-measures)."""

from __future__ import annotations

from attnviz.cli import common
from attnviz.errors import AttnvizError


def options(p):
    from attnviz import defaults
    from attnviz.lab import emergence

    given = defaults.of(emergence.table)
    p.add_argument("run", nargs="+", help="a run folder (its step-N checkpoints), or model folders in step order")
    p.add_argument("--out", required=True, help="the table, a .parquet file")
    p.add_argument("--arch", default=None, help="the architecture to measure under (default: each checkpoint's "
                                                "own, else fwd)")
    p.add_argument("--eps", type=float, default=given["eps"], help="sink threshold on alpha_0 (%(default)s)")
    p.add_argument("--samples", type=int, default=given["size"], action=common.Given,
                   help="sequences of the run's own task in the probe (%(default)s); planned before the first "
                        "forward, refused past the memory budget (docs/lab.md#sizing-the-emergence-table)")
    p.add_argument("--text", default=None, help="measure on this text instead of the task (checkpoints with a "
                                                "tokenizer; every query counts)")
    p.add_argument("--json", action="store_true", help="print every row as JSON (default: one summary line)")


def run(args):
    from attnviz.lab import emergence

    out = common.out_file(args.out, (".parquet",), "a .parquet file")
    if args.samples < 1:
        raise AttnvizError(f"--samples must be at least 1, got {args.samples}")
    if args.text is not None and not args.text.strip():
        raise AttnvizError("--text is empty: give some words, or leave it out to measure on the task")
    if args.text is not None and "--samples" in getattr(args, "given", ()):
        raise AttnvizError("--samples sizes the task's probe, and --text measures on the text instead: give one")
    folders = args.run[0] if len(args.run) == 1 else args.run
    bar, update = common.progress("emergence: checkpoints")
    with bar:
        frame = emergence.table(folders, args.text, args.arch, args.eps, args.samples, on_step=update,
                                on_plan=bar.plan)
    emergence.write(frame, out)
    summary = {"out": str(out), "checkpoints": int(frame["step"].nunique()), "rows": len(frame),
               "steps": sorted(int(s) for s in frame["step"].unique())}
    if args.json:
        rows = [{k: (None if v is None else v.item() if hasattr(v, "item") else v) for k, v in row.items()}
                for row in frame.astype(object).where(frame.notna(), None).to_dict("records")]
        return {**summary, "table": rows}
    print(f"attnviz: emergence: {summary['rows']} rows ({summary['checkpoints']} checkpoints) written to {out}")
    return None
