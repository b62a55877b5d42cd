"""What every command shares: the one-line parser, the options of a command that runs a model (``--model`` written
once), reading the text or the corpus, loading the model, the recipe, progress on stderr, the JSON a command prints
(never NaN) and the one place a runner's errors become one line and an exit status (:func:`run`).

Each command is one module beside this one (``attnviz/cli/<command>.py``) with its ``options(p)`` and its
``run(args)``; ``attnviz/cli/__init__.py`` holds the registry, ``build_parser`` and ``main``. Every default comes
from the library function that uses it (:mod:`attnviz.defaults`), never a literal in a command; help texts print
it with %(default)s. Nothing here imports a model at module level, so ``attnviz --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from attnviz import settings
from attnviz.errors import AttnvizError

MODEL_HELP = "'default' (SmolLM2-135M-Instruct), 'gemma3-270m' (Gemma 3 270M), a Hugging Face id or a local directory"
RESIDUAL_HELP = "a residual variant (docs/methods.md#residual-variants): method1, method2, method3.1, method3.2, " \
                "method4.1, method4.2 (sequential pre-norm decoders: docs/methods.md#residual-variants)"


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other bad input
        self.exit(2, f"attnviz: error: {message}\n")


# --- options ----------------------------------------------------------------------------------

class Given(argparse.Action):
    """Stores an option's value and notes that it was given (``args.given``: the flags as typed)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), option_string}


def model_option(p) -> None:
    p.add_argument("--model", default="default", help=MODEL_HELP)


def model_args(p, text: bool = True, corpus: bool = False, source: bool = True):
    """The options of every command that runs a model: the model, the architecture, how it loads, ``--json``, and
    (with ``source``) where the text comes from; returns the text options' group."""
    model_option(p)
    p.add_argument("--arch", default="fwd", help="architecture string (docs/methods.md#the-call-syntax)")
    from attnviz.core.spec import kinds

    p.add_argument("--kind", default=None, help=f"attention kind: {kinds.help()} (default: the model's own; "
                                                "docs/methods.md#attention-kinds)")
    load_args(p)
    p.add_argument("--json", action="store_true", help="JSON output (the default)")
    if not source:
        return None
    group = p.add_mutually_exclusive_group(required=text)
    if text:
        group.add_argument("--text", help="the text to capture")
    if corpus or not text:
        group.add_argument("--corpus", default=None if text else "stdlib",
                           help="'stdlib' (Python's reference docs, offline) or 'stdlib:TOPIC'")
    group.add_argument("--text-file", help="read the text from this file (UTF-8)")
    return group


def load_args(p) -> None:
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: float32 on CPU)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    p.add_argument("--device-map", default=None,
                   help="'auto' (or balanced, sequential): spread the model over GPUs, the CPU and disk "
                        "with accelerate, for models larger than one device")
    p.add_argument("--trust-remote-code", action="store_true", help="allow a model's own Python code")


def intervene_args(p, bos: bool = False) -> None:
    from attnviz.core.spec.interventions import USAGE

    p.add_argument("--intervene", default=None,
                   help=f"interventions (docs/methods.md#interventions), e.g. 'sinkscale(beta=0.3)@20-29; "
                        f"ablate(heads=0,3)@5': {USAGE}".replace("%", "%%"))
    if bos:
        first = p.add_mutually_exclusive_group()
        first.add_argument("--bos", action="store_true", help="prepend the tokenizer's BOS token to the text")
        first.add_argument("--prepend", default=None, metavar="TOKEN", help="prepend this token to the text")


def position_or(word: str):
    """An argparse type: a token position, or ``word`` ('auto' for --key, 'all' for --query)."""
    def parse(text: str):
        if text.strip().lower() == word:
            return word
        if not text.strip().isdigit():
            raise argparse.ArgumentTypeError(f"'{text}' is neither a token position nor '{word}'")
        return int(text)
    return parse


# --- input --------------------------------------------------------------------------------------

