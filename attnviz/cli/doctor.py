"""``attnviz doctor``: the environment, every route against stock transformers on this model and device, speed
(:mod:`attnviz.doctor`); one line per check, exit 1 if a correctness check fails."""

from __future__ import annotations

import sys

from attnviz.cli import common
from attnviz.errors import AttnvizError


def options(p):
    from attnviz import defaults, doctor

    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                   help="where to check (auto: CUDA, else MPS, else the CPU)")
    common.model_option(p)
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: bfloat16 on CUDA, float32 on "
                                                 "CPU)")
    p.add_argument("--tokens", type=int, default=defaults.one(doctor.run, "tokens"),
                   help="the speed checks' text length in tokens (%(default)s)")
    p.add_argument("--json", action="store_true", help="the whole report as JSON, to paste into a bug report")
    p.set_defaults(device_map=None, trust_remote_code=False)


def run(args) -> int:
    from attnviz import doctor

    if args.tokens < 16:
        raise AttnvizError(f"--tokens must be at least 16, got {args.tokens}")
    args.device = doctor.pick_device(args.device)
    loaded = common.load(args)
    say = (lambda message: print(f"doctor: {message}…", file=sys.stderr)) if sys.stderr.isatty() else None
    report = doctor.run(loaded, args.tokens, progress=say)
    print(common.dumps(report.as_json()) if args.json else report.text())
    return 0 if report.ok else 1
