"""Training cells of `attnviz sweep` (docs/sweeps.md#training-cells): a [train] table read off the lab's dataclasses
and refused before anything runs; a grid of 2 kinds × 2 seeds on a local Ray equal to `--local` and to
`attnviz emergence` of each run; a rerun trains nothing; a worker killed mid-training is retried and ends
bit-identical to an unbroken run; a failed run is recorded and tried again; the grid of trained runs, as numbers and
on the Sweeps page, opening a cell in the Emergence page."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from attnviz.cli import main
from attnviz.errors import InputError
from attnviz.sweep import grid as grid_mod
from attnviz.sweep import spec as spec_mod
from attnviz.sweep import store
from attnviz.sweep import train as train_mod

from test_sweep import write

TINY = """width = 16
heads = 2
every = 10
batch = 4
warmup = 2
vocab = 16
triggers = 2
length = 16
"""
GRID = f"""[train]
kind = ["softmax", "sigmoid"]
seed = [0, 1]
steps = 20
{TINY}[measures.emergence]
samples = 4
"""
NUMBERS = ["loss", "train_loss", "alpha0", "sink_rate", "first_token", "row_mass", "value_drain", "residual_peak",
           "entropy"]


def test_the_train_table_is_read_off_the_lab_dataclasses():
    from dataclasses import fields

    from attnviz.lab.tasks import BigramBackcopy
    from attnviz.lab.train import Setup

    known = train_mod.keys()
    assert set(known["setup"]) == {f.name for f in fields(Setup)} - {"task"}  # whatever fields Setup grows
    assert set(known["bigram"]) == {f.name for f in fields(BigramBackcopy)} - {"seed"}
    grid = spec_mod.parse(GRID.replace("[train]", '[train]\nweight_decay = [0, 0.1]'))
    assert grid.models == [] and list(grid.measures) == ["emergence"] and len(grid.train) == 8
    cell = grid.train[-1]
    assert cell.setup == Setup(kind="sigmoid", seed=1, weight_decay=0.1, steps=20, width=16, heads=2, every=10,
                               batch=4, warmup=2, task=BigramBackcopy(vocab=16, triggers=2, length=16, seed=1))
    assert cell.id.startswith("sigmoid-fwd-wd0.1-s1-") and len({c.id for c in grid.train}) == 8
    assert isinstance(grid.train[0].values["weight_decay"], float)  # 0 taken as the field's float
    # measures default to emergence; each checkpoint × measure is a cell, named by its run and step
    cells = grid.run_cells(cell, "/runs")
    assert [c.model for c in cells] == [f"/runs/{cell.id}/step-{s}" for s in (0, 1, 2, 4, 8, 10, 20)]
    assert cells[0].id.startswith(f"{cell.id}-step0-") and cells[0].arch == "fwd"
    assert grid.run_cells(cell, "/elsewhere")[0].id == cells[0].id  # the same cell wherever the runs are
    # [[train]]: grids joined; the keys another table named are columns of every run
    joined = spec_mod.parse('[[train]]\nkind = ["softmax", "sink"]\n[[train]]\nkind = "softmax"\narch = "stablemask"\n'
                            'seed = [0, 1]\n')
    assert [(c.setup.kind, c.setup.arch, c.setup.seed) for c in joined.train] == [
        ("softmax", "fwd", 0), ("sink", "fwd", 0), ("softmax", "stablemask", 0), ("softmax", "stablemask", 1)]
    assert all(set(c.values) == {"kind", "arch", "seed"} for c in joined.train)
    assert joined.train[0].values["arch"] == "fwd"
    # with models, trained runs join them
    both = spec_mod.parse('models = ["default"]\n[train]\nkind = "softmax"\n[measures.emergence]\n')
    assert len(both.cells()) == 1 and len(both.train) == 1
    text = spec_mod.parse('[train]\ntask = "text"\nlength = 8\ntokenizer = "bytes"\n').train[0].setup.task
    assert type(text).__name__ == "Text" and text.length == 8
    # every task of the lab's registry by its option, the new ones included; an optimizer is a key like any setting
    repeat = spec_mod.parse('[train]\ntask = "repeat"\nlayers = 2\nvocab = 32\nlength = 32\noptimizer = "sgd"\n'
                            'lr = 0.1\n').train[0].setup
    assert type(repeat.task).__name__ == "RepeatedRandom" and repeat.task.vocab == 32 and repeat.optimizer == "sgd"
    assert set(known) == {"setup", "bigram", "repeat", "text"}


def test_the_runs_folder_is_beside_the_results_or_local_for_an_object_store(tmp_path, monkeypatch):
    from attnviz.sweep.run import runs_folder

    monkeypatch.chdir(tmp_path)
    assert runs_folder("/data/results") == "/data/results/runs"
    assert runs_folder("s3://bucket/sweep") == str(tmp_path / "sweep-runs")  # the trainer writes to a file system
    assert runs_folder("s3://bucket/sweep", "shared/runs") == str(tmp_path / "shared" / "runs")


@pytest.mark.parametrize("text,message", [
    ('[train]\nkinds = ["softmax"]\n', "unknown key 'train.kinds'"),
    ('[train]\nlr = "fast"\n', "'train.lr' must be float, got 'fast'"),
    ('[train]\nsteps = 2.5\n', "'train.steps' must be int"),
    ('[train]\nmlp = 1\n', "'train.mlp' must be bool"),
    ('[train]\nseed = []\n', "'train.seed' is empty"),
    ('[train]\nkind = ["softmax", "nope"]\n', "spec: train (kind='nope'):"),
    ('[train]\nwidth = 30\nheads = 4\n', "not a multiple of the 4 heads"),
    ('[train]\ntask = "poems"\n', "'train.task' must be one of bigram, repeat, text"),
    ('[train]\ntask = "text"\nvocab = 32\n', "'train.vocab' is not an option of the text task"),
    ('[train]\nsteps = 0\n', "steps is a whole number of at least 1"),
    ('archs = ["fwd"]\n[train]\n', "'archs' are the models' architectures"),
    ('train = 3\n', "'train' must be a table"),
])
def test_a_bad_train_table_is_refused_before_anything_runs(tmp_path, capsys, text, message):
    out = tmp_path / "results"
    assert main(["sweep", write(tmp_path, text), "--out", str(out), "--local"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def _sweep(spec: str, out: Path, *extra: str, capsys) -> dict:
    assert main(["sweep", spec, "--out", str(out), *extra]) == 0, capsys.readouterr().err[-2000:]
    captured = capsys.readouterr()
    return {"summary": json.loads(captured.out.strip().splitlines()[-1]), "err": captured.err}


@pytest.fixture(scope="module")
def local_grid(tmp_path_factory):
    """The 2 kinds × 2 seeds grid trained and measured in this process (``--local``)."""
    folder = tmp_path_factory.mktemp("local-grid")
    assert main(["sweep", write(folder, GRID), "--out", str(folder / "results"), "--local"]) == 0
    return folder / "results"


def _emergence(out: Path) -> pd.DataFrame:
    rows = store.read(str(out), "emergence")
    return rows.sort_values(["run", "step", "layer", "head"]).reset_index(drop=True)


def test_a_local_grid_is_one_table_of_every_runs_emergence_rows(local_grid):
    from attnviz.lab import emergence

    rows = _emergence(local_grid)
    assert set(rows["status"]) == {"ok"} and rows["run"].nunique() == 4
    assert rows.groupby("run").size().eq(7 * 2).all()  # 7 checkpoints × 1 layer × 2 heads
    assert set(zip(rows["kind"], rows["seed"])) == {("softmax", 0), ("softmax", 1), ("sigmoid", 0), ("sigmoid", 1)}
    assert {"width", "steps", "vocab", "length"} <= set(rows.columns) and set(rows["width"]) == {16}
    assert json.loads(rows["axes"][0])[:2] == ["kind", "seed"]
    assert json.loads(rows["setup"][0])["task"]["vocab"] == 16
    runs = store.read(str(local_grid), "train")
    assert len(runs) == 4 and set(runs["step"]) == {20} and (local_grid / "runs").is_dir()
    # each run's rows are `attnviz emergence RUN`'s table of that run
    run = rows["run"].iloc[0]
    table = emergence.table(local_grid / "runs" / run, size=4)
    mine = rows[rows["run"] == run]
    assert list(mine["step"]) == list(table["step"]) and list(mine["hash"]) == list(table["hash"])
    np.testing.assert_allclose(mine[NUMBERS].to_numpy(float), table[NUMBERS].to_numpy(float), rtol=1e-6, equal_nan=True)


def test_the_grid_on_a_local_ray_equals_local_and_a_rerun_trains_nothing(local_grid, ray_local, tmp_path, capsys):
    out = tmp_path / "results"
    spec = write(tmp_path, GRID)
    first = _sweep(spec, out, "--workers", "2", capsys=capsys)["summary"]
    assert first["cells"] == 4 and first["ok"] == 4 and first["trained_steps"] == 4 * 20
    ray_rows, local_rows = _emergence(out), _emergence(local_grid)
    assert list(ray_rows["run"]) == list(local_rows["run"]) and list(ray_rows["hash"]) == list(local_rows["hash"])
    np.testing.assert_allclose(ray_rows[NUMBERS].to_numpy(float), local_rows[NUMBERS].to_numpy(float), rtol=1e-6,
                               equal_nan=True)
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    again = _sweep(spec, out, capsys=capsys)["summary"]
    assert again["skipped"] == 4 and again["ok"] == 0 and again["trained_steps"] == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps  # nothing written again


def _training_pids() -> list[int]:
    """Ray worker processes training a run right now (Ray titles them ``ray::_ray_training``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"ray::_ray_training" in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_a_worker_killed_mid_training_resumes_bit_identical(ray_local, tmp_path, capsys):
    from attnviz.core.loading import runs
    from attnviz.lab.train import train

    text = f"[train]\nkind = \"softmax\"\nseed = 3\nsteps = 60\n{TINY.replace('every = 10', 'every = 20')}"
    (cell,) = spec_mod.parse(text).train
    out = tmp_path / "results"
    folder = out / "runs" / cell.id
    seen = {}

    def kill_mid_run() -> None:
        deadline = time.time() + 300
        while time.time() < deadline and "pid" not in seen:
            pids = _training_pids()
            if pids and (folder / "step-2").is_dir():
                seen["steps"] = runs.steps_of(folder)
                seen["step0"] = (folder / "step-0" / runs.RUN_FILE).stat().st_mtime_ns
                os.kill(pids[0], signal.SIGKILL)
                seen["pid"] = pids[0]
            time.sleep(0.05)

    killer = threading.Thread(target=kill_mid_run)
    killer.start()
    summary = _sweep(write(tmp_path, text), out, capsys=capsys)["summary"]
    killer.join()
    assert "pid" in seen and 60 not in seen["steps"], seen  # killed mid-run, then retried by Ray
    assert summary["ok"] == 1 and summary["failed"] == 0
    assert (folder / "step-0" / runs.RUN_FILE).stat().st_mtime_ns == seen["step0"]  # resumed, not started over
    unbroken = train(cell.setup, tmp_path / "unbroken")
    assert runs.meta(runs.last(folder))["hash"] == runs.meta(unbroken)["hash"]
    assert runs.steps_of(folder) == runs.steps_of(tmp_path / "unbroken")
    assert len(store.read(str(out), "emergence")) == len(cell.setup.checkpoints()) * 2


def test_a_local_run_killed_after_a_checkpoint_resumes_bit_identical(tmp_path, capsys):
    """--local: the training stopped after its step-4 checkpoint (Ctrl-C), then the same command again."""
    from attnviz.core.loading import runs
    from attnviz.lab.train import train
    from attnviz.sweep import run as run_mod

    grid = spec_mod.parse(f"[train]\nseed = 4\nsteps = 12\n{TINY}[measures.emergence]\nsamples = 2\n")
    out = tmp_path / "results"

    def stop(run, step, steps, loss):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_mod.sweep(grid, out, local=True, on_step=stop)
    folder = out / "runs" / grid.train[0].id
    assert runs.steps_of(folder) == [0, 1, 2, 4] and not store.done(str(out))
    summary = run_mod.sweep(grid, out, local=True)
    assert summary.ok == 1 and summary.trained == 12 - 4
    assert runs.meta(runs.last(folder))["hash"] == runs.meta(train(grid.train[0].setup, tmp_path / "whole"))["hash"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the failure is asking for a GPU there is none of")
def test_a_failed_run_is_recorded_and_tried_again(tmp_path, capsys):
    text = f"[train]\ndevice = \"cuda\"\nsteps = 2\n{TINY}"
    out = tmp_path / "results"
    for _ in range(2):
        assert main(["sweep", write(tmp_path, text), "--out", str(out), "--local"]) == 2
        assert "1 of 1 cells failed" in capsys.readouterr().err
        failed = store.read(str(out), "train")
        assert list(failed["status"]) == ["failed"] and "no CUDA GPU" in failed["error"][0]
        assert [p.name for p in (out / "train").iterdir()] == [f"{spec_mod.parse(text).train[0].id}.failed.parquet"]


def _frame(first_tokens: dict, steps=(0, 10, 20)) -> pd.DataFrame:
    """Emergence rows of hand-made runs: {(kind, wd, seed): [first token per step]} (2 heads, the mean given)."""
    rows = []
    for (kind, wd, seed), shares in first_tokens.items():
        run = f"{kind}-wd{wd}-s{seed}"
        for step, share in zip(steps, shares):
            for head, delta in ((0, -0.05), (1, 0.05)):
                rows.append(dict(measure="emergence", status="ok", run=run, axes='["kind", "weight_decay", "seed"]',
                                 kind=kind, arch="fwd", seed=seed, weight_decay=wd, step=step, layer=0, head=head,
                                 first_token=share + delta, row_mass=1.0 - share / 10,
                                 checkpoint=f"/r/runs/{run}/step-{step}"))
    return pd.DataFrame(rows)


def test_the_grid_of_trained_runs_by_hand():
    frame = _frame({("softmax", 0.0, 0): [0.1, 0.6, 0.8], ("softmax", 0.0, 1): [0.1, 0.3, 0.7],
                    ("softmax", 0.1, 0): [0.1, 0.2, 0.3], ("sigmoid", 0.0, 0): [0.1, 0.1, 0.1]})
    assert grid_mod.axes(frame) == ["kind", "weight_decay", "seed", "arch"]
    assert grid_mod.default_axes(frame) == ("kind", "weight_decay")
    table = grid_mod.grid(frame, "kind", "weight_decay").set_index(["kind", "weight_decay"])
    both = table.loc[("softmax", 0.0)]
    assert both["runs"] == 2 and both["formed"] == 2  # 0.6 > 0.5 at step 10 (seed 0), 0.7 at step 20 (seed 1)
    assert (both["sink_step_mean"], both["sink_step_min"], both["sink_step_max"]) == (15, 10, 20)
    assert both["first_token_mean"] == pytest.approx(0.75) and both["first_token_min"] == pytest.approx(0.7)
    assert both["row_mass_max"] == pytest.approx(1 - 0.07) and both["runs_folder"] == "/r/runs"
    assert sorted(both["names"]) == ["softmax-wd0.0-s0", "softmax-wd0.0-s1"]
    never = table.loc[("softmax", 0.1)]
    assert never["formed"] == 0 and pd.isna(never["sink_step_mean"]) and never["first_token_mean"] == pytest.approx(0.3)
    from attnviz.figures.sweeps import grid_figure

    fig = grid_figure(grid_mod.grid(frame, "kind", "weight_decay"), "kind", "weight_decay")
    assert list(fig.data[0].y) == ["sigmoid", "softmax"] and list(fig.data[0].x) == ["0.0", "0.1"]
    assert fig.data[0].text[1][0] == "15 (10–20)<br>2 of 2 runs" and fig.data[0].text[1][1].startswith("never")
    with pytest.raises(InputError, match="both 'kind'"):
        grid_mod.grid(frame, "kind", "kind")
    with pytest.raises(InputError, match="'lr' is not a key"):
        grid_mod.grid(frame, "kind", "lr")


def test_the_sweeps_page_draws_the_grid_and_opens_a_cell_in_emergence(local_grid, tmp_path):
    from test_app import app_test, arr, charts, title

    at = app_test(tmp_path)
    at.switch_page(str(Path(__file__).resolve().parent.parent / "pages" / "sweeps.py")).run()
    at.text_input(key="sw_folder").input(str(local_grid)).run()
    assert not at.exception, [e.value for e in at.exception]
    (fig,) = [c for c in charts(at) if "Trained runs" in str(title(c))]
    assert "kind × seed" in title(fig) and fig["data"][0]["y"] == ["sigmoid", "softmax"]
    expected = grid_mod.grid(store.read(str(local_grid)), "kind", "seed")
    assert at.radio(key="sw_grid_value").value == "sink_step"
    at.radio(key="sw_grid_value").set_value("first_token").run()
    (fig,) = [c for c in charts(at) if "Trained runs" in str(title(c))]
    z = arr(fig["data"][0]["z"])
    np.testing.assert_allclose(z.ravel(), expected["first_token_mean"].to_numpy(float))
    at.selectbox(key="sw_grid_cols").set_value("arch").run()
    (fig,) = [c for c in charts(at) if "Trained runs" in str(title(c))]
    assert "kind × arch" in title(fig) and "2 runs" in fig["data"][0]["text"][0][0]
    at.text_area(key="sw_spec").input(GRID).run()  # a training grid is not run by the page
    at.button(key="sw_run").click().run()
    assert "Training grids ([train]) run with `attnviz sweep" in " ".join(str(e.value) for e in at.error)
    at.selectbox(key="sw_grid_cell").set_value(1).run()  # softmax · fwd: both seeds
    at.button(key="sw_grid_open").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value.startswith("Emergence") and not at.warning, [w.value for w in at.warning]
    assert at.text_input(key="em_folder").value == str(local_grid / "runs")
    assert sorted(at.multiselect(key="em_runs").value) == sorted(r for r in os.listdir(local_grid / "runs")
                                                                  if r.startswith("softmax"))