def text(args) -> str:
    if args.text_file:
        try:
            value = Path(args.text_file).read_text(encoding="utf-8")
        except OSError as err:
            raise AttnvizError(f"cannot read --text-file '{args.text_file}': {err.strerror}") from None
        except UnicodeDecodeError as err:
            raise AttnvizError(f"--text-file '{args.text_file}' is not UTF-8 text (byte {err.start}: "
                               f"{err.object[err.start:err.start + 1]!r}): save it as UTF-8") from None
    else:
        value = args.text
    if not value or not value.strip():
        raise AttnvizError("the text is empty: give --text or --text-file with some words")
    return value


def corpus(args):
    from attnviz import corpus as corpus_mod

    if getattr(args, "text", None) is not None:
        return corpus_mod.from_text(args.text, "--text")
    return corpus_mod.load(getattr(args, "corpus", None), args.text_file)


def out_file(arg: str, suffixes: tuple[str, ...], what: str) -> Path:
    """``--out`` as a file of one of ``suffixes`` (``what``: "an .html file") in a folder that exists,
    checked before anything runs."""
    out = Path(arg)
    if out.suffix.lower() not in suffixes:
        raise AttnvizError(f"--out must name {what}, got '{arg}'")
    if not out.parent.is_dir():
        raise AttnvizError(f"--out: the folder '{out.parent}' does not exist")
    return out


def check_intervene(args) -> None:
    """The intervention string's form, before a model is loaded (its layers and heads are checked
    against the model once it is)."""
    from attnviz.core.spec import interventions

    interventions.parse(getattr(args, "intervene", None), 10**6, 10**6)


def intervene_json(args, loaded) -> dict:
    from attnviz.core.spec import interventions

    spec = interventions.parse(args.intervene, loaded.n_layers, loaded.n_heads).spec
    return {"intervene": spec} if spec else {}


def prepend(args) -> str | None:
    return "bos" if getattr(args, "bos", False) else getattr(args, "prepend", None)


# --- the model and its run ------------------------------------------------------------------------

def load(args):
    """The model; every runner reads its input first, so bad input fails before a model is loaded."""
    from huggingface_hub.utils import logging as hub_logging

    from attnviz.core.loading.models import load as load_model

    hub_logging.set_verbosity_error()  # the one-line error below says it; no retry chatter

    return load_model(args.model, dtype=args.dtype, device=args.device, device_map=args.device_map,
                      trust_remote_code=args.trust_remote_code,
                      progress=lambda message: print(message, file=sys.stderr) if sys.stderr.isatty() else None)


def kindless(args, purpose: str) -> None:
    """Refuse ``--kind`` for a command whose analysis runs the model's own attention kind only."""
    if getattr(args, "kind", None):
        raise AttnvizError(f"{purpose} runs the model's own attention kind: leave out --kind "
                         "(docs/methods.md#attention-kinds)")


def recipe(args, loaded, arch: str | None = None):
    """The recipe a command's options make: ``--arch`` (or ``arch``), ``--intervene``, ``--bos`` / ``--prepend``
    and ``--residual``, where the command has them."""
    from attnviz.recipe import Recipe

    return Recipe.of(loaded, arch or getattr(args, "arch", None) or "fwd", getattr(args, "intervene", None),
                     prepend(args), getattr(args, "residual", None), getattr(args, "kind", None))


