"""The Emergence page (docs/app.md#every-page) through AppTest, on a tiny run trained here: with the real
``attnviz.lab.emergence.table`` once, and elsewhere with the faster :func:`table_of` of the same columns in its place
(the page reaches the table through ``ui.emergence.table`` alone); and its figures as pure functions of such a
table."""

import json
import shutil

import numpy as np
import pandas as pd
import pytest

from attnviz.errors import InputError
from attnviz.figures import emergence as E
from attnviz.core.loading.models import load
from attnviz.core.loading.runs import steps_of
from attnviz.lab.runs import find_runs, open_run, probe_text
from attnviz.lab.tasks import BigramBackcopy
from attnviz.lab.train import Setup, train
from test_app import ROOT, app_test, arr, charts, texts, title

TINY = dict(layers=2, width=32, heads=2, steps=8, every=4, batch=4, warmup=2,
            task=BigramBackcopy(vocab=16, triggers=2, length=24))


def table_of(run_folder, on_step=None, kind="softmax", arch="fwd", seed=0) -> pd.DataFrame:
    """A table of the emergence contract for the run in ``run_folder``: one row per (step, layer, head), its loss read
    from the checkpoint, a first-token share that grows with the step (by layer and head, so that lines differ)."""
    run = open_run(run_folder)
    rows = []
    for i, step in enumerate(run.steps):
        if on_step:
            on_step(i + 1, len(run.steps))
        loss = run.meta(step)["loss"]
        for layer in range(run.setup["layers"]):
            for head in range(run.setup["heads"]):
                share = min(1.0, 0.06 + 0.1 * np.log2(step + 1) * (1 + 0.2 * head + 0.1 * layer))
                rows.append(dict(step=step, layer=layer, head=head, loss=loss, alpha0=share * 0.9, sink_rate=share,
                                 first_token=share, value_drain=1 - share / 2, residual_peak=1 + 3 * share,
                                 entropy=2 - share, kind=kind, arch=arch, hash=run.meta(step)["hash"], seed=seed,
                                 sink_head=share > 0.3, induction_head=head == 1 and step >= 2,
                                 prev_token_head=layer == 0 and step >= 4, duplicate_head=False, dormant=False))
    return pd.DataFrame(rows)


def synthetic(steps=(0, 1, 2, 4, 8), layers=2, heads=2, kind="softmax", arch="fwd", seed=0) -> pd.DataFrame:
    return pd.DataFrame([dict(step=s, layer=l, head=h, loss=3.0 / (s + 1), alpha0=0.1 + 0.01 * s, sink_rate=0.5,
                              first_token=min(1.0, 0.1 + 0.05 * s + 0.01 * h), value_drain=0.5, residual_peak=2.0,
                              entropy=1.0, kind=kind, arch=arch, hash="h", seed=seed)
                         for s in steps for l in range(layers) for h in range(heads)])


@pytest.fixture(scope="module")
def runs_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs")
    train(Setup(**TINY), folder / "tiny")
    train(Setup(**{**TINY, "seed": 1}), folder / "tiny-seed1")
    return folder


@pytest.fixture
def page(runs_folder, tmp_path, monkeypatch):
    """The Emergence page opened first (no model is loaded for it), pointed at the runs folder."""
    import ui.emergence

    monkeypatch.setattr(ui.emergence, "table", table_of)
    at = app_test(tmp_path)
    at.switch_page(str(ROOT / "pages" / "emergence.py"))
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    at.text_input(key="em_folder").input(str(runs_folder)).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_the_run_folder_lists_its_checkpoints_and_its_probe(runs_folder):
    from attnviz.lab import emergence

    assert steps_of(runs_folder / "tiny") == [0, 1, 2, 4, 8]
    assert [r.name for r in find_runs(runs_folder)] == ["tiny", "tiny-seed1"]
    run = open_run(runs_folder / "tiny")
    assert run.trained() == Setup(**TINY)
    loaded = load(str(run.checkpoint(8)), dtype="float32")
    text = probe_text(loaded, run)  # the checkpoint's own words, <bos> added by its tokenizer
    ids = emergence.task_probe(run.setup, 1).ids[0].tolist()
    assert len(text.split()) == 23 and loaded.tokenizer(text)["input_ids"] == ids and ids[0] == 0
    assert all(w[0] in "tT" for w in text.split())
    with pytest.raises(InputError, match="no step 9 .past its last.: its last is step-8"):
        run.checkpoint(9)
    with pytest.raises(InputError, match="is no training run"):
        open_run(runs_folder)


