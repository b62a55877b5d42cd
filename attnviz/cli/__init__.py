"""Command line: ``attnviz <command>`` (also ``python -m attnviz``), one per entry of the registry ``COMMANDS``.

The commands read masks and sinks, capture and save maps, measure what a mask does (perplexity, streaming,
generation, embeddings, KV-cache compression, Linformer, fine-tuning with a residual variant), look inside the
model (head classes, score attribution, routes, path and activation patching), check the machine (``doctor``), and
make reports, the papers' figures and sweeps; ``attnviz --help`` lists them with their one line each.

The JSON shapes printed here are a contract other tools rely on (docs/cli.md); bad input exits
non-zero with one line on stderr, never a traceback (``ATTNVIZ_DEBUG=1`` shows it).

One module per command (``attnviz/cli/<command>.py``: its ``options(p)`` and its ``run(args)``), imported only when
that command runs or its help is asked for, so ``attnviz --help`` imports no command and no model code; what they
share is ``attnviz/cli/common.py``.
"""

from __future__ import annotations

import importlib
import sys

from attnviz.cli import common
from attnviz.cli.common import Parser, dumps

#: command -> its one line of help (the module ``attnviz.cli.<command>`` holds its options and its runner)
COMMANDS = {
    "masks": "print each layer's boolean mask (no model needed)",
    "sinks": "attention-sink metrics of every layer and head, of a text or a dataset",
    "capture": "capture attention maps and save them (.npz)",
    "eval": "perplexity and next-token accuracy (causal-compatible architectures)",
    "finetune": "fine-tune with a residual variant and evaluate on held-out text",
    "embed": "embedding probe: recall@1 and MRR of query/target halves of documents",
    "stream": "streaming perplexity with a KV cache under a cache policy (StreamingLLM)",
    "compress": "KV-cache compression what-if: perplexity, accuracy and KL against the dense cache for each press "
                "and ratio",
    "heads": "head classes: sink, streaming (DuoAttention) and inactive (AHON) heads, of one text or averaged "
             "over a dataset",
    "explain": "why a head attends there: one score by rotary pair, by dimension and by source (embedding, each "
               "earlier attention and MLP block), and without rotation",
    "routes": "contribution graph of a token (which tokens, through which heads and MLPs, feed it) and the share "
              "of the attention flow the sink key carries in each layer",
    "paths": "path patching: each sender's write (by default the causal scan's necessary writers) removed at the "
             "sink token from one later block's input, a layer's keys or queries, or the head alone; the sink's "
             "attention and the perplexity after each",
    "patching": "activation patching between a clean and a corrupted text: every layer and position (or head) "
                "of one site patched from the clean run, its effect on a metric at the last position",
    "doctor": "check attnviz on this machine: versions and devices, every route against stock transformers, "
              "speed against a plain forward; exits 1 if a check fails",
    "linformer": "Linformer what-if on one layer: relative error of the output against k",
    "generate": "greedy generation with the KV cache under an architecture and a policy",
    "report": "one self-contained HTML file (no server, no network) of a text under several architectures: "
              "heatmap viewer, sink shifting, sink profiles",
    "reproduce": "regenerate the papers' headline figures on this model as one PDF (sink shifting, StreamingLLM, "
                 "Gu et al.'s sink rate, k-sweep, residual variants)",
    "train": "train a small decoder from scratch under a mask and an attention kind, checkpoints as Hugging Face "
             "folders, resumable (the lab)",
    "sweep": "a grid of models x architectures x interventions x corpora x measures, one Ray task per cell, "
             "results as Parquet (resumable)",
    "emergence": "how a sink forms over training: per checkpoint, layer and head of a run, alpha at key 0, the "
                 "sink rate, the first token's attention, the value drain, the residual peak and the entropy, as "
                 "one Parquet table",
}
ALL = "*"
#: names other code imports from ``attnviz.cli`` that live in a command's module (read when first asked for)
_FROM_COMMANDS = {"sinks_report": "sinks", "SINKS_REPORT": "sinks", "N_ALPHA_KEYS": "sinks"}


def command(name: str):
    """The module of one command: its ``options(p)`` and its ``run(args)``."""
    return importlib.import_module(f"attnviz.cli.{name}")


def build_parser(command_name: str | None = ALL) -> Parser:
    """The parser; only ``command_name``'s options are built (every command's with the default ``ALL``)."""
    parser = Parser(prog="attnviz", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, text in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text)
        if command_name in (name, ALL):
            command(name).options(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    name = next((a for a in given if not a.startswith("-")), None)
    args = build_parser(name if name in COMMANDS else None).parse_args(given)
    args.argv = given  # the command as given (a report's provenance)
    if not sys.stderr.isatty() and args.command != "masks":  # progress is for people at a terminal
        from transformers.utils import logging as tf_logging

        tf_logging.disable_progress_bar()
    return common.run(command(args.command).run, args)


def __getattr__(name):
    if name in _FROM_COMMANDS:
        return getattr(command(_FROM_COMMANDS[name]), name)
    raise AttributeError(f"module 'attnviz.cli' has no attribute {name!r}")


__all__ = ["ALL", "COMMANDS", "build_parser", "command", "dumps", "main"]