class Progress:
    """Progress on stderr: a tqdm bar on a terminal; elsewhere (a pipe, a log file) one line every few seconds
    (:data:`EVERY`) with the time spent and left. ``update(done, total)`` is the callback the library reports
    progress with; ``plan(plan)`` takes an analysis's plan (:class:`attnviz.effects.budget.AnalysisPlan`), prints
    it in one line and weighs the time left by its forwards' work (a batch resumed from a low layer is slower)."""

    EVERY = 5.0

    def __init__(self, description: str, stream=None):
        from tqdm.auto import tqdm

        self.description, self.stream = description, stream or sys.stderr
        self.tty = self.stream.isatty()
        self.bar = tqdm(desc=description, file=self.stream, unit="", leave=False, disable=not self.tty)
        self.start = self.said = time.monotonic()
        self.steps: list[float] | None = None
        self.since = (0, self.start)  # (done, time) when the plan's steps were given
        self.done, self.total = None, 0  # the last report (None: none yet)
        self.told = ""  # the plan's line, printed with the first progress line off a terminal
        self.ended = None  # the ticker's stop, while it runs

    def __enter__(self):
        self.bar.__enter__()
        if not self.tty and self.EVERY > 0:  # a line every few seconds, a forward taking minutes included
            import threading

            self.ended = threading.Event()
            threading.Thread(target=self._tick, daemon=True).start()
        return self

    def _tick(self) -> None:
        while not self.ended.wait(self.EVERY):
            if self.done is not None and time.monotonic() - self.said >= self.EVERY:
                self._say(self.done, self.total)

    def __getattr__(self, name: str):  # the bar's own (set_postfix, set_postfix_str, ...)
        if name == "bar":  # not made yet
            raise AttributeError(name)
        return getattr(self.bar, name)

    def __exit__(self, *exc):
        if self.ended is not None:
            self.ended.set()
        return self.bar.__exit__(*exc)

    def plan(self, plan) -> None:
        """Take ``plan``: shown at once on a terminal, elsewhere with the first progress line (a run that ends
        within :data:`EVERY` seconds prints nothing, and a refusal stays one line)."""
        self.told = f"attnviz: plan: {plan.describe()}"
        if self.tty:
            self.bar.write(self.told, file=self.stream)
            self.told = ""
        self.steps, self.since = plan.steps(), (self.done or 0, time.monotonic())

    def left(self, done: int, total: int) -> float | None:
        """Seconds left, from the time the work done so far took (None: nothing done yet)."""
        first, then = self.since
        now = time.monotonic()
        if self.steps is not None and total - first == len(self.steps):
            did, whole = sum(self.steps[:done - first]), sum(self.steps)
        else:
            did, whole, then = done, total, self.start
        return (now - then) * (whole - did) / did if did > 0 else None

    def update(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        self.bar.total = total
        self.bar.n = done
        self.bar.refresh()
        if not self.tty and time.monotonic() - self.said >= self.EVERY:
            self._say(done, total)

    def _say(self, done: int, total: int) -> None:
        from attnviz.effects.budget import duration  # a run is under way: the library is loaded

        now = self.said = time.monotonic()
        if self.told:
            print(self.told, file=self.stream, flush=True)
            self.told = ""
        left = self.left(done, total)
        eta = f", ~{duration(left)} left" if left is not None and done < total else ""
        print(f"attnviz: {self.description}: {done} of {total}, {duration(now - self.start)}{eta}",
              file=self.stream, flush=True)


def progress(description: str):
    """:class:`Progress` (the context it runs in) and the ``(done, total)`` callback the library reports with."""
    shown = Progress(description)
    return shown, shown.update


# --- output ---------------------------------------------------------------------------------------

def finite(value):
    """``value`` with every NaN or infinite float as None (null): strict JSON parsers take no NaN. Each command
    says why a number is undefined beside it where it can (a ``*_undefined`` field)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(result) -> str:
    """A command's JSON: never NaN (:func:`finite`)."""
    return json.dumps(finite(result), allow_nan=False)


def run(handler, args) -> int:
    """Run a command's runner and print what it returns: its JSON (a dict), nothing (None: it printed its JSON
    lines itself) or its exit status (an int: it printed its output, as the doctor does). Bad input is one line on
    stderr and exit 2, any other failure one line and exit 1: never a traceback (``ATTNVIZ_DEBUG=1`` shows it).
    The settings are read from the environment here, once, and handed to the library (:func:`attnviz.settings.use`):
    the command line is one of the edges that read them (docs/cli.md#settings)."""
    try:
        given = settings.Settings.from_environment()
        settings.use(given)
        result = handler(args)
    except AttnvizError as err:
        print(f"attnviz: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # never a traceback for the user; ATTNVIZ_DEBUG=1 shows it
        if settings.active().debug:
            raise
        print(f"attnviz: internal error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    if isinstance(result, int):
        return result
    if result is not None:
        print(dumps(result))
    return 0
