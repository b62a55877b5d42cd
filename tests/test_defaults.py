"""Defaults are declared once, on the library (attnviz.defaults): the CLI's options, the sweep's
measure options and the library signatures must agree, and every numeric CLI default must come from
one of the library places listed here."""

import argparse

import pytest

from attnviz.effects import dataset, embedding, evaluate, finetune, generate, heads, linformer, streaming
from attnviz import defaults, doctor
from attnviz.stats import metrics
from attnviz.cli import ALL, COMMANDS, build_parser
from attnviz.kv import compress
from attnviz.reports import html
from attnviz import flow
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
    ("linformer", "ks"): ",".join(map(str, linformer.KS)), ("linformer", "projection"): D(linformer.whatif)["kind"],
    ("generate", "policy"): D(generate.generate)["policy"],
    ("generate", "max_new_tokens"): D(generate.generate)["max_new_tokens"],
    ("report", "size"): D(html.report_html)["size"], ("report", "images"): D(html.report_html)["image_format"],
    ("report", "quality"): D(html.report_html)["quality"],
    ("routes", "token"): D(flow.routes)["token"], ("routes", "threshold"): D(flow.routes)["threshold"],
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