def test_a_damaged_run_is_left_out_with_its_reason_and_the_others_are_shown(runs_folder, tmp_path, monkeypatch):
    import ui.emergence

    folder = tmp_path / "runs"
    shutil.copytree(runs_folder, folder)
    (folder / "tiny" / "step-8" / "model.safetensors").unlink()
    with pytest.raises(InputError, match="step-8 is damaged"):
        find_runs(folder)  # without a list to hold the reason: refused
    refused: list[str] = []
    assert [r.name for r in find_runs(folder, refused)] == ["tiny-seed1"]
    assert len(refused) == 1 and "step-8 is damaged" in refused[0] and "\n" not in refused[0]
    monkeypatch.setattr(ui.emergence, "table", table_of)
    at = app_test(tmp_path)
    at.switch_page(str(ROOT / "pages" / "emergence.py"))
    at.run()
    at.text_input(key="em_folder").input(str(folder)).run()
    assert not at.exception and not at.error, [e.value for e in [*at.exception, *at.error]]
    assert any("Left out" in w.value and "step-8 is damaged" in w.value for w in at.warning)
    assert any(title(c).startswith("tiny-seed1 · step 8") for c in charts(at))


def test_the_page_draws_a_run_and_the_slider_moves_the_heatmap(page):
    shown = charts(page)
    heat = next(c for c in shown if title(c).startswith("tiny · step 8"))
    curves = next(c for c in shown if "the sink forming" in title(c))
    assert curves["layout"]["xaxis"]["type"] == "log"
    assert any("each layer at step 8" in title(c) for c in shown)
    assert any(title(c).startswith("attention on the first token over training") for c in shown)  # two runs
    before = arr(heat["data"][0]["customdata"])
    page.select_slider(key="em_step").set_value(0).run()
    assert not page.exception
    after = next(c for c in charts(page) if title(c).startswith("tiny · step 0"))
    moved = arr(after["data"][0]["customdata"])
    assert moved.shape == before.shape == (24, 24)
    assert not np.allclose(np.nan_to_num(moved), np.nan_to_num(before))
    assert any("each layer at step 0" in title(c) for c in charts(page))
    order = page.dataframe[0].value  # the order of formation, from the table's class columns
    assert order.values.tolist() == [[0, "induction", 2, 1], [0, "prev_token", 4, 0], [0, "sink", 4, 1],
                                     [1, "induction", 2, 1], [1, "sink", 4, 0]]


def test_a_bad_folder_or_step_is_one_line(page, runs_folder, tmp_path):
    page.text_input(key="em_folder").input(str(tmp_path / "nowhere")).run()
    assert not page.exception and len(page.error) == 1
    assert "is no training run and holds none" in texts(page.error)
    assert "\n" not in texts(page.error)
    page.text_input(key="em_folder").input(str(runs_folder)).run()
    page.query_params["step"] = "99"  # a link to a step past the run: one line, and the run at its last step
    page.run()
    assert not page.exception and texts(page.error) == (
        f"Step: the lab run {runs_folder / 'tiny'} has no step 99 (past its last): its last is step-8, its "
        "checkpoints are at steps 0, 1, 2, 4, 8")
    assert page.select_slider(key="em_step").value == 8


