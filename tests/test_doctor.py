"""``attnviz doctor``: every check on this CPU, on the default model and on tiny random models of every family;
a route made to give wrong numbers fails it; its command-line contract and bad input. The CUDA branch
(the fused kernel, its speed, a kernel that will not compile) is in tests/test_cuda.py, marked ``cuda``."""

import json

import pytest
import torch

from attnviz import doctor
from attnviz.cli import main
from attnviz.core import engine

from tiny import ARCHS, char_tokenizer, build, loaded

EQUIVALENCE = ("maps of every layer vs stock eager (float32, block engine)", "top layer after SDPA layers vs stock eager",
               "statistics, block engine vs full maps", "long mode: pooled maps vs max-pooled full maps (relative)")


@pytest.mark.parametrize("kind", ARCHS)
def test_doctor_passes_on_tiny_random_models_of_every_family(kind):
    report = doctor.run(loaded(kind), tokens=256)
    by_name = {c.name: c for c in report.checks}
    assert report.ok, report.text()
    for name in EQUIVALENCE:
        check = by_name[name]
        assert check.status == "PASS" and 0 <= check.measured <= check.limit, check
    assert by_name["statistics, fused kernel vs block engine"].status == "SKIP"  # no CUDA here
    speed = next(c for c in report.checks if c.name.startswith("speed: statistics"))
    assert speed.ratio > 0 and speed.status in ("PASS", "SKIP")  # a tiny model's forward is too short to time
    assert report.environment["model"] == f"tiny-{kind}" and report.environment["torch"] == torch.__version__


def test_cli_doctor_on_the_default_model(default_model, capsys):
    assert main(["doctor", "--tokens", "512", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"environment", "checks", "ok"} <= set(doc) and doc["ok"] is True
    env = doc["environment"]
    assert {"attnviz", "torch", "transformers", "triton", "devices", "device", "dtype"} <= set(env)
    assert env["device"] == "cpu" and env["dtype"] == "float32" and env["devices"][0]["name"] == "cpu"
    for check in doc["checks"]:
        assert check["status"] in ("PASS", "FAIL", "SKIP") and "name" in check
        if check["status"] == "PASS":
            assert check["measured"] <= check["limit"]
    speed = next(c for c in doc["checks"] if c["name"].startswith("speed: statistics of 512 tokens"))
    assert speed["status"] == "PASS" and speed["ratio"] == speed["measured"] > 0
    assert main(["doctor", "--tokens", "64"]) == 0  # the plain report: one line per check
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("attnviz ") and any(l.startswith("PASS maps of every layer") for l in lines)
    assert lines[-1].startswith("all checks passed")


def test_a_route_giving_wrong_numbers_fails_doctor_and_exits_1(tmp_path, monkeypatch, capsys):
    model, tokenizer = build("llama"), char_tokenizer()
    model.save_pretrained(tmp_path), tokenizer.save_pretrained(tmp_path)
    real = engine._block_probs

    def wrong(*args, **kwargs):  # the block engine's probabilities, 1 % off
        return real(*args, **kwargs) * 1.01

    monkeypatch.setattr(engine, "_block_probs", wrong)
    assert main(["doctor", "--model", str(tmp_path), "--tokens", "64"]) == 1
    out = capsys.readouterr().out
    assert "FAIL maps of every layer vs stock eager" in out and out.splitlines()[-1].startswith("FAILED")
    monkeypatch.setattr(engine, "_block_probs", real)
    assert main(["doctor", "--model", str(tmp_path), "--tokens", "64"]) == 0


@pytest.mark.parametrize("args,message", [
    (["--device", "cuda"], "this machine has no cuda device"),
    (["--tokens", "3"], "--tokens must be at least 16"),
])
def test_doctor_bad_input_is_one_line(args, message, capsys):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["doctor", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
