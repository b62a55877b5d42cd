"""The lab's trainer (branch work): it learns, saves whole checkpoints that load back with their hash, and a run
resumed from its last checkpoint ends where an unbroken one does."""

import json

import pytest
import torch

from attnviz.lab.tasks import BigramBackcopy, RepeatedRandom
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


def test_a_full_disk_keeps_the_earlier_checkpoints_and_no_partial_folder(tmp_path, monkeypatch):
    import errno

    import pytest

    from attnviz.errors import InputError

    real, calls = torch.save, []

    def full(*args, **kwargs):  # the optimizer's state, the last file a checkpoint writes: the disk is full at step 4
        calls.append(1)
        if len(calls) == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(InputError) as err:
        train(small(steps=8, every=4), tmp_path)
    message = str(err.value)
    assert "step-4" in message and "earlier checkpoints" in message and "No space left" in message
    assert "\n" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0", "step-1", "step-2"]  # no partial folder
    monkeypatch.setattr(torch, "save", real)
    assert last(train(small(steps=8, every=4), tmp_path).parent).name == "step-8"  # resumes from step 2


def test_ctrl_c_keeps_what_was_saved_and_a_resume_ends_where_an_unbroken_run_does(tmp_path):
    import pytest

    whole = train(small(), tmp_path / "whole")

    def stop(step, total, loss):
        if step == 25:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(small(), tmp_path / "broken", on_step=stop)
    assert last(tmp_path / "broken").name == "step-20"
    assert not list((tmp_path / "broken").glob(".*"))
    resumed = train(small(), tmp_path / "broken")
    a = json.loads((whole / "attnviz_run.json").read_text())
    b = json.loads((resumed / "attnviz_run.json").read_text())
    assert a["hash"] == b["hash"]


def test_a_saved_setup_reads_back_as_the_setup(tmp_path):
    """Setup.from_dict: the one reader of a saved setup (resuming, the page, the probe), its task rebuilt by name; an
    older checkpoint's setup (fields missing, fields unknown) takes the defaults."""
    import pytest

    from attnviz.errors import InputError
    from attnviz.lab.text import Text

    from attnviz.lab.tasks import RepeatedRandom

    for setup in (small(kind="softpick", arch="stablemask"), small(task=Text(tokenizer="bytes", length=16)),
                  small(layers=2, task=RepeatedRandom(vocab=24, length=20, shortest=3, seed=2))):
        assert Setup.from_dict(json.loads(json.dumps(setup.as_dict()))) == setup
    older = {k: v for k, v in small().as_dict().items() if k not in ("kind", "arch")}
    assert Setup.from_dict({**older, "gone": 1}) == small()
    with pytest.raises(InputError, match="'copying' is not one the lab trains"):
        Setup.from_dict({"task": {"name": "copying"}})


def test_resuming_with_another_setup_is_one_line(tmp_path):
    import pytest

    from attnviz.errors import InputError

    train(small(steps=2, every=2), tmp_path)
    with pytest.raises(InputError, match="holds a run with lr 0.003, not 0.01") as err:
        train(small(steps=4, every=2, lr=1e-2), tmp_path)
    assert "\n" not in str(err.value)


def test_every_checkpoint_carries_a_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from attnviz.lab.text import Text

    end = train(small(steps=1, every=1), tmp_path / "bigram")
    tok = AutoTokenizer.from_pretrained(end)
    assert tok("t5 T1 t5")["input_ids"] == [0, 5, 1, 5] and tok.convert_ids_to_tokens([0, 2, 3]) == ["<bos>", "T2",
                                                                                                     "t3"]
    text = small(steps=1, every=1, task=Text(tokenizer="bytes", length=16))
    end = train(text, tmp_path / "bytes")
    tok = AutoTokenizer.from_pretrained(end)
    ids = tok("déjà vu")["input_ids"]
    assert ids[0] == 0 and len(ids) == 1 + len("déjà vu".encode()) and tok.decode(ids[1:]) == "déjà vu"
    assert json.loads((end / "attnviz_run.json").read_text())["setup"]["task"]["name"] == "text"


