"""``attnviz masks``: each layer's boolean mask of an architecture (no model needed)."""

from __future__ import annotations

from attnviz.errors import AttnvizError


def options(p):
    p.add_argument("--arch", required=True, help="architecture string, e.g. 'mask0-bidir(k=8)'")
    p.add_argument("--layers", type=int, required=True, help="number of layers")
    p.add_argument("--n", type=int, required=True, help="sequence length")
    p.add_argument("--json", action="store_true", help="JSON output (the default)")


def run(args) -> dict:
    if args.n < 1:
        raise AttnvizError(f"--n must be at least 1, got {args.n}")
    from attnviz.core.spec import arch as arch_mod

    architecture = arch_mod.parse(args.arch, args.layers)
    return {
        "arch": architecture.spec,
        "layers": [{"layer": i, "mask": m.name, "allow": m.matrix(args.n).astype(int).tolist()}
                   for i, m in enumerate(architecture.layers)],
    }
