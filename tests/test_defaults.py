"""Defaults are declared once, on the library (attnviz.defaults): the CLI's options, the sweep's
measure options, the Effects page's widgets and the library signatures must agree, and every numeric CLI
default (and every number box of the Effects page) must come from one of the library places listed here."""

import argparse
from pathlib import Path

import pytest

from attnviz.effects import dataset, embedding, evaluate, finetune, generate, heads, induction, linformer, streaming
from attnviz import defaults, doctor, options
from attnviz.stats import metrics
from attnviz.cli import ALL, COMMANDS, build_parser
from attnviz.kv import compress, presses
from attnviz.reports import html
from attnviz import flow
from attnviz.lab import emergence
from attnviz.lab.train import Setup
from attnviz.sweep.spec import measure_options

D = defaults.of
SINKS, REPORT = D(dataset.sinks), D(dataset.DatasetSinks.as_json)
TAX, TEXTS = D(heads.taxonomy), D(heads.dataset_texts)

#: (command, option dest) -> the library's default
LIBRARY = {
    ("sinks", "eps"): REPORT["eps"], ("sinks", "key"): REPORT["key"], ("sinks", "max_len"): SINKS["max_len"],
    ("sinks", "samples"): SINKS["n_samples"], ("doctor", "tokens"): D(doctor.run)["tokens"],
    ("eval", "max_tokens"): D(evaluate.evaluate)["max_tokens"],
    ("finetune", "steps"): D(finetune.finetune)["steps"], ("finetune", "seq_len"): D(finetune.finetune)["seq_len"],
    ("finetune", "batch"): D(finetune.finetune)["batch"], ("finetune", "lr"): D(finetune.finetune)["lr"],
    ("finetune", "seed"): D(finetune.finetune)["seed"], ("finetune", "max_tokens"): finetune.MAX_TOKENS,
    ("embed", "m"): D(embedding.probe)["m"], ("embed", "max_docs"): D(embedding.probe)["max_docs"],
    ("stream", "max_tokens"): streaming.MAX_TOKENS,
    ("compress", "ratios"): ",".join(f"{r:g}" for r in D(compress.compress)["ratios"]),
    ("compress", "context"): D(compress.compress)["context"], ("compress", "max_tokens"): compress.MAX_TOKENS,
    ("heads", "samples"): TEXTS["samples"], ("heads", "max_len"): TEXTS["max_len"], ("heads", "eps"): TAX["eps"],
    ("heads", "tau_stream"): TAX["tau_stream"], ("heads", "tau_inactive"): TAX["tau_inactive"],
    ("heads", "sink"): TAX["s"], ("heads", "window"): TAX["w"],
    **{("heads", cli): D(induction.repeated)[lib] for cli, lib in (
        ("repeat", "length"), ("repeat_samples", "samples"), ("seed", "seed"), ("tau", "tau"),
        ("dormant_share", "share"))},
    ("linformer", "ks"): ",".join(map(str, linformer.KS)), ("linformer", "projection"): D(linformer.whatif)["method"],
    ("generate", "policy"): D(generate.generate)["policy"],
    ("generate", "max_new_tokens"): D(generate.generate)["max_new_tokens"],
    ("report", "size"): D(html.report_html)["size"], ("report", "images"): D(html.report_html)["image_format"],
    ("report", "quality"): D(html.report_html)["quality"],
    ("routes", "token"): D(flow.routes)["token"], ("routes", "threshold"): D(flow.routes)["threshold"],
    ("emergence", "eps"): D(emergence.table)["eps"], ("emergence", "samples"): D(emergence.table)["size"],
    **{("train", name): D(Setup)[name] for name in ("width", "heads", "steps", "batch", "warmup", "seed", "every",
                                                     "lr", "weight_decay", "optimizer", "momentum")},
    # the task's options (vocab, triggers, length, p_trigger) default to None: the chosen task's own dataclass
    # defaults, tests/test_lab_train.py::test_the_command_hands_the_task_and_the_optimizer_on_and_refuses_in_one_line
    **{("train", name): None for name in ("vocab", "triggers", "length", "p_trigger")},
}
#: (measure, option) -> (command, option dest) where the CLI has the same option
SWEEP_TO_CLI = {
    ("routes", "threshold"): ("routes", "threshold"),
    ("sinks", "samples"): ("sinks", "samples"), ("sinks", "max_len"): ("sinks", "max_len"),
    ("sinks", "eps"): ("sinks", "eps"), ("sinks", "key"): ("sinks", "key"),
    ("eval", "max_tokens"): ("eval", "max_tokens"), ("embed", "m"): ("embed", "m"),
    ("embed", "max_docs"): ("embed", "max_docs"), ("compress", "context"): ("compress", "context"),
    ("compress", "max_tokens"): ("compress", "max_tokens"), ("heads", "samples"): ("heads", "samples"),
    ("heads", "max_len"): ("heads", "max_len"), ("heads", "eps"): ("heads", "eps"),
    ("heads", "tau_stream"): ("heads", "tau_stream"), ("heads", "tau_inactive"): ("heads", "tau_inactive"),
    ("heads", "sink"): ("heads", "sink"), ("heads", "window"): ("heads", "window"),
    ("emergence", "samples"): ("emergence", "samples"), ("emergence", "eps"): ("emergence", "eps"),
}
#: options whose default is not a library setting (a mode, a path, a model name, a device)
NOT_SETTINGS = {"model", "arch", "dtype", "device", "device_map", "corpus", "text", "text_file", "intervene",
                "prepend", "residual", "out", "layers", "attention", "target", "stride", "window", "sweep", "ks",
                "policy", "press", "only", "address", "workers", "spec", "command", "layer"}