def test_the_command_trains_prints_progress_and_refuses_bad_input_in_one_line(tmp_path, capsys, monkeypatch):
    from attnviz.cli import main
    from attnviz.cli.common import Progress

    monkeypatch.setattr(Progress, "EVERY", 0.0)
    argv = ["train", "--out", str(tmp_path / "run"), "--width", "16", "--heads", "2", "--steps", "3", "--every", "2",
            "--batch", "2", "--vocab", "12", "--length", "12", "--kind", "sink(logit=0)"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["step"] == 3 and summary["recipe"] == {"kind": "sink(logit=0)", "arch": "fwd"}
    assert "train sink(logit=0) fwd" in err and "3 of 3" in err and "loss" in err
    assert main(argv[:-1] + ["gate(headwise)"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "headwise" in err


def test_ctrl_c_on_the_command_line_says_what_was_kept_and_how_to_resume(tmp_path, capsys, monkeypatch):
    from attnviz.cli import main
    from attnviz.lab import train as train_mod

    real = train_mod.train

    def interrupted(setup, out, on_step=None):
        def stop(step, total, loss):
            if step == 3:
                raise KeyboardInterrupt

        return real(setup, out, on_step=stop)

    monkeypatch.setattr(train_mod, "train", interrupted)
    argv = ["train", "--out", str(tmp_path / "run"), "--width", "16", "--heads", "2", "--steps", "6", "--every", "4",
            "--batch", "2", "--vocab", "12", "--length", "12"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert "interrupted" in err and "step-2" in err and "same command again to resume" in err
    monkeypatch.setattr(train_mod, "train", real)
    assert main(argv) == 0 and json.loads(capsys.readouterr().out)["checkpoints"] == [0, 1, 2, 4, 6]


def _by_hand(setup, make, steps: int):
    """The same model trained by a plain torch loop: the lab's loss (its forward through the recipe), torch's
    optimizer built here by ``make``, and the linear warm-up applied to the learning rate by hand."""
    from attnviz import recipe
    from attnviz.core.engine import prepare
    from attnviz.core.loading.models import LoadedModel
    from attnviz.lab.train import build, loss_of

    model = build(setup)
    prepare(model)
    loaded = LoadedModel(model, setup.tokenizer(), "by-hand", None, 0.0)
    built = recipe.build(loaded, setup.arch)
    optimizer = make([p for p in model.parameters() if p.requires_grad])
    model.train()
    for step in range(1, steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = setup.lr * min(1.0, step / setup.warmup)
        loss = loss_of(built, loaded, setup.task.batch(setup.batch, step))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model.state_dict()


def test_each_optimizers_first_steps_are_a_torch_loop_by_hand(tmp_path):
    """adamw (decoupled decay), adam (no decay), sgd (momentum, decay as L2): the trainer's weights after three steps
    are, bit for bit, torch's optimizer run by hand on the same model and batches; the three differ."""
    from attnviz.lab import models

    hand = {"adamw": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01),
            "adam": lambda p: torch.optim.Adam(p, lr=3e-3, weight_decay=0.0),
            "sgd": lambda p: torch.optim.SGD(p, lr=3e-3, momentum=0.9, weight_decay=0.01)}
    ends = {}
    for name, make in hand.items():
        setup = small(steps=3, every=3, warmup=2, optimizer=name)
        assert (setup.weight_decay, setup.momentum) == {"adamw": (0.01, None), "adam": (0.0, None),
                                                        "sgd": (0.01, 0.9)}[name]
        ends[name] = models.load(setup, train(setup, tmp_path / name)).state_dict()
        expected = _by_hand(setup, make, 3)
        for key, value in expected.items():
            assert torch.equal(ends[name][key], value), f"{name} {key}"  # bit-identical
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(ends["adamw"][q], ends["adam"][q]) and not torch.equal(ends["adam"][q], ends["sgd"][q])


def test_a_resumed_sgd_run_ends_where_an_unbroken_one_does(tmp_path):
    """SGD's momentum buffers are saved with the checkpoint and restored: bit-identical weights at the end."""
    run = dict(optimizer="sgd", lr=0.05, momentum=0.8, every=3, warmup=2)
    whole = train(small(steps=6, **run), tmp_path / "whole")
    train(small(steps=3, **run), tmp_path / "broken")
    resumed = train(small(steps=6, **run), tmp_path / "broken")
    a = json.loads((whole / "attnviz_run.json").read_text())
    b = json.loads((resumed / "attnviz_run.json").read_text())
    assert a["hash"] == b["hash"] and b["setup"]["optimizer"] == "sgd" and b["setup"]["momentum"] == 0.8


def test_the_optimizer_reads_back_and_an_older_checkpoint_is_adamw():
    sgd = small(optimizer="sgd")
    assert Setup.from_dict(json.loads(json.dumps(sgd.as_dict()))) == sgd
    older = {k: v for k, v in small().as_dict().items() if k not in ("optimizer", "momentum")}
    assert Setup.from_dict(older) == small() and Setup.from_dict(older).optimizer == "adamw"


@pytest.mark.parametrize("changes, words", [
    (dict(optimizer="lion"), "the optimizer is one of adamw, adam, sgd, not .lion."),
    (dict(optimizer="adam", weight_decay=0.1), "adam takes no weight decay"),
    (dict(momentum=0.5), "the momentum is SGD's: adamw takes none"),
    (dict(optimizer="sgd", momentum=1.0), "SGD's momentum is at least 0 and below 1"),
])
def test_an_optimizer_the_lab_cannot_take_is_one_line(changes, words):
    from attnviz.errors import InputError

    with pytest.raises(InputError, match=words) as err:
        small(**changes)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("p", [0.0, 0.05, 0.3])
def test_the_share_of_triggers_is_p_trigger(p):
    """After an ordinary token at positions 2..length-2, the next is a trigger with probability p_trigger: the share
    in a large batch is within five standard errors of p (exactly 0 for p = 0)."""
    task = BigramBackcopy(vocab=32, triggers=3, length=64, p_trigger=p, seed=4)
    trig = task.needs_attention(task.batch(512))
    drawn = trig[:, 2:-1][~trig[:, 1:-2]]  # each position after an ordinary token, but the last
    share, n = float(drawn.float().mean()), drawn.numel()
    assert abs(share - p) <= 5 * (p * (1 - p) / n) ** 0.5 and n > 20_000
    assert not trig[:, -1].any() and not (trig[:, 1:] & trig[:, :-1]).any()  # never last, never twice in a row


def test_the_command_hands_the_task_and_the_optimizer_on_and_refuses_in_one_line(tmp_path, capsys):
    from attnviz.cli import build_parser, main
    from attnviz.cli.train import setup_of

    argv = ["train", "--out", str(tmp_path / "run"), "--vocab", "20", "--triggers", "4", "--p-trigger", "0.3",
            "--optimizer", "sgd", "--momentum", "0.5", "--weight-decay", "0"]
    setup = setup_of(build_parser("train").parse_args(argv))
    assert (setup.task.vocab, setup.task.triggers, setup.task.p_trigger) == (20, 4, 0.3)
    assert (setup.optimizer, setup.momentum, setup.weight_decay) == ("sgd", 0.5, 0.0)
    assert setup_of(build_parser("train").parse_args(argv[:3])).task.p_trigger == BigramBackcopy().p_trigger
    for bad, words in ((["--p-trigger", "1"], "p_trigger is a probability below 1"),
                       (["--p-trigger", "-0.1"], "p_trigger is a probability below 1"),
                       (["--optimizer", "adam", "--weight-decay", "0.1"], "adam takes no weight decay"),
                       (["--momentum", "0.5"], "momentum is SGD's"),
                       (["--task", "text", "--vocab", "10"], "--vocab is not an option of --task text"),
                       (["--task", "text", "--p-trigger", "0.2"], "--p-trigger is not an option of --task text"),
                       (["--task", "repeat", "--triggers", "2"], "--triggers is not an option of --task repeat"),
                       (["--tokenizer", "bytes"], "--tokenizer is not an option of --task bigram"),
                       (["--text-file", "notes.txt"], "--text-file is not an option of --task bigram")):
        assert main(argv[:3] + bad) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1 and words in err
        assert not (tmp_path / "run").exists()  # refused before anything is written
    # each task's own defaults where its options are not given: the repeated tokens' 32, not Bigram-Backcopy's 64
    repeat = setup_of(build_parser("train").parse_args(argv[:3] + ["--task", "repeat", "--layers", "2"])).task
    assert (repeat.vocab, repeat.length) == (RepeatedRandom().vocab, RepeatedRandom().length) == (32, 32)