def test_a_shared_server_reads_and_trains_only_under_its_roots(runs_folder, tmp_path, monkeypatch):
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setenv("ATTNVIZ_SHARED", "1")
    monkeypatch.setenv("ATTNVIZ_ROOTS", str(root))
    at = app_test(tmp_path)
    at.switch_page(str(ROOT / "pages" / "emergence.py"))
    at.run()
    at.text_input(key="em_folder").input(str(runs_folder)).run()
    assert not at.exception and len(at.error) == 1 and "reads only under" in texts(at.error)
    at.number_input(key="em_steps").set_value(2)
    at.button(key="em_train").click().run()
    assert not at.exception and "writes only under" in texts(at.error)
    assert not list(runs_folder.glob("softmax-*"))  # nothing was created


def test_the_real_table_draws_the_curves(runs_folder, tmp_path):
    """``attnviz.lab.emergence.table`` itself, through the page: its columns hold the figures' contract, its progress
    is the job's, and the curves are drawn from it."""
    import ui.emergence

    told = []
    frame = ui.emergence.table(runs_folder / "tiny", on_step=lambda done, total: told.append((done, total)))
    assert told == [(i, 5) for i in range(1, 6)] and E.checked(frame) is frame
    assert set(E.COLUMNS) <= set(frame.columns) and len(frame) == 5 * TINY["layers"] * TINY["heads"]
    alone = tmp_path / "runs"  # a folder of its own: the server's results cache keeps the other tests' tables
    shutil.copytree(runs_folder / "tiny", alone / "tiny")
    at = app_test(tmp_path)
    at.switch_page(str(ROOT / "pages" / "emergence.py"))
    at.run()
    at.text_input(key="em_folder").input(str(alone)).run()
    assert not at.exception and not at.error, [e.value for e in at.exception]
    shown = [title(c) for c in charts(at)]
    assert shown[0] == "tiny · step 8 · layer 1 · mean over heads"
    assert any("the sink forming" in t for t in shown) and any("each layer at step 8" in t for t in shown)


def test_the_train_form_trains_a_run_into_the_folder(page, tmp_path):
    """The lab's default model and task, three steps: a run of its own in the folder, shown at once."""
    target = tmp_path / "trained"
    page.text_input(key="em_folder").input(str(target)).run()
    page.number_input(key="em_steps").set_value(3)
    page.button(key="em_train").click().run()
    assert not page.exception, [e.value for e in page.exception]
    assert "Trained: softmax-fwd-seed0-3steps, last checkpoint step-3" in texts(page.success)
    run = open_run(target / "softmax-fwd-seed0-3steps")
    assert run.steps == (0, 1, 2, 3) and json.loads((run.folder / "step-3" / "attnviz_run.json").read_text())["step"] == 3
    page.run()
    assert any(title(c).startswith("softmax-fwd-seed0-3steps · step 3") for c in charts(page))


def test_the_form_takes_any_kind_and_mask_the_trainer_does_and_shows_its_refusals(page):
    import ui.emergence

    setup = ui.emergence.setup_for("sink(logit=0)", " stablemask ", 5, 2)
    assert (setup.kind, setup.arch, setup.steps, setup.seed, setup.task.seed) == ("sink(logit=0)", "stablemask", 5, 2, 2)
    assert ui.emergence.run_name(setup.kind, setup.arch, 5, 2) == "sink-logit=0-stablemask-seed2-5steps"
    page.text_input(key="em_kind").input("sigmoid")
    page.text_input(key="em_mask").input("stablemask")
    page.button(key="em_train").click().run()
    assert not page.exception and len(page.error) == 1 and "StableMask" in texts(page.error)
    assert texts(page.error).startswith("Training: ") and "\n" not in texts(page.error)


# the figures, as pure functions of the table


