"""The CLI contract: JSON shapes, exit codes, one-line errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ENGLISH


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "attnviz", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


def run_here(capsys, *args):
    """The command run in this process, its output read back, for the tests of what a command prints and returns
    (a process of its own costs seconds of imports and a model load each; the tests of one-line errors keep it)."""
    from attnviz.cli import main

    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["attnviz", *args], code, out.out, out.err)


def test_masks_json(capsys):
    out = run_here(capsys, "masks", "--arch", "mask0&bidir(k=2, k0=1)", "--layers", "4", "--n", "3", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["arch"] == "mask0&bidir(k=2, k0=1)"
    assert [l["mask"] for l in doc["layers"]] == ["fwd", "fwd", "bidir", "nosink-bidir"]
    assert doc["layers"][0]["allow"] == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert doc["layers"][3]["allow"] == [[1, 1, 1], [0, 1, 1], [0, 1, 1]]
    assert [l["layer"] for l in doc["layers"]] == [0, 1, 2, 3]


@pytest.mark.parametrize("args,message", [
    (["masks", "--arch", "mask0-bidir(k=40)", "--layers", "30", "--n", "4"], "k=40 but the model has 30 layers"),
    (["masks", "--arch", "fwd*2 + bidr*2", "--layers", "4", "--n", "4"], "unknown mask type 'bidr'"),
    (["masks", "--arch", "fwd", "--layers", "0", "--n", "4"], "positive integer"),
    (["masks", "--arch", "fwd", "--layers", "2", "--n", "0"], "--n must be at least 1"),
    (["masks", "--arch", "fwd", "--layers", "two", "--n", "3"], "invalid int value"),
    (["sinks", "--text", "   "], "the text is empty"),
    (["sinks", "--text-file", "/no/such/file.txt"], "cannot read --text-file"),
    (["sinks", "--text", "hi", "--eps", "2"], "--eps must be between 0 and 1"),
    (["sinks", "--model", "no-such-org/no-such-model", "--text", "hi"], "cannot find model"),
    (["capture", "--text", "hi"], "required: --out"),
])
def test_bad_input_is_one_line_without_traceback(args, message, model_cache):
    out = run(*args)
    assert out.returncode != 0
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("attnviz: error:")


def test_sinks_json(default_model, tmp_path, capsys):
    text_file = tmp_path / "text.txt"
    text_file.write_text(ENGLISH)
    out = run_here(capsys, "sinks", "--model", "default", "--arch", "nosink-fwd", "--text-file", str(text_file),
                   "--eps", "0.3", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["arch"] == "nosink-fwd" and doc["model"].startswith("SmolLM2")
    assert doc["n_tokens"] == len(doc["tokens"]) and "".join(doc["tokens"]) == ENGLISH
    assert len(doc["layers"]) == 30
    top = doc["layers"][29]
    assert {layer["mask"] for layer in doc["layers"]} == {"nosink-fwd"}
    assert set(top["sink_rate"]) == {"0", "1"}
    assert top["sink_rate"]["0"] is None and top["sink_rate"]["1"] > 0.5  # alpha_0 undefined: only query 0 sees key 0
    head = top["heads"][4]
    assert set(head) == {"head", "kv_group", "sink_key", "alpha", "discarded_mass"}
    assert head["head"] == 4 and head["kv_group"] == 1 and head["sink_key"] == 1
    assert len(head["alpha"]) == 8 and head["alpha"][0] is None and head["alpha"][1] > 0.3
    assert abs(head["discarded_mass"]) < 1e-3


def test_capture_writes_a_loadable_file(default_model, tmp_path, capsys):
    from attnviz import Capture

    out = run_here(capsys, "capture", "--model", "default", "--arch", "stablemask(gamma=0.5)", "--text",
                   "Hello there, world.", "--out", str(tmp_path / "c.npz"), "--layers", "0,5,29")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    cap = Capture.load(doc["out"])
    assert cap.layers == [0, 5, 29] and cap.arch == "stablemask(gamma=0.5)"
    assert cap.probs[29].shape == (9, cap.n_tokens, cap.n_tokens)
    sums = cap.probs[29].astype(np.float32).sum(-1)
    assert sums[:, -1] == pytest.approx(1, abs=2e-3) and (sums[:, 0] < 0.999).all()  # discarded mass shows


def test_capture_bad_layer(default_model, tmp_path):
    out = run("capture", "--text", "hi", "--out", str(tmp_path / "x.npz"), "--layers", "0,31")
    assert out.returncode == 2 and "layer 31 does not exist" in out.stderr


def test_sinks_fwd_has_the_sink_at_key_0(default_model, capsys):
    out = run_here(capsys, "sinks", "--arch", "fwd", "--text", ENGLISH)
    assert out.returncode == 0, out.stderr
    layer = json.loads(out.stdout)["layers"][24]
    assert layer["mask"] == "fwd" and layer["sink_rate"]["0"] > 0.5 and layer["sink_rate"]["1"] == 0.0
    assert all(h["sink_key"] == 0 for h in layer["heads"])


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(ENGLISH + "\n\n" + ENGLISH.upper())
    return path


def test_eval_json_matches_the_library(default_model, text_file, capsys):
    from attnviz.effects.evaluate import evaluate, token_ids

    out = run_here(capsys, "eval", "--arch", "nosink-fwd", "--text-file", str(text_file), "--window", "64", "--stride",
                   "32", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert set(doc) == {"model", "arch", "perplexity", "accuracy", "nll", "tokens", "windows"}
    ids = token_ids(default_model, text_file.read_text().strip().replace("\n\n", "\n\n"))
    expected = evaluate(default_model, ids, "nosink-fwd", window=64, stride=32)
    assert doc["tokens"] == expected.tokens and doc["windows"] == expected.windows
    assert doc["perplexity"] == pytest.approx(expected.perplexity, rel=1e-5)
    assert doc["nll"] == pytest.approx(np.log(doc["perplexity"]), rel=1e-5)


def test_stream_compare_and_embed_sweep(default_model, text_file, capsys):
    out = run_here(capsys, "stream", "--text-file", str(text_file), "--policy", "dense", "--policy", "sink(s=2, w=16)",
                   "--max-tokens", "60", "--compare")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["tokens"] == 59 and [p["policy"] for p in doc["policies"]] == ["dense", "sink(s=2, w=16)"]
    assert [p["cache_size"] for p in doc["policies"]] == [None, 18]
    assert len(doc["policies"][1]["running_perplexity"]) == 59
    assert doc["policies"][0]["running_perplexity"][-1] == pytest.approx(doc["policies"][0]["perplexity"], rel=1e-3)
    single = json.loads(run_here(capsys, "stream", "--text-file", str(text_file), "--policy", "window(w=8)",
                                 "--max-tokens", "30").stdout)
    assert set(single) == {"policy", "arch", "perplexity", "tokens", "cache_size"}

    out = run_here(capsys, "embed", "--arch", "inplace-back", "--sweep", "k", "--ks", "0,2", "--m", "8", "--max-docs",
                   "5")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["k"] for r in rows] == [0, 2] and rows[1]["arch"] == "inplace-back(k=2)"
    assert all(set(r) == {"k", "arch", "recall_at_1", "mrr", "n_docs"} and r["n_docs"] == 5 for r in rows)


def test_generate_json(default_model, capsys):
    out = run_here(capsys, "generate", "--text", "The capital of France is", "--policy", "sink(s=1, w=4)",
                   "--max-new-tokens", "3")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["policy"] == "sink(s=1, w=4)" and len(doc["new_ids"]) <= 3 and doc["prompt_tokens"] == 5


@pytest.mark.parametrize("args,message", [
    (["eval", "--arch", "mask0-bidir(k=4)"], "cannot compute a perplexity with 'mask0-bidir(k=4)'"),
    (["eval", "--arch", "back", "--corpus", "stdlib:specialnames"], "read the token it predicts"),
    (["eval", "--window", "0", "--max-tokens", "50"], "window must be positive"),
    (["eval", "--window", "100", "--max-tokens", "50"], "longer than the text (50 tokens)"),
    (["eval", "--corpus", "stdlib:nope"], "no topic 'nope'"),
    (["stream", "--policy", "sink(s=4, w=9000)", "--max-tokens", "50"], "keeps 9004 entries, more than"),
    (["stream", "--policy", "window(w=200)", "--max-tokens", "50"], "would never evict"),
    (["stream", "--policy", "window(w=-1)"], "must be positive"),
    (["stream", "--policy", "dense", "--arch", "bidir"], "cannot decode with a KV cache"),
    (["embed", "--m", "64", "--text-file", "ONE_DOC"], "too small for the probe"),
    (["embed", "--ks", "0,1"], "--ks needs --sweep k"),
    (["embed", "--arch", "fwd", "--sweep", "k"], "needs a named architecture"),
    (["generate", "--text", "hi", "--arch", "stablemask(gamma=0.5)"], "cannot decode"),
    (["eval", "--text-file", "EMPTY"], "is empty"),
    (["sinks", "--text", "Hello world", "--key", "50"], "--key 50 is past the text's end: it has 2 tokens"),
])
def test_effects_bad_input_is_one_line(args, message, default_model, tmp_path):
    (tmp_path / "one.txt").write_text("A single short document.")
    (tmp_path / "empty.txt").write_text("\n \n")
    args = [{"ONE_DOC": str(tmp_path / "one.txt"), "EMPTY": str(tmp_path / "empty.txt")}.get(a, a) for a in args]
    out = run(*args)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith("attnviz: error:")
    assert out.stdout == ""


def test_sinks_key_of_one_text(default_model, capsys):
    """``--key`` with one text: that key's rate beside keys 0 and 1 in every layer, named as the dataset's is;
    without it the document is what it was."""
    from attnviz.stats.metrics import SINK_EPS

    plain = json.loads(run_here(capsys, "sinks", "--text", ENGLISH).stdout)
    keyed = json.loads(run_here(capsys, "sinks", "--text", ENGLISH, "--key", "3").stdout)
    assert "key" not in plain and all("key" not in layer for layer in plain["layers"])
    assert keyed["key"] == 3 and {k: v for k, v in keyed.items() if k not in ("key", "layers")} == \
        {k: v for k, v in plain.items() if k != "layers"}
    for before, layer in zip(plain["layers"], keyed["layers"]):
        assert layer["key"] == 3 and list(layer["sink_rate"]) == ["0", "1", "3"]
        assert {k: v for k, v in layer.items() if k not in ("key", "sink_rate")} == \
            {k: v for k, v in before.items() if k != "sink_rate"}
        assert {k: layer["sink_rate"][k] for k in ("0", "1")} == before["sink_rate"]
        alphas = np.array([h["alpha"][3] for h in layer["heads"]], dtype=float)
        assert layer["sink_rate"]["3"] == pytest.approx(float(np.mean(alphas > SINK_EPS)))


@pytest.mark.parametrize("metric", ["kl", "sink"])
def test_patching_refuses_an_answer_its_metric_does_not_read(metric):
    out = run("patching", "--clean", "The cat is", "--corrupted", "The dog is", "--answer", " big", "--wrong", " small",
              "--metric", metric)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"attnviz: error: the {metric} metric reads no answer or wrong token: give --answer and "
                          "--wrong with --metric logit_diff only\n")


def test_sinks_over_a_dataset(default_model, tmp_path, capsys):
    from attnviz import corpus
    from attnviz.effects import dataset

    out = run_here(capsys, "sinks", "--corpus", "stdlib", "--per-doc", "--max-len", "16", "--samples", "4", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["samples"] == 4 and doc["max_len"] == 16 and doc["unit"] == "doc" and len(doc["layers"]) == 30
    direct = dataset.sinks(default_model, corpus.stdlib().documents, "fwd", "doc", 16, 4)
    rates = direct.rates()
    top = doc["layers"][29]["sink_rate"]
    assert top["mean"] == pytest.approx(rates[:, 29].mean(), abs=1e-6) and top["n"] == 4
    assert top["ci95"][0] <= top["mean"] <= top["ci95"][1]
    assert doc["model_rate"]["mean"] == pytest.approx(direct.model_rates().mean(), abs=1e-6)
    lines = tmp_path / "lines.txt"
    lines.write_text("The first line is a sample.\nThe second line is one too.\n\nShort.\n")
    doc = json.loads(run_here(capsys, "sinks", "--text-file", str(lines), "--per-line", "--max-len", "6").stdout)
    assert doc["samples"] == 3 and doc["short_samples"] == 1 and "shorter than 6 tokens" in doc["note"]


@pytest.mark.parametrize("args,message", [
    (["sinks", "--corpus", "stdlib", "--samples", "0"], "--samples must be positive"),
    (["sinks", "--corpus", "stdlib", "--max-len", "1"], "--max-len must be at least 2"),
    (["sinks", "--text-file", "EMPTY", "--per-doc"], "is empty"),
])
def test_dataset_sinks_bad_input(args, message, tmp_path, model_cache):
    (tmp_path / "empty.txt").write_text("")
    out = run(*[str(tmp_path / "empty.txt") if a == "EMPTY" else a for a in args])
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_linformer_cli(default_model, capsys):
    out = run_here(capsys, "linformer", "--text", ENGLISH, "--layer", "-1", "--ks", "4,16")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["layer"] == 29 and [r["k"] for r in doc["rows"]] == [4, 16]
    assert doc["rows"][0]["error_full"] > doc["rows"][1]["error_full"] > 0
    bad = run_here(capsys, "linformer", "--text", "two words", "--ks", "5")
    assert bad.returncode == 2 and "Linformer k must be between" in bad.stderr


def test_finetune_writes_a_directory_that_loads_back_with_its_variant(default_model, tmp_path):
    out = tmp_path / "ft"
    done = run("finetune", "--residual", "method3.2", "--corpus", "stdlib:specialnames", "--steps", "2",
               "--seq-len", "32", "--batch", "2", "--max-tokens", "640", "--out", str(out))
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["residual"] == "method3.2" and doc["steps"] == 2 and doc["eval_samples"] == 2
    assert {"eval_loss", "eval_perplexity", "eval_accuracy", "eval_runtime"} <= set(doc)
    assert (out / "model.safetensors").is_file() and (out / "attnviz_residual.safetensors").is_file()
    again = run("eval", "--model", str(out), "--corpus", "stdlib:specialnames", "--max-tokens", "200")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["residual"] == "method3.2"  # the directory brings its variant


@pytest.mark.parametrize("args,message", [
    (["finetune", "--steps", "0", "--out", "OUT"], "--steps must be positive"),
    (["finetune", "--steps", "1", "--out", "/proc/attnviz-cannot/out"], "cannot write --out"),
    (["finetune", "--steps", "1", "--out", "OUT", "--residual", "method9"], "unknown residual variant"),
    (["finetune", "--steps", "1", "--out", "OUT", "--arch", "bidir"], "cannot fine-tune"),
    (["eval", "--residual", "method1", "--arch", "inplace-bidir(k=2)"], "cannot compute a perplexity"),
])
def test_finetune_bad_input(args, message, tmp_path, model_cache):
    out = run(*[str(tmp_path / "out") if a == "OUT" else a for a in args])
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
