"""The lab's command-line inputs (docs/lab.md#inputs-checked-before-anything-is-written): every input of `attnviz
train` checked before its first write and refused in one line (exit 2, nothing written, the corrected command then
runs), the library's `train` refusing what it cannot write, a lab run read only in its own tokens, a model folder
without its tokenizer, options that would have no effect, and the emergence table planned before its first forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnviz.errors import InputError
from attnviz.lab import emergence
from attnviz.lab.tasks import BigramBackcopy
from attnviz.lab.text import Text
from attnviz.lab.train import Setup, train

TINY = ["--width", "16", "--heads", "2", "--steps", "2", "--every", "2", "--batch", "2", "--length", "12"]
SETUP = Setup(width=16, heads=2, steps=2, every=2, batch=2, task=BigramBackcopy(vocab=12, triggers=2, length=12))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("inputs") / "run"
    train(SETUP, out)
    return out


def refused(capsys, argv, *words) -> str:
    """Run ``argv``: exit 2, nothing on stdout, one line on stderr holding each of ``words``."""
    from attnviz.cli import main

    try:
        code = main(argv)
    except SystemExit as exited:  # the parser's own refusals
        code = exited.code
    assert code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


def test_a_text_file_the_task_cannot_read_is_refused_before_anything_is_written(tmp_path, capsys):
    from attnviz.cli import main

    out = tmp_path / "run"
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait ".encode("latin-1") * 10)
    (tmp_path / "short.txt").write_text("hi there")  # 8 bytes: a chunk of 12 needs 11 besides BOS
    for name, words in (("nosuch.txt", "cannot read"), ("latin1.txt", "not UTF-8"), ("short.txt", "has 8 tokens")):
        argv = ["train", "--out", str(out), "--task", "text", "--text-file", str(tmp_path / name), *TINY]
        refused(capsys, argv, words)
        assert not out.exists()  # absent stays absent
    (tmp_path / "short.txt").write_text("hi there, ok")  # 12 bytes: long enough now
    assert main(argv) == 0 and json.loads(capsys.readouterr().out)["checkpoints"] == [0, 1, 2]
    with pytest.raises(InputError, match="cannot read"):  # the library refuses it too, before writing
        train(Setup(width=16, heads=2, steps=2, task=Text(source=str(tmp_path / "gone.txt"), length=12)),
              tmp_path / "lib")
    assert not (tmp_path / "lib").exists()


def test_a_text_exactly_one_chunk_long_is_taken(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("abcdefghijk")  # 11 bytes: BOS and 11 tokens make a chunk of 12
    assert Text(source=str(path), length=12).batch(3).shape == (3, 12)
    with pytest.raises(InputError, match="has 11 tokens: a chunk of 13 tokens needs 12"):
        Text(source=str(path), length=13).batch(1)


def test_a_folder_that_cannot_be_made_is_refused_in_one_line_by_the_command_and_the_library(run, tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out, words in ((a_file / "run", "which is a file"), (a_file, "is a file, not a folder")):
        refused(capsys, ["train", "--out", str(out), *TINY], words)
        with pytest.raises(InputError, match=words):
            train(SETUP, out)
    assert a_file.read_text() == "x"
    checkpoint = run / "step-2"  # a run's checkpoint is no run folder: nothing nested in it
    before = sorted(p.name for p in checkpoint.iterdir())
    refused(capsys, ["train", "--out", str(checkpoint), *TINY], "is a model folder (a checkpoint)", f"'{run}'")
    assert sorted(p.name for p in checkpoint.iterdir()) == before
    if Path("/proc/self").is_dir():  # a place no folder can be made
        refused(capsys, ["train", "--out", "/proc/attnviz-run", *TINY], "cannot make the run folder")
        with pytest.raises(InputError, match="cannot make the run folder"):
            train(SETUP, "/proc/attnviz-run")


def test_an_empty_out_is_refused_and_writes_nothing_in_the_working_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for empty in ("", "  "):
        refused(capsys, ["train", "--out", empty, *TINY], "--out is empty")
        with pytest.raises(InputError, match="folder is empty"):
            train(SETUP, empty)
    assert list(tmp_path.iterdir()) == []


def test_a_seed_outside_the_generators_range_is_refused(tmp_path, capsys):
    from attnviz.cli import build_parser
    from attnviz.cli.train import setup_of
    from attnviz.lab.train import SEEDS

    for seed in (str(2**64), "-1", str(SEEDS), "1.5"):
        refused(capsys, ["train", "--out", str(tmp_path / "run"), "--seed", seed, *TINY], "--seed")
        assert not (tmp_path / "run").exists()
    largest = build_parser("train").parse_args(["train", "--out", "r", "--seed", str(SEEDS - 1)])
    assert setup_of(largest).seed == SEEDS - 1


def test_options_a_task_does_not_take_are_refused(tmp_path, capsys):
    for task in ("bigram", "repeat"):
        refused(capsys, ["train", "--out", str(tmp_path / "run"), "--task", task, "--tokenizer", "bytes"],
                f"--tokenizer is not an option of --task {task}")
    assert not (tmp_path / "run").exists()


def test_words_outside_a_runs_vocabulary_are_refused_naming_its_tokens(run, tmp_path, capsys):
    from attnviz import load
    from attnviz.tokens import tokenize

    with pytest.raises(InputError, match="has no token 'hello'") as err:
        tokenize(load(str(run)), "t5 hello T1")
    assert "<bos> (0), T1 (1), T2 (2), t3 (3)" in str(err.value) and "t11 (11)" in str(err.value)
    refused(capsys, ["sinks", "--model", str(run), "--text", "hello world"], "no token 'hello' (and 1 more)", "t3 (3)")
    out = tmp_path / "t.parquet"
    refused(capsys, ["emergence", str(run), "--out", str(out), "--text", "t5 world"], "no token 'world'")
    assert not out.exists()
    assert tokenize(load(str(run)), "t5 T1 t5")[0] == [0, 5, 1, 5]  # its own tokens read as before


def test_a_model_folder_with_a_config_alone_says_what_it_lacks(run, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((run / "step-2" / "config.json").read_text())
    refused(capsys, ["sinks", "--model", str(bare), "--text", "t5 t6"], "no tokenizer", "no weights")


def test_samples_beside_a_text_is_refused(run, tmp_path, capsys):
    refused(capsys, ["emergence", str(run), "--out", str(tmp_path / "t.parquet"), "--text", "t5 t6", "--samples", "8"],
            "--samples sizes the task's probe")


def test_a_probe_past_the_memory_budget_is_refused_before_any_forward(run, tmp_path, capsys, monkeypatch):
    from attnviz.cli import main
    from attnviz.cli.common import Progress
    from attnviz.core.loading import models
    from attnviz.lab import sizing

    ran = []
    monkeypatch.setattr(emergence, "checkpoint_rows", lambda *a, **k: ran.append(a) or [])
    monkeypatch.setattr(emergence, "task_probe", lambda *a, **k: ran.append(a))  # nothing drawn either
    out = tmp_path / "t.parquet"
    err = refused(capsys, ["emergence", str(run), "--out", str(out), "--samples", str(10**12)],
                  "the emergence table of 1,000,000,000,000 probe sequences of 12 tokens needs ~", "sequences fit")
    assert not ran and not out.exists() and "memory budget" in err
    monkeypatch.undo()
    monkeypatch.setattr(Progress, "EVERY", 0.0)
    assert main(["emergence", str(run), "--out", str(out)]) == 0  # the default probe is planned and runs
    assert "plan: the emergence table of 3 checkpoints on 32 sequences of 12 tokens" in capsys.readouterr().err
    # the plan's arithmetic: the most sequences that fit pass, one more is refused
    found = emergence.checkpoints(run)
    loaded = models.load(str(found[0].folder), dtype="float32")
    plan = emergence.plan(found, loaded, size=64, budget=10**9)
    assert plan.peak == 64 * plan.per_row and plan.steps() == [1.0, 1.0, 1.0]
    budget = 1000 * plan.per_row
    assert emergence.plan(found, loaded, size=1000, budget=budget).fits == 1000
    with pytest.raises(sizing.TableTooLarge, match="at most ~1,000 sequences fit"):
        emergence.plan(found, loaded, size=1001, budget=budget)
    # a sequence's estimate holds at least what the head classes keep of it: every layer's maps in fp32
    assert plan.per_row >= SETUP.layers * SETUP.heads * 12 * 12 * 4