def test_the_curves_share_one_log_step_axis():
    fig = E.curves_figure(synthetic(), at=4)
    axes = [k for k in fig.layout.to_plotly_json() if k.startswith("xaxis")]
    assert len(axes) == 4 and all(fig.layout[a].type == "log" for a in axes)
    assert all(fig.layout[a].matches == "x4" for a in axes[:-1])  # shared with the bottom one
    lines = [t for t in fig.data if t.mode == "lines+markers" and list(t.x) != [None]]  # not the legend's keys
    assert len([t for t in lines if t.yaxis == "y"]) == 4  # the sink: a line per (layer, head)
    assert len([t for t in lines if t.yaxis == "y4"]) == 1  # the loss: one line
    assert all(0 not in t.x for t in lines)  # no step 0 on a log axis
    marked = [t for t in fig.data if t.mode == "markers" and list(t.x) == [4]]
    assert len(marked) == len(lines)
    linear = E.curves_figure(synthetic(), per_head=False, log_steps=False)
    assert linear.layout.xaxis.type == "linear"
    drawn = [t for t in linear.data if t.yaxis == "y" and list(t.x) != [None]]
    assert len(drawn) == 2 and 0 in drawn[0].x  # a layer's mean


def test_one_line_per_run_named_by_kind_and_arch():
    fig = E.runs_figure([synthetic(), synthetic(kind="softpick"), synthetic(arch="nosink-fwd", seed=1),
                         synthetic(arch="nosink-fwd", seed=2)])
    assert [t.name for t in fig.data] == ["softmax · fwd", "softpick · fwd", "softmax · nosink-fwd · seed 1",
                                          "softmax · nosink-fwd · seed 2"]
    assert fig.layout.xaxis.type == "log"
    np.testing.assert_allclose(fig.data[0].y, [0.1 + 0.05 * s + 0.005 for s in (1, 2, 4, 8)])


def test_the_layers_at_one_step_and_refusals():
    fig = E.layers_figure(synthetic(), 4)
    bars = [t for t in fig.data if t.type == "bar"]
    assert len(bars) == 3 and list(bars[0].x) == [0, 1]
    np.testing.assert_allclose(bars[0].y, [0.305, 0.305])
    with pytest.raises(InputError, match="no step 5"):
        E.layers_figure(synthetic(), 5)
    with pytest.raises(InputError, match="no column value_drain"):
        E.curves_figure(synthetic().drop(columns="value_drain"))
    with pytest.raises(InputError, match="sink panel"):
        E.curves_figure(synthetic(), sink="loss")


def test_the_training_job_reports_each_step_and_its_loss(tmp_path, monkeypatch):
    """The job's bar (ui.jobs.run's progress) is told the step, the steps and the loss."""
    import ui.emergence

    said = []

    def run(key, label, compute, **_):
        said.append(label)
        return compute(lambda done, total, note="": said.append((done, total, note)))

    monkeypatch.setattr(ui.emergence.jobs, "run", run)
    monkeypatch.setattr(ui.emergence, "setup_for", lambda kind, mask, steps, seed: Setup(**{**TINY, "steps": steps}))
    last = ui.emergence.train_run(str(tmp_path), "softmax", "fwd", 3, 0)
    assert last == tmp_path / "softmax-fwd-seed0-3steps" / "step-3"
    assert said[0] == "Training softmax-fwd-seed0-3steps"
    assert [s[:2] for s in said[1:]] == [(1, 3), (2, 3), (3, 3)]
    assert all(s[2].startswith("loss ") and float(s[2][5:]) > 0 for s in said[1:])


# what a reader of a paper figure would notice: each test fails on the page as it was


