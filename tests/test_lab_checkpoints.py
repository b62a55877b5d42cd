"""A run folder's integrity (docs/lab.md#what-a-run-folder-holds-and-how-it-is-checked): the trainer removes only the
partial folders it made, a damaged checkpoint is refused in one line (resuming, measuring, loading) naming it and
what to do, a checkpoint's weights must be the ones its record hashes, and a run that diverges stops with every
checkpoint it wrote finite."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pandas as pd
import pytest
import torch

import attnviz
from attnviz.cli import main
from attnviz.core.loading import runs
from attnviz.errors import Diverged, InputError
from attnviz.lab import emergence
from attnviz.lab.runs import open_run
from attnviz.lab.tasks import BigramBackcopy
from attnviz.lab.train import PARTIAL, Setup, last, train

TASK = dict(vocab=12, triggers=2, length=12)
SIZES = dict(layers=1, width=16, heads=2, batch=2, warmup=1, every=2)
#: the command line of the same setup (its task's seed is the run's, 0)
ARGS = ["--width", "16", "--heads", "2", "--batch", "2", "--warmup", "1", "--every", "2", "--vocab", "12",
        "--triggers", "2", "--length", "12"]


def tiny(**changes) -> Setup:
    return Setup(**{**SIZES, "steps": 4, "task": BigramBackcopy(**TASK), **changes})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run of four steps: checkpoints at 0, 1, 2 and 4."""
    out = tmp_path_factory.mktemp("checkpoints") / "run"
    train(tiny(), out)
    return out


def copy(run, tmp_path, name="copy"):
    shutil.copytree(run, tmp_path / name)
    return tmp_path / name


