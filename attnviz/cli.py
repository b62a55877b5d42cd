"""Command line: ``attnviz masks | sinks | capture`` (also ``python -m attnviz``).

The JSON shapes printed here are a contract other tools rely on (issue 2 §5); bad input exits
non-zero with one line on stderr, never a traceback (``ATTNVIZ_DEBUG=1`` shows it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from . import arch as arch_mod
from .errors import AttnvizError

N_ALPHA_KEYS = 8


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other bad input
        self.exit(2, f"attnviz: error: {message}\n")


def _masks(args) -> dict:
    if args.n < 1:
        raise AttnvizError(f"--n must be at least 1, got {args.n}")
    architecture = arch_mod.parse(args.arch, args.layers)
    return {
        "arch": architecture.spec,
        "layers": [{"layer": i, "mask": m.name, "allow": m.matrix(args.n).astype(int).tolist()}
                   for i, m in enumerate(architecture.layers)],
    }


def _text(args) -> str:
    if args.text_file:
        try:
            text = Path(args.text_file).read_text(encoding="utf-8")
        except OSError as err:
            raise AttnvizError(f"cannot read --text-file '{args.text_file}': {err.strerror}") from None
    else:
        text = args.text
    if not text or not text.strip():
        raise AttnvizError("the text is empty: give --text or --text-file with some words")
    return text


def _load(args):
    from huggingface_hub.utils import logging as hub_logging

    from .models import load

    hub_logging.set_verbosity_error()  # the one-line error below says it; no retry chatter
    _text(args)  # bad text fails before a model is loaded

    return load(args.model, dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code,
                progress=lambda message: print(message, file=sys.stderr))


def _null(x: float):
    return None if math.isnan(x) else round(float(x), 6)


def sinks_report(capture, eps: float) -> dict:
    """The `attnviz sinks --json` document for a capture (all layers recorded)."""
    from . import metrics

    layers = []
    for layer in capture.layers:
        alphas = capture.stat(layer, "alpha")
        probs_keys = capture.stat(layer, "column_mean").argmax(-1)
        discarded = capture.stat(layer, "discarded").mean(-1)
        layers.append({
            "layer": layer,
            "mask": capture.layer_masks[layer],
            "sink_rate": {str(k): _null(metrics.sink_rate(alphas[:, k], eps)) if k < capture.n_tokens else None
                          for k in (0, 1)},
            "heads": [{
                "head": h, "kv_group": capture.kv_groups[h], "sink_key": int(probs_keys[h]),
                "alpha": [_null(alphas[h, k]) if k < capture.n_tokens else None for k in range(N_ALPHA_KEYS)],
                "discarded_mass": _null(discarded[h]),
            } for h in range(capture.n_heads)],
        })
    return {"model": capture.meta["model"], "arch": capture.arch, "n_tokens": capture.n_tokens,
            "tokens": capture.tokens, "layers": layers}


def _sinks(args) -> dict:
    from .capture import capture

    if not 0 <= args.eps <= 1:
        raise AttnvizError(f"--eps must be between 0 and 1, got {args.eps}")
    loaded = _load(args)
    return sinks_report(capture(loaded, _text(args), args.arch, reduce=True), args.eps)


def _capture(args) -> dict:
    from .capture import capture

    loaded = _load(args)
    result = capture(loaded, _text(args), args.arch, layers=args.layers, hidden_states=args.hidden)
    path = result.save(args.out)
    return {"out": str(path), "model": result.meta["model"], "arch": result.arch,
            "n_tokens": result.n_tokens, "layers": result.layers,
            "forward_s": round(result.timing["forward_s"], 4)}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="attnviz", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    masks = sub.add_parser("masks", help="print each layer's boolean mask (no model needed)")
    masks.add_argument("--arch", required=True, help="architecture string, e.g. 'mask0-bidir(k=8)'")
    masks.add_argument("--layers", type=int, required=True, help="number of layers")
    masks.add_argument("--n", type=int, required=True, help="sequence length")
    masks.add_argument("--json", action="store_true", help="JSON output (the default)")

    def model_args(p):  # shared by the commands that run a model
        p.add_argument("--model", default="default", help="'default', a Hugging Face id or a local directory")
        p.add_argument("--arch", default="fwd", help="architecture string (SPEC §7)")
        p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: float32 on CPU)")
        p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
        p.add_argument("--trust-remote-code", action="store_true", help="allow a model's own Python code")
        text = p.add_mutually_exclusive_group(required=True)
        text.add_argument("--text", help="the text to capture")
        text.add_argument("--text-file", help="read the text from this file (UTF-8)")

    sinks = sub.add_parser("sinks", help="attention-sink metrics of every layer and head")
    model_args(sinks)
    sinks.add_argument("--eps", type=float, default=0.3, help="sink threshold on alpha (default 0.3)")
    sinks.add_argument("--json", action="store_true", help="JSON output (the default)")

    cap = sub.add_parser("capture", help="capture attention maps and save them (.npz)")
    model_args(cap)
    cap.add_argument("--out", required=True, help="output file (.npz)")
    cap.add_argument("--layers", default=None, help="comma-separated layers to record (default: all)")
    cap.add_argument("--hidden", action="store_true", help="also keep hidden states")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"masks": _masks, "sinks": _sinks, "capture": _capture}[args.command]
    try:
        result = handler(args)
    except AttnvizError as err:
        print(f"attnviz: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # never a traceback for the user; ATTNVIZ_DEBUG=1 shows it
        if os.environ.get("ATTNVIZ_DEBUG"):
            raise
        print(f"attnviz: internal error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