def test_a_layer_and_a_head_never_share_a_colour_and_the_legend_says_which_is_which():
    fig = E.curves_figure(synthetic(layers=2, heads=2))
    lines = [t for t in fig.data if t.mode == "lines+markers" and list(t.x) != [None]]
    heads = {t.name: t for t in lines if " head " in t.name}
    peaks = [t for t in lines if t.yaxis == "y3"]  # the residual peak: a layer's own line
    assert [t.name for t in peaks] == ["layer 0", "layer 1"]
    head_colours = {t.line.color for t in heads.values()}
    assert not {t.line.color for t in peaks} & head_colours  # "layer 0" is not head 0's colour
    assert heads["layer 0 head 0"].line.color == heads["layer 1 head 0"].line.color  # a head is a colour ...
    assert heads["layer 0 head 0"].line.color != heads["layer 0 head 1"].line.color
    for layer, peak in enumerate(peaks):  # ... a layer a line style and marker, in every panel
        same = {(t.line.dash, t.marker.symbol) for n, t in heads.items() if n.startswith(f"layer {layer} ")}
        assert same == {(peak.line.dash, peak.marker.symbol)}
    assert (peaks[0].line.dash, peaks[0].marker.symbol) != (peaks[1].line.dash, peaks[1].marker.symbol)
    assert fig.layout.legend.title.text == "colour: head,<br>line and marker: layer"
    keys = [t.name for t in fig.data if t.showlegend is not False]  # each encoding once
    assert keys == ["loss", "head 0", "head 1", "layer 0", "layer 1"]


def test_a_log_step_axis_writes_its_ticks_as_whole_numbers():
    frame = synthetic(steps=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 500, 1000, 1500, 2000))
    for fig in (E.curves_figure(frame), E.runs_figure([frame, synthetic(kind="softpick")])):
        axis = fig.layout.xaxis
        assert axis.type == "log" and axis.tickmode == "array"
        assert list(axis.tickvals) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000][:len(axis.tickvals)]
    axis = E.curves_figure(frame).layout.xaxis
    assert list(axis.ticktext) == ["1", "2", "5", "10", "20", "50", "100", "200", "500", "1000", "2000"]
    from attnviz.figures.style import log_ticks

    assert log_ticks(1, 80_000)["ticktext"] == ["1", "10", "100", "1000", "10000"]  # five decades: powers alone


def test_runs_of_one_kind_are_named_by_the_setting_that_differs():
    setups = [dict(kind="softmax", arch="fwd", seed=0, weight_decay=wd, steps=400, task={"vocab": 64})
              for wd in (0.1, 0.0)] + [dict(kind="softmax", arch="fwd", seed=0, weight_decay=0.0, steps=400,
                                            task={"vocab": 64}), dict(kind="sigmoid", arch="fwd", seed=0)]
    fig = E.runs_figure([synthetic()] * 4, setups=setups, names=["wd-a", "wd-b", "wd-b-again", "sig"])
    assert [t.name for t in fig.data] == ["softmax · fwd · wd 0.1", "softmax · fwd · wd 0 · wd-b",
                                          "softmax · fwd · wd 0 · wd-b-again", "sigmoid · fwd"]
    three = E.runs_figure([synthetic(), synthetic(), synthetic()])  # the tables alone: the same kind, arch, seed
    assert not any("(" in t.name for t in three.data) and len({t.name for t in three.data}) == 3


def test_the_checkpoint_map_labels_at_most_24_of_its_64_tokens():
    from attnviz.figures.routes import token_ticks
    from attnviz.viewer.tensors import from_attention

    maps = np.tril(np.ones((1, 2, 64, 64), np.float32))
    tokens = ["<bos>"] + [f"t{i % 17}" for i in range(1, 64)]
    fig = E.checkpoint_map(from_attention(maps / maps.sum(-1, keepdims=True), tokens=tokens), 0, None, title="m")
    ticks, labels, stride = token_ticks(tokens)  # the Routes page's token axis
    assert stride == 3 and len(ticks) <= 24
    for axis in (fig.layout.xaxis, fig.layout.yaxis):
        assert list(axis.tickvals) == ticks and list(axis.ticktext) == labels
    assert fig.layout.xaxis.tickangle == -45 and fig.layout.xaxis.title.text == "key (every 3)"