def listing(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def refused(capsys, argv) -> str:
    """The command's one line on stderr: exit 2, nothing on stdout (what earlier calls printed is read first)."""
    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("attnviz: error:")
    return err


def edit_record(folder, change) -> None:
    path = folder / runs.RUN_FILE
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def test_a_checkpoint_records_the_sha256_of_its_weights_and_config(run):
    record = json.loads((run / "step-4" / runs.RUN_FILE).read_text())
    assert record["sha256"] == {name: hashlib.sha256((run / "step-4" / name).read_bytes()).hexdigest()
                                for name in ("model.safetensors", "config.json")}
    assert not list(run.glob(".*")) and not (run / "step-4" / PARTIAL).exists()  # the mark goes before the rename


def test_a_partial_folder_the_trainer_did_not_make_is_never_removed(tmp_path, capsys):
    out = tmp_path / "run"
    (out / ".step-3.partial").mkdir(parents=True)
    (out / ".step-3.partial" / "mine.txt").write_text("mine")
    (out / ".step-16.partial").mkdir()  # the trainer's own, left by a killed process: removed
    (out / ".step-16.partial" / PARTIAL).touch()
    train(tiny(), out)
    train(tiny(steps=6), out)  # a resume
    assert (out / ".step-3.partial" / "mine.txt").read_text() == "mine"
    assert not (out / ".step-16.partial").exists() and runs.steps_of(out) == [0, 1, 2, 4, 6]
    # one the run would write through is refused before anything is written, and kept
    (out / ".step-8.partial").mkdir()
    (out / ".step-8.partial" / "mine.txt").write_text("mine too")
    before = listing(out)
    with pytest.raises(InputError, match=r"\.step-8\.partial is not the trainer's .* move it out") as err:
        train(tiny(steps=8), out)
    assert "\n" not in str(err.value) and listing(out) == before
    err = refused(capsys, ["train", "--out", str(out), "--steps", "8", *ARGS])
    assert ".step-8.partial is not the trainer's" in err and listing(out) == before


def _weights_deleted(folder):
    (folder / "model.safetensors").unlink()


def _weights_cut_short(folder):
    os.truncate(folder / "model.safetensors", (folder / "model.safetensors").stat().st_size // 2)


def _optimizer_cut_short(folder):
    os.truncate(folder / "optimizer.pt", (folder / "optimizer.pt").stat().st_size // 2)


def _no_setup(folder):
    edit_record(folder, lambda record: record.pop("setup"))


def _not_an_object(folder):
    (folder / runs.RUN_FILE).write_text("[1, 2]")


def _kind_edited(folder):  # softmax weights with a record that says softpick
    def softpick(record):
        record["setup"]["kind"] = record["recipe"]["kind"] = "softpick"

    edit_record(folder, softpick)


def _config_edited(folder):  # the record's kind and the config's both edited: the config's SHA-256 is another
    _kind_edited(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attnviz_kind": "softpick"}))


DAMAGES = {
    "weights deleted": (_weights_deleted, "its model.safetensors is missing"),
    "weights cut short": (_weights_cut_short, "its model.safetensors is not the file its attnviz_run.json records"),
    "optimizer cut short": (_optimizer_cut_short, "its optimizer.pt cannot be read"),
    "no setup": (_no_setup, "its attnviz_run.json has no setup"),
    "not an object": (_not_an_object, "its attnviz_run.json is not a JSON object"),
    "kind edited": (_kind_edited, "says kind softpick, but its weights were trained as softmax"),
    "config edited": (_config_edited, "its config.json is not the file its attnviz_run.json records"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_last_checkpoint_is_refused_in_one_line_resuming_measuring_and_loading(run, tmp_path, capsys,
                                                                                           damage):
    spoil, words = DAMAGES[damage]
    folder = copy(run, tmp_path)
    spoil(folder / "step-4")
    before = listing(folder)
    # resuming: the library and the command, nothing written
    with pytest.raises(InputError) as err:
        train(tiny(steps=6), folder)
    message = str(err.value)
    assert "\n" not in message and f"{folder / 'step-4'} is damaged" in message and words in message
    assert message.endswith("move step-4 aside to resume from step-2")
    err = refused(capsys, ["train", "--out", str(folder), "--steps", "6", *ARGS])
    assert words in err and listing(folder) == before
    # measuring, loading: the optimizer's state is no part of either
    table = tmp_path / "table.parquet"
    if damage == "optimizer cut short":
        assert main(["emergence", str(folder), "--out", str(table), "--samples", "2"]) == 0
        assert sorted(set(pd.read_parquet(table)["step"])) == [0, 1, 2, 4]
        assert open_run(folder).steps == (0, 1, 2, 4) and attnviz.load(str(folder), device="cpu").n_layers == 1
        return
    err = refused(capsys, ["emergence", str(folder), "--out", str(table), "--samples", "2"])
    assert words in err and "step-4" in err and "move step-4 aside to measure the run without it" in err
    assert not table.exists()
    for load in (lambda: open_run(folder), lambda: attnviz.load(str(folder), device="cpu"),
                 lambda: attnviz.load(str(folder / "step-4"), device="cpu")):
        with pytest.raises(InputError) as err:
            load()
        assert "\n" not in str(err.value) and words in str(err.value)
        assert str(err.value).endswith("move step-4 aside to use the run up to step-2")
    # moved aside, the run resumes from the checkpoint before it
    (folder / "step-4").rename(tmp_path / "aside")
    assert last(train(tiny(steps=6), folder).parent).name == "step-6"


def test_a_damaged_checkpoint_before_the_last_is_refused_where_it_is_read(run, tmp_path):
    folder = copy(run, tmp_path)
    _weights_cut_short(folder / "step-1")
    with pytest.raises(InputError, match="step-1 is damaged.*move step-1 aside to measure the run without it"):
        emergence.table(folder, size=2)
    with pytest.raises(InputError, match="step-1 is damaged.*load another of its steps, or move step-1 aside"):
        open_run(folder).checkpoint(1)
    assert open_run(folder).checkpoint(4) == folder / "step-4"  # the others still load


def test_a_checkpoint_saved_before_records_held_a_sha256_still_loads_and_resumes(run, tmp_path):
    folder = copy(run, tmp_path)
    for step in runs.steps_of(folder):
        edit_record(folder / f"step-{step}", lambda record: record.pop("sha256"))
    assert open_run(folder).meta(4)["step"] == 4 and emergence.Checkpoint.of(folder / "step-4").step == 4
    _weights_cut_short(folder / "step-4")  # its header still says how long it is
    with pytest.raises(InputError, match="its model.safetensors is cut short or is no safetensors file"):
        attnviz.load(str(folder), device="cpu")
    (folder / "step-4").rename(tmp_path / "aside")
    assert json.loads((train(tiny(steps=6), folder) / runs.RUN_FILE).read_text())["step"] == 6


def test_a_last_folder_without_its_record_is_refused_before_training(run, tmp_path, capsys):
    folder = copy(run, tmp_path)
    (folder / "step-4" / runs.RUN_FILE).unlink()  # a checkpoint cut short: the run's last is now step-2
    before = listing(folder)
    with pytest.raises(InputError) as err:
        train(tiny(), folder)
    message = str(err.value)
    assert "\n" not in message and str(folder / "step-4") in message and "holds no attnviz_run.json" in message
    assert message.endswith("move it aside to resume from step-2") and listing(folder) == before
    err = refused(capsys, ["train", "--out", str(folder), *ARGS])
    assert "move it aside to resume from step-2" in err and listing(folder) == before
    (folder / "step-4").rename(tmp_path / "aside")
    assert train(tiny(), folder) == folder / "step-4"


def test_a_diverging_run_stops_and_keeps_only_finite_checkpoints(tmp_path, capsys):
    from attnviz.lab import models

    setup = tiny(lr=1e30, steps=8)
    with pytest.raises(Diverged) as err:
        train(setup, tmp_path / "run")
    kept = err.value.kept
    assert "\n" not in str(err.value) and f"diverged at step {err.value.step}" in str(err.value)
    assert kept == last(tmp_path / "run") and err.value.step > runs.meta(kept)["step"] and kept.name in str(err.value)
    for step in runs.steps_of(tmp_path / "run"):
        record = runs.meta(tmp_path / "run" / f"step-{step}")
        assert step == 0 or (record["loss"] is not None and record["loss"] == record["loss"])
        model = models.load(setup, tmp_path / "run" / f"step-{step}")
        assert all(torch.isfinite(p).all() for p in model.parameters()), step
    assert not list((tmp_path / "run").glob(".*"))
    err = refused(capsys, ["train", "--out", str(tmp_path / "cli"), "--steps", "8", "--lr", "1e30", *ARGS])
    assert "diverged at step" in err and "kept in" in err


@pytest.mark.parametrize("given", [["--lr", "inf"], ["--weight-decay", "inf"], ["--lr", "nan"], ["--lr", "-1"],
                                   ["--optimizer", "sgd", "--momentum", "inf"]])
def test_optimizer_numbers_out_of_range_are_refused_before_anything_is_written(tmp_path, capsys, given):
    refused(capsys, ["train", "--out", str(tmp_path / "run"), "--steps", "2", *ARGS, *given])
    assert not (tmp_path / "run").exists()


def test_a_learning_rate_or_weight_decay_that_is_not_finite_writes_nothing_in_the_library(tmp_path):
    for changes in (dict(lr=float("inf")), dict(weight_decay=float("inf"))):
        with pytest.raises(InputError, match="not inf") as err:  # the setup refuses it, before train is called
            train(tiny(**changes), tmp_path / "run")
        assert "\n" not in str(err.value) and not (tmp_path / "run").exists()
