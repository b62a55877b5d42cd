"""The emergence table (docs/methods.md#emergence-measures): its shape, each measure against a direct computation on
stock transformers, the hash guard, the refusals, the command and the sweep's checkpoints."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from attnviz.errors import InputError
from attnviz.lab import emergence
from attnviz.lab.tasks import BigramBackcopy
from attnviz.lab.train import Setup, train
from attnviz.stats import metrics, spectrum

SETUP = Setup(layers=2, width=16, heads=2, steps=4, every=2, batch=4,
              task=BigramBackcopy(vocab=12, triggers=2, length=12))
SIZE = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("emergence") / "run"
    train(SETUP, out)
    return out


@pytest.fixture(scope="module")
def frame(run):
    calls = []
    found = emergence.table(run, size=SIZE, on_step=lambda i, n: calls.append((i, n)))
    assert calls == [(i + 1, len(SETUP.checkpoints())) for i in range(len(SETUP.checkpoints()))]
    return found


def test_the_table_has_its_columns_and_one_row_per_step_layer_and_head(frame, tmp_path):
    assert list(frame.columns) == list(emergence.COLUMNS)
    steps = SETUP.checkpoints()
    assert len(frame) == len(steps) * SETUP.layers * SETUP.heads
    assert not frame.duplicated(["step", "layer", "head"]).any()
    assert sorted(frame["step"].unique()) == steps and list(frame["step"]) == sorted(frame["step"])
    assert set(frame["kind"]) == {"softmax"} and set(frame["arch"]) == {"fwd"} and set(frame["seed"]) == {0}
    assert frame.groupby("step")["hash"].nunique().eq(1).all() and frame["hash"].nunique() == len(steps)
    assert frame.loc[frame.step == 0, "train_loss"].isna().all()
    assert frame.loc[frame.step > 0, "train_loss"].notna().all()
    # the layer-level measures repeat over a layer's heads
    for name in ("sink_rate", "residual_peak", "entropy", "loss"):
        assert frame.groupby(["step", "layer"])[name].nunique().eq(1).all(), name
    path = emergence.write(frame, tmp_path / "t.parquet")
    back = pd.read_parquet(path)
    assert list(back.columns) == list(emergence.COLUMNS) and len(back) == len(frame)
    assert np.allclose(back["alpha0"], frame["alpha0"])


def _stock(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()


def _ratio(norms):
    return (norms[..., 0] / np.median(norms[..., 1:], axis=-1)).mean(0)


@pytest.mark.parametrize("step", [0, 4])
def test_value_drain_residual_peak_and_entropy_equal_stock_hidden_states(run, frame, step):
    model = _stock(run / f"step-{step}")
    ids = emergence.task_probe(json.loads((run / f"step-{step}" / "attnviz_run.json").read_text())["setup"], SIZE).ids
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
        for layer, block in enumerate(model.model.layers):
            h = hidden[layer]  # the residual stream entering the layer
            v = block.self_attn.v_proj(block.input_layernorm(h))  # (B, n, H_kv * d), no rotation on values
            v = v.view(*v.shape[:2], model.config.num_key_value_heads, -1).transpose(1, 2)
            drain = _ratio(torch.linalg.vector_norm(v, dim=-1).numpy())  # (H_kv,)
            peak = float(_ratio(torch.linalg.vector_norm(h, dim=-1).numpy()))
            entropy = np.mean([spectrum.matrix_entropy_of(z.numpy()) for z in h])
            rows = frame[(frame.step == step) & (frame.layer == layer)].sort_values("head")
            assert np.allclose(rows["value_drain"], drain, rtol=1e-4), (layer, list(rows["value_drain"]), drain)
            assert np.allclose(rows["residual_peak"], peak, rtol=1e-4)
            assert np.allclose(rows["entropy"], entropy, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("step", [0, 4])
def test_alpha0_first_token_sink_rate_and_loss_equal_stock_eager_maps(run, frame, step):
    model = _stock(run / f"step-{step}")
    probe = emergence.task_probe(json.loads((run / f"step-{step}" / "attnviz_run.json").read_text())["setup"], SIZE)
    ids = probe.ids
    quiet = (~SETUP.task.needs_attention(ids)).numpy()
    quiet[:, 0] = False  # the first query has one key
    assert (probe.quiet.numpy()[:, 1:] == quiet[:, 1:]).all()
    with torch.no_grad():
        out = model(ids, labels=ids, output_attentions=True)
    for layer, maps in enumerate(out.attentions):
        a = maps.numpy()  # (B, H, n, n)
        alpha0 = a[..., 0].mean(-1)  # every query sees key 0 under a causal mask, query 0 included (Gu et al.)
        rows = frame[(frame.step == step) & (frame.layer == layer)].sort_values("head")
        assert np.allclose(rows["alpha0"], alpha0.mean(0), atol=1e-6)
        assert np.allclose(rows["sink_rate"], np.mean([(x > metrics.SINK_EPS).mean() for x in alpha0]))
        first = [a[:, h, :, 0][quiet].mean() for h in range(a.shape[1])]
        assert np.allclose(rows["first_token"], first, atol=1e-6)
        assert np.allclose(rows["loss"], float(out.loss), rtol=1e-5)


def _copy_run(run, tmp_path, steps):
    copied = tmp_path / "copied"
    for old, new in steps.items():
        shutil.copytree(run / f"step-{old}", copied / f"step-{new}")
    return copied


def test_equal_weights_are_refused_naming_both(run, tmp_path):
    copied = _copy_run(run, tmp_path, {2: 2, 4: 4})
    last = emergence.Checkpoint.of(copied / "step-4")
    assert emergence.weights_hash(last, computed=True) == last.meta["hash"]  # the trainer's hash, from the weights
    shutil.copytree(run / "step-4", copied / "step-8")  # a hub branch serving the final weights again
    meta = json.loads((copied / "step-8" / "attnviz_run.json").read_text())
    meta["step"] = 8
    del meta["hash"]  # computed from the weights where the metadata lacks it
    (copied / "step-8" / "attnviz_run.json").write_text(json.dumps(meta))
    with pytest.raises(InputError) as err:
        emergence.table(copied, size=SIZE)
    message = str(err.value)
    assert "\n" not in message and "step-4" in message and "step-8" in message and "same weights" in message
    with pytest.raises(InputError):  # a list of folders too
        emergence.table([copied / "step-4", copied / "step-8"], size=SIZE)


def test_checkpoints_without_hashes_are_guarded_by_their_files_and_each_loaded_once(run, tmp_path, monkeypatch):
    from attnviz.core.loading import models

    copied = _copy_run(run, tmp_path, {2: 2, 4: 4})
    for step in (2, 4):  # checkpoints written before the trainer kept a hash
        path = copied / f"step-{step}" / "attnviz_run.json"
        meta = json.loads(path.read_text())
        del meta["hash"]
        path.write_text(json.dumps(meta))
    loads = []
    real = models.load
    monkeypatch.setattr(models, "load", lambda name, **kw: loads.append(name) or real(name, **kw))
    found = emergence.table(copied, size=SIZE)
    assert sorted(loads) == sorted(str(copied / f"step-{s}") for s in (2, 4))  # one load each, for its forward
    original = emergence.table(run, size=SIZE)
    original = original[original["step"].isin([2, 4])].reset_index(drop=True)
    # the column is the trainer's hash, computed from the model loaded for the forward
    assert list(found["hash"]) == list(original["hash"])
    # the guard's hash is the weight files' (name, SHA-256), as the Hub lists a revision's
    import hashlib

    weights = copied / "step-4" / "model.safetensors"
    listed = [("model.safetensors", hashlib.sha256(weights.read_bytes()).hexdigest())]
    assert models.folder_hash(copied / "step-4") == hashlib.sha256(repr(listed).encode()).hexdigest()[:16]
    assert models.folder_hash(copied / "step-2") != models.folder_hash(copied / "step-4")
    with pytest.raises(Exception, match="no safetensors or GGUF"):
        models.folder_hash(tmp_path)


def test_a_folder_without_checkpoints_is_refused_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    for given in (tmp_path / "empty", tmp_path / "missing", []):
        with pytest.raises(InputError) as err:
            emergence.checkpoints(given)
        assert "\n" not in str(err.value)


def test_a_model_without_the_task_needs_a_probe(run, tmp_path):
    bare = _copy_run(run, tmp_path, {4: 4}) / "step-4"
    (bare / "attnviz_run.json").unlink()
    with pytest.raises(InputError, match="needs a probe"):
        emergence.table([bare])
    found = emergence.table([bare], probe=torch.tensor([[0, 5, 6, 7, 8, 9]]))
    assert len(found) == SETUP.layers * SETUP.heads and found["first_token"].notna().all()


def test_the_command_writes_the_table_and_refuses_bad_input_in_one_line(run, tmp_path, capsys):
    from attnviz.cli import main

    out = tmp_path / "table.parquet"
    assert main(["emergence", str(run), "--out", str(out), "--samples", "2", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rows"] == len(pd.read_parquet(out)) == len(SETUP.checkpoints()) * SETUP.layers * SETUP.heads
    assert list(pd.read_parquet(out).columns) == list(emergence.COLUMNS)
    for bad in ([str(tmp_path / "missing"), "--out", str(out)], [str(run), "--out", str(tmp_path / "t.csv")],
                [str(run), "--out", str(out), "--samples", "0"]):
        assert main(["emergence", *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("attnviz: error:") and "\n" not in err


def test_the_sweep_takes_a_run_folder_as_its_checkpoints(run, tmp_path):
    from attnviz.sweep import measures, run as sweep_run, spec, store

    grid = spec.parse(f'models = ["{run}"]\n[measures.emergence]\nsamples = 2\n')
    assert grid.models == [str((run / f"step-{s}").resolve()) for s in SETUP.checkpoints()]
    cell = next(c for c in grid.cells() if c.model.endswith("step-4"))
    assert sweep_run.run_cell(str(tmp_path / "out"), cell)["status"] == "ok"
    rows = store.read(str(tmp_path / "out"), "emergence")
    assert len(rows) == SETUP.layers * SETUP.heads and set(rows["step"]) == {4}
    assert set(measures.COLUMNS["emergence"]) | {"arch"} == set(emergence.COLUMNS)  # the head classes included
    assert rows["induction"].notna().all() and rows["dormant"].notna().all()
    copied = _copy_run(run, tmp_path, {2: 2, 4: 4})
    shutil.copytree(run / "step-4", copied / "step-6")
    with pytest.raises(InputError, match="same weights"):
        spec.parse(f'models = ["{copied}"]\n[measures.emergence]\n')


def test_maps_are_read_as_they_are_under_a_kind_whose_rows_do_not_sum_to_one(run, tmp_path):
    """A lab model trained with sigmoid attention (its kind in its config): alpha0 and the first token's attention
    are the engine's own maps' key-0 column, not renormalised (docs/methods.md#emergence-measures)."""
    from attnviz.core.engine import Record
    from attnviz.recipe import build

    folder = _copy_run(run, tmp_path, {4: 4}) / "step-4"
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attnviz_kind": "sigmoid"}))
    from attnviz.core.loading import runs

    record = json.loads((folder / runs.RUN_FILE).read_text())  # its record says so, and hashes the config it has
    record["setup"]["kind"] = record["recipe"]["kind"] = "sigmoid"
    (folder / runs.RUN_FILE).write_text(json.dumps({**record, "sha256": runs.digests(folder)}))
    found = emergence.table([folder], size=SIZE)
    assert set(found["kind"]) == {"sigmoid"}
    from attnviz.core.loading.models import load

    loaded = load(str(folder), dtype="float32")
    probe = emergence.task_probe(json.loads((folder / "attnviz_run.json").read_text())["setup"], SIZE)
    quiet = probe.quiet.numpy().copy()
    quiet[:, 0] = False
    _, _, recorded = build(loaded, "fwd").forward(loaded, probe.ids, Record.every_layer(storage_dtype=torch.float32))
    for layer, maps in recorded.probs.items():
        a = np.asarray(maps, dtype=np.float64)
        assert not np.allclose(a.sum(-1), 1, atol=1e-3)  # sigmoid rows: not a distribution
        rows = found[found.layer == layer].sort_values("head")
        assert np.allclose(rows["alpha0"], a[..., 0].mean(-1).mean(0), atol=1e-6)
        assert np.allclose(rows["first_token"], [a[:, h, :, 0][quiet].mean() for h in range(a.shape[1])], atol=1e-6)
        assert np.allclose(rows["row_mass"], [a[:, h].sum(-1)[quiet].mean() for h in range(a.shape[1])], atol=1e-5)


def test_the_probe_is_the_runs_own_task_and_the_same_for_every_checkpoint():
    task = {"vocab": 12, "triggers": 2, "length": 12, "p_trigger": 0.1, "seed": 3}
    probe = emergence.task_probe({"task": task}, SIZE)
    again = emergence.task_probe({"task": {"name": "bigram-backcopy", **task}}, SIZE)  # a named task: the same
    assert torch.equal(probe.ids, again.ids) and probe.ids.shape == (SIZE, 12) and (probe.ids[:, 0] == 0).all()
    assert torch.equal(probe.quiet, ~BigramBackcopy(**task).needs_attention(probe.ids))
    with pytest.raises(InputError, match="give a probe"):
        emergence.task_probe({"task": {"name": "copying", **task}})


def test_head_classes_equal_the_repeated_scores_and_dormancy_from_stock_eager_maps(run, frame):
    """The class columns: the scores are :func:`attnviz.effects.induction.repeated`'s on the checkpoint (drawn from
    the task's ordinary tokens, L capped by the model's 12 positions); the dormancy is computed here from stock
    eager maps, values and W_O on the probe's quiet (non-trigger) and active (trigger) queries."""
    from attnviz import load
    from attnviz.effects import induction
    from attnviz.lab import formation

    folder = run / "step-4"
    lm = load(str(folder))
    scores = induction.repeated(lm, length=5, samples=induction.SAMPLES, vocabulary=SETUP.task.ordinary.numpy())
    rows = frame[frame.step == 4].sort_values(["layer", "head"])
    for name in (*induction.SCORES, *(f"{s}_baseline" for s in induction.SCORES)):
        np.testing.assert_allclose(rows[name], scores[name].ravel(), atol=1e-6, err_msg=name)
        assert rows[f"{name}_head" if "baseline" not in name else "step"].notna().all()
    assert (rows["induction_head"] == (rows["induction"] >= induction.TAU)).all()
    assert (rows["sink_head"] == (rows["alpha0"] > metrics.SINK_EPS)).all()
    model = _stock(folder)
    probe = emergence.task_probe(json.loads((folder / "attnviz_run.json").read_text())["setup"], SIZE)
    quiet = probe.quiet.numpy().copy()
    active = ~quiet
    quiet[:, 0] = active[:, 0] = False
    with torch.no_grad():
        out = model(probe.ids, output_attentions=True, output_hidden_states=True)
        for layer, block in enumerate(model.model.layers):
            attn = block.self_attn
            v = attn.v_proj(block.input_layernorm(out.hidden_states[layer]))
            v = v.view(*v.shape[:2], -1, attn.head_dim).transpose(1, 2)  # (B, H, n, d): as many KV heads as heads
            o = out.attentions[layer] @ v  # (B, H, n, d)
            w = attn.o_proj.weight.view(-1, v.shape[1], attn.head_dim)  # (hidden, H, d)
            norms = torch.linalg.vector_norm(torch.einsum("bhnd,ohd->bhno", o, w), dim=-1).numpy()
            mine = rows[rows.layer == layer]
            key0 = out.attentions[layer][..., 0].numpy()
            np.testing.assert_allclose(mine["quiet_key0"], [key0[:, h][quiet].mean() for h in range(v.shape[1])],
                                       atol=1e-6)
            ratio = [norms[:, h][quiet].mean() / np.median(norms[:, h][active]) for h in range(v.shape[1])]
            np.testing.assert_allclose(mine["dormant_ratio"], ratio, rtol=1e-5)
    assert formation.repeat_length(lm) == 5


def test_the_first_step_each_class_holds_and_the_order_by_hand():
    from attnviz.lab import formation

    base = {name: False for name in formation.CLASSES.values()}
    frame = pd.DataFrame([
        {"step": 0, "layer": 0, "head": 0, **base},
        {"step": 0, "layer": 1, "head": 1, **base, "sink_head": True},  # the sink first, in layer 1
        {"step": 8, "layer": 1, "head": 0, **base, "induction_head": True},
        {"step": 16, "layer": 1, "head": 0, **base, "induction_head": True, "dormant": True},
        {"step": 16, "layer": 0, "head": 0, **base, "prev_token_head": True},
        {"step": 32, "layer": 1, "head": 1, **base, "induction_head": True}])
    first = formation.first_steps(frame)
    assert first.values.tolist() == [[1, 1, "sink", 0], [1, 0, "induction", 8], [0, 0, "prev_token", 16],
                                     [1, 0, "dormant", 16], [1, 1, "induction", 32]]
    assert formation.order(frame).values.tolist() == [[0, "prev_token", 16, 0], [1, "sink", 0, 1],
                                                      [1, "induction", 8, 0], [1, "dormant", 16, 0]]
    scores = frame.assign(alpha0=0.5, quiet_key0=0.0, dormant_ratio=1.0,
                          **{s: [0.0, 0.0, 0.5, 0.5, 0.9, 0.1] for s in formation.SCORES})
    again = formation.first_steps(scores, tau=0.45, eps=0.4)  # other thresholds: the classes from the scores
    assert set(map(tuple, again[again["class"] == "sink"][["layer", "head", "step"]].values.tolist())) == {
        (0, 0, 0), (1, 1, 0), (1, 0, 8)}
    assert again[again["class"] == "induction"][["layer", "head", "step"]].values.tolist() == [[1, 0, 8], [0, 0, 16]]