def test_an_export_says_what_the_run_is(runs_folder):
    import io

    from PIL import Image

    import ui.emergence
    from attnviz.figures import export

    png = io.BytesIO()
    Image.new("RGB", (4, 4), "white").save(png, format="PNG")
    meta = ui.emergence.export_meta(open_run(runs_folder / "tiny"), 4)
    said = Image.open(io.BytesIO(export.embed_metadata(png.getvalue(), "png", meta))).text["Description"]
    assert said == "lab run tiny: softmax · fwd · seed 0, bigram-backcopy, 8 steps; at step 4"
    bare = Image.open(io.BytesIO(export.embed_metadata(png.getvalue(), "png", {"model": "softmax-s0"})))
    assert bare.text["Description"] == "softmax-s0"  # never "softmax-s0 · None"


@pytest.mark.skipif(not shutil.which("chromium") and not __import__("os").environ.get("ATTNVIZ_REQUIRE_BROWSER"),
                    reason="needs chromium (bash scripts/setup.sh dev)")
def test_the_exported_curves_axis_titles_do_not_run_into_each_other():
    """The paper column's PNG: each stacked panel's axis title, rendered, fits beside its own panel."""
    import re

    from attnviz.figures import export

    svg = export.figure_bytes(E.curves_figure(synthetic()), "svg", {}, preset="paper-single").decode()
    spans = []
    for inner in re.findall(r'<g class="g-y\d*title">(.*?)</g>', svg):
        centre = float(re.search(r' y="([-\d.]+)"', inner).group(1))
        size = float(re.search(r"font-size: ([\d.]+)px", inner).group(1))
        lines = re.findall(r"<tspan[^>]*>([^<]*)</tspan>", inner) or [re.sub(r"<[^>]+>", "", inner)]
        half = max(len(line) for line in lines) * 0.6 * size / 2  # the rotated title's half length
        spans.append((centre - half, centre + half))
    assert len(spans) == 4
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans


def test_after_train_the_new_run_is_the_one_shown(runs_folder, tmp_path, monkeypatch):
    import ui.emergence

    monkeypatch.setattr(ui.emergence, "table", table_of)
    folder = tmp_path / "runs"
    shutil.copytree(runs_folder, folder)
    at = app_test(tmp_path)
    at.switch_page(str(ROOT / "pages" / "emergence.py"))
    at.run()
    at.text_input(key="em_folder").input(str(folder)).run()
    at.multiselect(key="em_runs").set_value(["tiny-seed1", "tiny"]).run()
    assert any(title(c).startswith("tiny-seed1 · step 8") for c in charts(at))
    monkeypatch.setattr(ui.emergence, "setup_for", lambda kind, mask, steps, seed: Setup(**{**TINY, "steps": steps}))
    at.number_input(key="em_steps").set_value(2)
    at.button(key="em_train").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.multiselect(key="em_runs").value == ["softmax-fwd-seed0-2steps", "tiny-seed1", "tiny"]
    assert any(title(c).startswith("softmax-fwd-seed0-2steps · step 2") for c in charts(at))


def test_the_sidebar_says_its_settings_do_not_apply_here(page):
    assert "do not apply here" in texts(page.sidebar.info)
    folded = page.sidebar.expander[0]
    assert folded.label == "Model, text and recipe of the other pages" and folded.text_input(key="model")


def test_the_folded_sidebar_keeps_its_settings_for_the_other_pages(page):
    page.text_area(key="text").input("Typed on the Emergence page.").run()
    page.selectbox(key="arch_pick").set_value("BIDIR").run()
    page.switch_page(str(ROOT / "pages" / "walkthrough.py")).run()
    assert not page.exception and not page.sidebar.info  # drawn as on every other page
    assert page.text_area(key="text").value == "Typed on the Emergence page."
    assert page.selectbox(key="arch_pick").value == "BIDIR"