def cli_defaults() -> dict:
    parser = build_parser(ALL)
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    out = {}
    for command, p in sub.choices.items():
        for action in p._actions:
            if action.dest != "help" and not isinstance(action, (argparse._StoreTrueAction, argparse._HelpAction)):
                out[(command, action.dest)] = action.default
    return out


def test_every_cli_setting_is_the_library_default():
    cli = cli_defaults()
    for where, value in LIBRARY.items():
        assert cli[where] == value, f"attnviz {where[0]} --{where[1]}: CLI {cli[where]!r}, library {value!r}"
    stray = [w for w, v in cli.items() if isinstance(v, (int, float)) and w not in LIBRARY
             and w[1] not in NOT_SETTINGS]
    assert not stray, f"numeric CLI defaults that no library function declares: {stray}"


def test_the_sweep_measures_and_the_cli_agree():
    cli = cli_defaults()
    table = measure_options()
    for (measure, option), where in SWEEP_TO_CLI.items():
        assert table[measure][option][1] == cli[where], f"measures.{measure}.{option} vs attnviz {where[0]}"
    assert table["compress"]["ratios"][1] == list(D(compress.compress)["ratios"])
    assert table["eval"]["window"][1] == D(evaluate.evaluate)["window"] == evaluate.DEFAULT_WINDOW
    assert REPORT["eps"] == metrics.SINK_EPS == TAX["eps"]
    assert REPORT["key"] == "auto"


