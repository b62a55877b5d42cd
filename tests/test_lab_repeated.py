"""The lab's repeated random tokens task (docs/lab.md#tasks-and-tokenizers): its sequences by hand, the task registry
that Setup.from_dict and ``attnviz train --task`` read, and a two-layer run in which a layer-1 induction head forms."""

import json

import numpy as np
import pytest
import torch

from attnviz.errors import InputError
from attnviz.lab import tasks
from attnviz.lab.tasks import BOS, RepeatedRandom
from attnviz.lab.train import Setup, train


def test_a_sequence_is_bos_a_segment_its_copy_and_a_tail_of_other_tokens():
    task = RepeatedRandom(vocab=16, length=13, shortest=2, seed=4)
    ids = task.batch(64, step=3)
    assert ids.shape == (64, 13) and (ids[:, 0] == BOS).all() and ((ids[:, 1:] >= 1) & (ids[:, 1:] < 16)).all()
    spans = task.spans(ids)
    assert set(spans.tolist()) == set(range(2, 7))  # L from shortest to (13 - 1) // 2, each drawn in 64 rows
    for row, span in zip(ids.tolist(), spans.tolist()):
        segment, copy, tail = row[1:span + 1], row[span + 1:2 * span + 1], row[2 * span + 1:]
        assert segment == copy and len(set(segment)) == span and not set(tail) & set(segment)
    assert torch.equal(ids, task.batch(64, step=3)) and not torch.equal(ids, task.batch(64, step=4))
    assert not torch.equal(ids, RepeatedRandom(vocab=16, length=13, shortest=2, seed=5).batch(64, step=3))


def test_only_the_second_copy_needs_attention():
    task = RepeatedRandom(vocab=16, length=11, shortest=2)
    ids = torch.tensor([[0, 5, 9, 2, 5, 9, 2, 12, 14, 12, 11],  # L = 3: queries 4, 5 predict 9, 2 by copying
                        [0, 7, 3, 7, 3, 15, 15, 13, 13, 10, 15]])  # L = 2: query 3 predicts 3
    assert task.spans(ids).tolist() == [3, 2]
    assert task.needs_attention(ids).int().tolist() == [[0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0],
                                                        [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]]


def test_refusals_and_its_tokenizer():
    with pytest.raises(InputError, match="shortest 9 does not fit"):
        RepeatedRandom(length=16, shortest=9)
    with pytest.raises(InputError, match="vocab 8 is too small"):
        RepeatedRandom(vocab=8, length=16, shortest=2)
    tok = RepeatedRandom(vocab=8, length=9, shortest=2).tokenizer_object()
    assert tok("t1 t7 t1")["input_ids"] == [0, 1, 7, 1]


def test_the_registry_is_what_the_setup_and_the_command_read():
    from attnviz.cli import build_parser
    from attnviz.cli.train import setup_of

    assert set(tasks.TASKS) == {"bigram-backcopy", "repeated-random", "text"}
    setup = Setup(layers=2, task=RepeatedRandom(seed=3))
    assert setup.as_dict()["task"]["name"] == "repeated-random"
    assert Setup.from_dict(json.loads(json.dumps(setup.as_dict()))) == setup
    parser = build_parser("train")
    args = parser.parse_args(["train", "--out", "x", "--task", "repeat", "--layers", "2", "--vocab", "24",
                              "--length", "20", "--seed", "7"])
    assert setup_of(args).task == RepeatedRandom(vocab=24, length=20, seed=7)
    choices = next(a for a in parser._subparsers._group_actions[0].choices["train"]._actions if a.dest == "task")
    assert set(choices.choices) == {t.option for t in tasks.TASKS.values()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two attention-only layers, 200 steps: enough for the induction head to form (about 10 s on a quiet core)."""
    torch.set_num_threads(1)
    setup = Setup(layers=2, width=64, heads=4, steps=200, batch=64, every=200, warmup=100, seed=0, device="cpu",
                  task=RepeatedRandom(vocab=32, length=24, shortest=4))
    out = tmp_path_factory.mktemp("repeated") / "run"
    train(setup, out)
    return out


def test_a_layer_one_induction_head_forms_in_two_layers(trained):
    from attnviz import load
    from attnviz.effects import induction

    def scores(step):
        lm = load(str(trained / f"step-{step}"))
        return induction.repeated(lm, length=11, vocabulary=np.arange(1, 32), bos=BOS)

    before, after = scores(0), scores(200)
    ratio = before["induction"][1] / before["induction_baseline"][1]
    assert (abs(ratio - 1) < 0.5).all()  # at initialisation every head attends about uniformly
    best = int(np.argmax(after["induction"][1]))
    assert after["induction"][1, best] > induction.TAU and after["induction"][1, best] > 5 * after[
        "induction_baseline"][1, best]
    assert after.holds("induction")[1].any() and not after.holds("induction")[0].any()
