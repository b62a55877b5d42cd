"""`attnviz sweep`: a grid on a local Ray, results as Parquet equal to the plain CLI's,
resumable after an interruption, failures recorded, bad specs refused before anything runs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from attnviz.cli import main
from attnviz.sweep import spec as spec_mod
from attnviz.sweep import store

ROOT = Path(__file__).resolve().parent.parent
README_SPEC = spec_mod.EXAMPLE


def write(tmp_path, text: str) -> str:
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return str(path)


def test_the_documented_example_is_the_shipped_one():
    assert README_SPEC.strip() in (ROOT / "docs" / "sweeps.md").read_text()
    assert (ROOT / "examples" / "sinks.toml").read_text() == README_SPEC


@pytest.mark.parametrize("text,message", [
    ("models = [\"default\"\n", "not valid TOML"),
    ('models = ["default"]\nmodel = ["x"]\n[measures.sinks]\n', "unknown key 'model'"),
    ('models = ["default"]\n[measures.sink]\n', "unknown measure 'measures.sink'"),
    ('models = ["default"]\n[measures.sinks]\nsample = 4\n', "unknown option 'measures.sinks.sample'"),
    ('models = ["default"]\n[measures.sinks]\nsamples = "four"\n', "'measures.sinks.samples' must be int"),
    ('models = ["default"]\narchs = []\n[measures.sinks]\n', "'archs' is empty"),
    ('models = []\n[measures.sinks]\n', "'models' is empty"),
    ('models = ["default"]\n', "'measures' is empty"),
    ('models = ["default"]\narchs = ["bidr"]\n[measures.sinks]\n', "archs: 'bidr'"),
    ('models = ["default"]\ncorpora = ["stdlib:nope"]\n[measures.sinks]\n', "no stdlib topic 'nope'"),
    ('models = ["default"]\ninterventions = ["sinkscale(beta=-1)"]\n[measures.sinks]\n', "interventions:"),
])
def test_a_bad_spec_is_refused_before_anything_runs(tmp_path, capsys, text, message):
    out = tmp_path / "results"
    assert main(["sweep", write(tmp_path, text), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_the_grid_is_the_product_and_measures_without_interventions_collapse():
    grid = spec_mod.parse('models = ["a", "b"]\narchs = ["fwd", "nosink-fwd"]\ninterventions = ["", "temperature(t=2)"]\n'
                          'corpora = ["stdlib", "stdlib:specialnames"]\n[measures.sinks]\n[measures.embed]\n')
    cells = grid.cells()
    assert sum(c.measure == "sinks" for c in cells) == 2 * 2 * 2 * 2
    assert sum(c.measure == "embed" for c in cells) == 2 * 2 * 2  # no intervention axis
    assert len({c.id for c in cells}) == len(cells)
    assert [c.model for c in cells] == sorted(c.model for c in cells)  # model by model


def sinks_cli(arch: str, capsys) -> dict:
    assert main(["sinks", "--corpus", "stdlib", "--per-doc", "--max-len", "32", "--samples", "4", "--eps", "0.3",
                 "--arch", arch, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_readme_spec_on_a_local_ray_equals_the_plain_cli(model_cache, ray_local, tmp_path, capsys):
    out = tmp_path / "results"
    assert main(["sweep", write(tmp_path, README_SPEC), "--out", str(out), "--workers", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["cells"] == 2 and summary["ok"] == 2 and summary["failed"] == 0
    rows = store.read(str(out), "sinks")
    assert len(rows) == 2 * 30 and set(rows["status"]) == {"ok"}
    assert len(set(rows["worker"])) >= 1 and (rows["elapsed_s"] > 0).all()
    from attnviz.recipe import Recipe

    made = {r["arch"]: Recipe.from_dict(json.loads(r["recipe_json"])) for _, r in rows.iterrows()}
    assert made["nosink-fwd"].arch == "nosink-fwd" and made["fwd"].key == rows[rows["arch"] == "fwd"]["recipe"].iloc[0]
    assert json.loads(rows["versions"][0])["attnviz"]
    for arch in ("fwd", "nosink-fwd"):
        expected = sinks_cli(arch, capsys)
        got = rows[rows["arch"] == arch].sort_values("layer")
        want = [l["sink_rate"]["mean"] for l in expected["layers"]]
        np.testing.assert_allclose(got["sink_rate"].to_numpy(dtype=float), np.array(want, dtype=float), atol=1e-6)
        assert got["model_rate"].iloc[0] == pytest.approx(expected["model_rate"]["mean"], abs=1e-6)
    # again: every cell is on disk, nothing runs
    assert main(["sweep", write(tmp_path, README_SPEC), "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == 2


def test_a_model_that_fails_to_load_is_recorded_and_the_others_run(model_cache, tmp_path, capsys):
    text = README_SPEC.replace('models = ["default"]', 'models = ["default", "no-such-org/no-such-model"]')
    text = text.replace('archs = ["fwd", "nosink-fwd"]', 'archs = ["fwd"]')
    out = tmp_path / "results"
    assert main(["sweep", write(tmp_path, text), "--out", str(out), "--local"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()  # a progress line per cell (no terminal), then the one error
    assert [line.startswith("cell ") for line in err[:-1]] == [True, True]
    assert err[-1].startswith("attnviz: error: 1 of 2 cells failed") and "no-such-org/no-such-model" in err[-1]
    rows = store.read(str(out))
    ok, failed = rows[rows["status"] == "ok"], rows[rows["status"] == "failed"]
    assert set(ok["model"]) == {"default"} and len(ok) == 30
    assert list(failed["model"]) == ["no-such-org/no-such-model"] and "no-such-org/no-such-model" in failed["error"][0]


def test_an_interrupted_sweep_resumes_without_losing_or_duplicating_a_cell(model_cache, tmp_path):
    """The sweep is killed after its first cell; the rerun skips it and runs the rest, once each."""
    text = README_SPEC.replace('corpora = ["stdlib"]', 'corpora = ["stdlib", "stdlib:specialnames", "stdlib:assert"]')
    spec_path, out = write(tmp_path, text), tmp_path / "results"
    command = [sys.executable, "-m", "attnviz", "sweep", spec_path, "--out", str(out), "--workers", "1"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 300
    while not list(out.glob("sinks/*.parquet")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver mid-sweep; its Ray goes down with it (fate sharing)
    proc.wait()
    deadline = time.time() + 60  # a worker already inside a cell may still finish it: wait until none is
    while _task_pids() and time.time() < deadline:
        time.sleep(0.2)
    first = {p.name for p in out.glob("sinks/*.parquet")}
    assert 1 <= len(first) < 6, first
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads(again.stdout)
    assert summary["skipped"] == len(first) and summary["ok"] == 6 - len(first)
    cells = {c.id for c in spec_mod.parse(text).cells()}
    files = sorted(p.name for p in out.glob("sinks/*.parquet"))
    assert files == sorted(f"{c}.parquet" for c in cells)  # every cell once
    rows = store.read(str(out), "sinks")
    assert len(rows) == 6 * 30 and rows.groupby("cell").size().eq(30).all()


def _task_pids() -> list[int]:
    """Ray worker processes running a cell right now (Ray titles them ``ray::_ray_cell``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"ray::_ray_cell" in cmdline:
                pids.append(int(entry.name))
    return pids


def test_a_worker_killed_mid_cell_is_retried_and_no_cell_is_lost_or_doubled(model_cache, ray_local, tmp_path,
                                                                             capsys):
    import threading

    text = README_SPEC.replace('corpora = ["stdlib"]', 'corpora = ["stdlib", "stdlib:specialnames"]')
    out = tmp_path / "results"
    killed = []

    def kill_one() -> None:
        deadline = time.time() + 240
        while time.time() < deadline and not killed:
            pids = _task_pids()
            if pids:
                time.sleep(1.0)  # inside the cell (its model loaded), not at its first line
                try:
                    os.kill(pids[0], signal.SIGKILL)
                    killed.append(pids[0])
                except ProcessLookupError:
                    continue
            time.sleep(0.1)

    killer = threading.Thread(target=kill_one)
    killer.start()
    code = main(["sweep", write(tmp_path, text), "--out", str(out)])
    killer.join()
    assert killed, "no worker was running a cell"
    assert code == 0, capsys.readouterr().err
    out_lines = capsys.readouterr().out.strip().splitlines()  # Ray reports the dead worker on stdout first
    summary = json.loads(out_lines[-1])
    assert summary["ok"] == 4 and summary["failed"] == 0
    cells = {c.id for c in spec_mod.parse(text).cells()}
    assert sorted(p.name for p in out.glob("sinks/*.parquet")) == sorted(f"{c}.parquet" for c in cells)
    rows = store.read(str(out), "sinks")
    assert len(rows) == 4 * 30 and rows.groupby("cell").size().eq(30).all()


def test_the_sweeps_page_reads_a_results_folder_and_runs_a_small_sweep(model_cache, ray_local, tmp_path):
    from test_app import app_test, arr, charts, on_page

    out = tmp_path / "results"
    at = app_test(tmp_path)
    at.run()
    on_page(at, "pages/sweeps.py")
    at.text_input(key="sw_folder").input(str(out)).run()
    assert "No results" in " ".join(str(i.value) for i in at.info)
    at.text_area(key="sw_spec").input(README_SPEC.replace('archs = ["fwd", "nosink-fwd"]', 'archs = ["nosink-fwd"]')).run()
    at.button(key="sw_run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert "1 cells done" in " ".join(str(s.value) for s in at.success)
    table = at.dataframe[0].value
    assert list(table["arch"]) == ["nosink-fwd"] and list(table["status"]) == ["ok"]
    (fig,) = [c for c in charts(at) if "sink rate per layer" in str(c["layout"].get("title", ""))]
    trace = fig["data"][0]
    assert len(arr(trace["x"])) == 30 and trace["error_y"]["type"] == "data"
    rows = store.read(str(out), "sinks")
    np.testing.assert_allclose(np.asarray(arr(trace["y"]), dtype=float),
                               rows.sort_values("layer")["sink_rate"].to_numpy(dtype=float) * 100)
    labels = [b.proto.label for b in at.get("download_button")]
    assert "All rows (.csv)" in labels and "sinks rows (.csv)" in labels
    at.text_area(key="sw_spec").input(README_SPEC.replace('"default"', '"some-org/elsewhere"')).run()
    at.button(key="sw_run").click().run()
    assert "the page sweeps models this server has loaded" in " ".join(str(e.value) for e in at.error)
    at.text_area(key="sw_spec").input('models = ["default"]\n[measures.sink]\n').run()
    at.button(key="sw_run").click().run()
    assert "unknown measure 'measures.sink'" in " ".join(str(e.value) for e in at.error)


def test_auto_key_is_the_first_key_the_mask_leaves_open():
    from attnviz.core.spec import arch
    from attnviz.stats import metrics

    for spec, expected in [("fwd", 0), ("bidir", 0), ("nosink-fwd", 1), ("nosink-fwd(m=3)", 3),
                           ("nosink-bidir(m=2)", 2), ("back", 0), ("global(w=2, g=1)", 0)]:
        (mask,) = set(arch.parse(spec, 1).layers)
        assert metrics.auto_key(mask.matrix(8)) == expected, spec
    # written out: key 1 is hidden from query 3 only, so the first open key is 2
    allowed = np.tril(np.ones((5, 5), dtype=bool))
    allowed[1:, 0] = False
    allowed[3, 1] = False
    assert metrics.auto_key(allowed) == 2


def test_results_of_mixed_cells_read_as_one_table(tmp_path):
    """One schema for every measure: a cell whose numbers are all null (NoSink at key 0) beside a full one,
    and another measure's cell, read with pandas and pyarrow.dataset straight from the folder."""
    import pandas as pd
    import pyarrow.dataset as ds

    from attnviz.sweep.measures import COLUMNS
    from attnviz.sweep.spec import Cell

    out = tmp_path / "results"
    options = {"samples": 2, "max_len": 8, "eps": 0.3, "unit": "doc", "key": 0}
    full = [{"layer": l, "mask": "fwd", "key": 0, "sink_rate": 0.5 + l / 10, "ci_low": 0.4, "ci_high": 0.6, "n": 2,
             "model_rate": 0.55, "model_ci_low": 0.5, "model_ci_high": 0.6, "samples": 2} for l in range(2)]
    empty = [{"layer": l, "mask": "nosink-fwd", "key": 0, "sink_rate": None, "ci_low": None, "ci_high": None, "n": 0,
              "model_rate": None, "model_ci_low": None, "model_ci_high": None, "samples": 2} for l in range(2)]
    store.write_cell(str(out), Cell("sinks", "default", "fwd", "", "stdlib", options), full, 1.0)
    store.write_cell(str(out), Cell("sinks", "default", "nosink-fwd", "", "stdlib", options), empty, 1.0)
    store.write_cell(str(out), Cell("eval", "default", "fwd", "", "stdlib", {"window": 8}),
                     [{"perplexity": 9.5, "accuracy": 0.3, "nll": 2.25, "tokens": 64, "windows": 8}], 1.0)
    store.write_cell(str(out), Cell("embed", "default", "fwd", "", "stdlib", {"m": 4}), [], 1.0, error="boom")
    frame = pd.read_parquet(out)
    assert len(frame) == 6 and frame["sink_rate"].dtype == "float64" and frame["perplexity"].notna().sum() == 1
    assert frame.loc[frame["arch"] == "nosink-fwd", "sink_rate"].isna().all()
    table = ds.dataset(str(out), format="parquet").to_table()
    assert table.num_rows == 6 and str(table.schema.field("sink_rate").type) == "double"
    assert set(store.read(str(out))["status"]) == {"ok", "failed"} and len(store.read(str(out), "sinks")) == 4
    with pytest.raises(ValueError, match="outside its schema"):
        store.write_cell(str(out), Cell("eval", "m", "fwd", "", "stdlib", {}), [{"perplexity": 1.0, "bogus": 1}], 1.0)
    assert set(COLUMNS["sinks"]) == set(full[0])


def test_the_sinks_measure_reads_nosink_at_its_open_key(model_cache, tmp_path, capsys):
    """The README example: with key = auto, NoSink-FWD's rate is read at key 1 and is defined in every layer."""
    from attnviz.sweep import measures
    from attnviz.sweep.spec import parse as parse_spec
    from attnviz.core.loading.models import load

    grid = parse_spec(README_SPEC)
    cell = [c for c in grid.cells() if c.arch == "nosink-fwd"][0]
    assert cell.options["key"] == "auto"
    rows = measures.sinks(load("default"), cell)
    assert {r["key"] for r in rows} == {1} and all(r["sink_rate"] is not None for r in rows)
    assert set(rows[0]) == set(measures.COLUMNS["sinks"])
    doc = sinks_cli("nosink-fwd", capsys)
    assert doc["key"] == "auto" and {l["key"] for l in doc["layers"]} == {1}
    np.testing.assert_allclose([r["sink_rate"] for r in rows], [l["sink_rate"]["mean"] for l in doc["layers"]],
                               atol=1e-6)