def test_commands_build_their_options_only_when_asked(monkeypatch):
    import subprocess
    import sys

    code = ("import sys; from attnviz.cli import main; main(['masks', '--arch', 'fwd', '--layers', '1', '--n', '1']);"
            "heavy = [m for m in ('torch._dynamo', 'transformers.modeling_utils', 'attnviz.core.engine') if m in sys.modules];"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out
    code = "import sys; import attnviz.cli as c; c.build_parser(None); print(sorted(m for m in sys.modules if m == 'torch'))"
    assert "[]" in subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert set(COMMANDS) >= {"masks", "sinks", "capture", "eval", "embed", "stream", "generate", "compress", "heads"}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        build_parser(command).parse_args([command, "--help"])
    assert done.value.code == 0 and "usage: attnviz" in capsys.readouterr().out


# --- the Effects page ------------------------------------------------------------------------------
# Its widgets show the library's defaults, the same ones the CLI's options show (LIBRARY above), and it reads its
# ratio and k boxes with the CLI's own reader (attnviz.options), so it refuses what the CLI refuses.

PAGE = Path(__file__).resolve().parent.parent / "pages" / "effects.py"
#: widget key -> (command, option dest) in LIBRARY: the page's default is the CLI's, and both the library's
PAGE_WIDGETS = {
    "fx_ppl_tokens": ("eval", "max_tokens"), "fx_st_tokens": ("stream", "max_tokens"),
    "fx_kv_context": ("compress", "context"), "fx_kv_tokens": ("compress", "max_tokens"),
    "fx_sw_m": ("embed", "m"), "fx_sw_docs": ("embed", "max_docs"),
    "fx_gen_policy": ("generate", "policy"), "fx_gen_new": ("generate", "max_new_tokens"),
    "fx_lin_projection": ("linformer", "projection"),
}
#: widget key -> the library's default, where the CLI's option shows it another way (or has none)
PAGE_LIBRARY = {
    "fx_ppl_window": D(evaluate.evaluate)["window"],  # the CLI's --window: None, "the window or the text"
    "fx_kv_presses": list(presses.DEFAULTS),  # the CLI's --press: None, "all of them"
}
#: list boxes: widget key -> (the reader both use, the library's list)
PAGE_LISTS = {
    "fx_kv_ratios": (options.ratios, list(D(compress.compress)["ratios"])),
    "fx_lin_ks": (options.ks, list(linformer.KS)),
    "fx_sw_ks": (lambda text: embedding.parse_ks(text, 30), embedding.parse_ks(D(embedding.sweep)["ks"], 30)),
}
SECTIONS = ("Perplexity", "Streaming (KV cache)", "KV compression", "Embedding k-sweep", "Generation",
            "Linformer what-if")


@pytest.fixture(scope="module")
def effects_page(model_cache, tmp_path_factory):
    from test_app import app_test, on_page

    at = app_test(tmp_path_factory.mktemp("effects"))
    at.run()
    return on_page(at, "pages/effects.py")


def test_the_effects_page_shows_the_library_defaults(effects_page):
    at, shown = effects_page, {}
    for section in SECTIONS:
        at.radio(key="fx_section").set_value(section).run()
        assert not at.exception and not at.error, (section, [e.value for e in at.error])
        for widget in (*at.number_input, *at.text_input, *at.radio, *at.multiselect):
            if (widget.key or "").startswith("fx_") and widget.key != "fx_section":
                shown[widget.key] = widget.value
    for key, where in PAGE_WIDGETS.items():
        assert shown[key] == LIBRARY[where], f"Effects page {key}: {shown[key]!r}, attnviz {where[0]} and the " \
                                             f"library {LIBRARY[where]!r}"
    for key, value in PAGE_LIBRARY.items():
        assert shown[key] == value, f"Effects page {key}: {shown[key]!r}, library {value!r}"
    for key, (read, value) in PAGE_LISTS.items():
        assert read(shown[key]) == value, f"Effects page {key}: {shown[key]!r}, library {value!r}"
    stray = {box.key for box in _number_boxes()} - set(PAGE_WIDGETS) - set(PAGE_LIBRARY)
    assert not stray, f"number boxes on the Effects page whose default no library function declares: {stray}"


def _number_boxes():
    """The page's number boxes, read from its source: each one's default must be an expression (read off the
    library), never a literal number written on the page."""
    import ast
    from types import SimpleNamespace

    boxes = []
    for node in ast.walk(ast.parse(PAGE.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "number_input":
            named = {k.arg: k.value for k in node.keywords}
            value = node.args[3] if len(node.args) > 3 else named.get("value")
            assert value is not None and not isinstance(value, ast.Constant), \
                f"pages/effects.py line {node.lineno}: a number box with a default of its own"
            boxes.append(SimpleNamespace(key=named["key"].value))
    return boxes


@pytest.mark.parametrize("section,key,bad,argv", [
    ("KV compression", "fx_kv_ratios", "0.5 0.9", ["compress", "--ratios", "0.5 0.9"]),
    ("KV compression", "fx_kv_ratios", "0.5; 0.9", ["compress", "--ratios", "0.5; 0.9"]),
    ("KV compression", "fx_kv_ratios", " , ", ["compress", "--ratios", " , "]),
    ("Linformer what-if", "fx_lin_ks", "4 8", ["linformer", "--text", "Hello there", "--ks", "4 8"]),
    ("Linformer what-if", "fx_lin_ks", "4, 8.5", ["linformer", "--text", "Hello there", "--ks", "4, 8.5"]),
    ("Linformer what-if", "fx_lin_ks", "", ["linformer", "--text", "Hello there", "--ks", ""]),
])
def test_the_effects_page_refuses_what_the_cli_refuses(effects_page, capsys, section, key, bad, argv):
    import re

    from attnviz.cli import main

    assert main(argv) == 2  # refused before a model loads
    cli = re.sub(r"^attnviz: error: --\w+ ", "", capsys.readouterr().err.strip())
    at = effects_page
    at.radio(key="fx_section").set_value(section).run()
    at.text_input(key=key).input(bad).run()
    errors = [re.sub(r"^(Ratios r|k values) ", "", str(e.value)) for e in at.error]
    assert not at.exception and errors == [cli], (errors, cli)
    at.text_input(key=key).input(PAGE_DEFAULT_TEXT[key]).run()  # the next test starts from the default


PAGE_DEFAULT_TEXT = {"fx_kv_ratios": ", ".join(f"{r:g}" for r in D(compress.compress)["ratios"]),
                     "fx_lin_ks": ", ".join(map(str, linformer.KS))}
