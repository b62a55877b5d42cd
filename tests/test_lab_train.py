"""The lab's trainer (branch work): it learns, saves whole checkpoints that load back with their hash, and a run
resumed from its last checkpoint ends where an unbroken one does."""

import json

import torch

from attnviz.lab.tasks import BigramBackcopy
from attnviz.lab.train import Setup, last, train, weights_hash


def small(**changes):
    return Setup(**{**dict(layers=1, width=32, heads=2, steps=40, batch=8, every=20, warmup=5,
                           task=BigramBackcopy(vocab=16, triggers=2, length=24)), **changes})


def test_it_learns_and_saves_checkpoints_that_load_back(tmp_path):
    from transformers import LlamaForCausalLM

    losses = []
    end = train(small(), tmp_path, on_step=lambda s, n, loss: losses.append(loss))
    assert end.name == "step-40" and sum(losses[-5:]) < sum(losses[:5])
    assert sorted(int(p.name[5:]) for p in tmp_path.glob("step-*")) == [0, 1, 2, 4, 8, 16, 20, 40]
    meta = json.loads((end / "attnviz_run.json").read_text())
    assert meta["hash"] == weights_hash(LlamaForCausalLM.from_pretrained(end)) and meta["step"] == 40
    zero = LlamaForCausalLM.from_pretrained(tmp_path / "step-0")
    assert all((p == 0).all() for p in zero.model.layers[0].mlp.parameters())  # attention only


def test_a_resumed_run_ends_where_an_unbroken_one_does(tmp_path):
    whole = train(small(), tmp_path / "whole")
    broken = small(steps=20)
    train(broken, tmp_path / "broken")
    resumed = train(small(), tmp_path / "broken")
    a = json.loads((whole / "attnviz_run.json").read_text())
    b = json.loads((resumed / "attnviz_run.json").read_text())
    assert a["hash"] == b["hash"] and last(tmp_path / "broken").name == "step-40"
