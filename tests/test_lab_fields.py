"""The lab's fields checked in one place (docs/lab.md#fields-checked): a setup's and a task's arguments of the wrong
type or range are refused in one line (never a foreign error, never read as something else), and a batch past the
memory budget is refused with its estimate before it is drawn (docs/lab.md#a-batch-sized-first)."""

import time

import pytest
import torch

from attnviz import settings
from attnviz.errors import InputError
from attnviz.lab import fields
from attnviz.lab.tasks import BigramBackcopy, RepeatedRandom
from attnviz.lab.text import Text
from attnviz.lab.train import Setup, train


def _one_line(make, words: str) -> str:
    with pytest.raises(InputError, match=words) as err:
        make()
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("changes, words", [
    (dict(lr=float("inf")), "the learning rate is above 0 .a finite number., not inf"),
    (dict(lr=float("nan")), "the learning rate is above 0"),
    (dict(lr="0.1"), "the learning rate is above 0 .a finite number., not '0.1'"),
    (dict(lr=None), "the learning rate is above 0 .a finite number., not None"),
    (dict(seed="x"), "the seed is a whole number from 0 to 18446744073709551615, not 'x'"),
    (dict(seed=-1), "the seed is a whole number from 0"),
    (dict(seed=2**64), "the seed is a whole number from 0"),
    (dict(seed=True), "the seed is a whole number"),
    (dict(mlp="no"), "mlp is True or False, not 'no'"),
    (dict(mlp=1), "mlp is True or False, not 1"),
    (dict(layers=True), "layers is a whole number of at least 1, not True"),
    (dict(steps=2.0), "steps is a whole number of at least 1, not 2.0"),
    (dict(warmup=-1), "the warm-up is a whole number of at least 0, not -1"),
    (dict(warmup=True), "the warm-up is a whole number"),
    (dict(weight_decay=float("nan")), "the weight decay is at least 0"),
    (dict(weight_decay="0.1"), "the weight decay is at least 0"),
    (dict(optimizer=None), "the optimizer is one of adamw, adam, sgd, not None"),
    (dict(optimizer="sgd", momentum="0.5"), "SGD's momentum is at least 0 and below 1"),
    (dict(optimizer="sgd", momentum=float("nan")), "SGD's momentum is at least 0 and below 1"),
    (dict(kind=None), "the kind is a non-empty string, not None"),
    (dict(arch=3), r"the mask \(arch\) is a non-empty string, not 3"),
    (dict(positions=None), "positions is a non-empty string, not None"),
])
def test_a_setup_field_of_the_wrong_type_or_range_is_one_line(changes, words):
    """Each of these was taken before (``mlp='no'`` turned the MLPs on, ``lr=inf`` trained to NaN, ``seed='x'``
    failed later inside torch) or failed with a foreign TypeError (``lr='0.1'``, ``lr=None``)."""
    _one_line(lambda: Setup(**changes), words)


def test_a_saved_setup_goes_through_the_same_checks():
    good = Setup().as_dict()
    assert Setup.from_dict(good) == Setup() and Setup.from_dict({}) == Setup()  # an older checkpoint's: defaults
    _one_line(lambda: Setup.from_dict({**good, "mlp": "no"}), "mlp is True or False, not 'no'")
    _one_line(lambda: Setup.from_dict({**good, "lr": "0.003"}), "the learning rate is above 0")
    _one_line(lambda: Setup.from_dict({**good, "task": {**good["task"], "seed": "s"}}), "Bigram-Backcopy's seed")
    _one_line(lambda: Setup.from_dict({**good, "task": "bigram"}), "a saved setup's task is a dict")
    _one_line(lambda: Setup.from_dict({**good, "task": {"name": ["x"]}}), "is not one the lab trains")
    _one_line(lambda: Setup.from_dict(["layers", 1]), "a saved setup is a dict of its fields, not a list")


@pytest.mark.parametrize("make, words", [
    (lambda: BigramBackcopy(seed="s"), "Bigram-Backcopy's seed is a whole number from 0 to 18446744073709551615"),
    (lambda: BigramBackcopy(seed=-1), "Bigram-Backcopy's seed is a whole number"),
    (lambda: BigramBackcopy(length=-1), "Bigram-Backcopy's length is a whole number of at least 1, not -1"),
    (lambda: BigramBackcopy(length=0), "Bigram-Backcopy's length is a whole number of at least 1, not 0"),
    (lambda: BigramBackcopy(length=True), "Bigram-Backcopy's length is a whole number of at least 1, not True"),
    (lambda: BigramBackcopy(vocab="64"), "Bigram-Backcopy's vocab is a whole number of at least 1, not '64'"),
    (lambda: BigramBackcopy(triggers=2.0), "Bigram-Backcopy's triggers is a whole number"),
    (lambda: BigramBackcopy(p_trigger="0.1"), "Bigram-Backcopy's p_trigger is a probability below 1 .at least 0."),
    (lambda: BigramBackcopy(p_trigger=float("nan")), "Bigram-Backcopy's p_trigger is a probability below 1"),
    (lambda: BigramBackcopy(p_trigger=True), "Bigram-Backcopy's p_trigger is a probability below 1 .at least 0."),
    (lambda: RepeatedRandom(seed="s"), "the repeated task's seed is a whole number"),
    (lambda: RepeatedRandom(seed=2**64), "the repeated task's seed is a whole number"),
    (lambda: RepeatedRandom(length=0), "the repeated task's length is a whole number of at least 1, not 0"),
    (lambda: RepeatedRandom(shortest=False), "the repeated task's shortest is a whole number"),
    (lambda: RepeatedRandom(vocab=-3), "the repeated task's vocab is a whole number"),
    (lambda: Text(seed="s"), "the text task's seed is a whole number"),
    (lambda: Text(length=True), "a text chunk is at least 3 tokens long, not True"),
    (lambda: Text(source=""), "the text task's source is a non-empty string"),
    (lambda: Text(tokenizer=["bytes"]), "unknown tokenizer"),
    (lambda: BigramBackcopy().batch(0), "a batch's size is a whole number of at least 1, not 0"),
    (lambda: BigramBackcopy().batch(True), "a batch's size is a whole number of at least 1, not True"),
    (lambda: BigramBackcopy().batch(2, -1), "a batch's step is a whole number of at least 0, not -1"),
    (lambda: RepeatedRandom().batch(2, "1"), "a batch's step is a whole number"),
])
def test_a_task_argument_of_the_wrong_type_or_range_is_one_line(make, words):
    _one_line(make, words)


def test_every_seed_a_task_takes_draws_and_the_usual_ones_draw_as_before():
    """The largest seed draws (seed × 1,000,003 + step overflowed a generator's seed before); a small seed's
    generator is seeded with seed × 1,000,003 + step, as it always was."""
    assert BigramBackcopy(seed=fields.SEED_MAX).batch(2, 5).shape == (2, 64)
    assert RepeatedRandom(seed=fields.SEED_MAX).batch(2, 5).shape == (2, 32)
    g = torch.Generator().manual_seed(3 * 1_000_003 + 7)
    spans = torch.randint(4, 16, (5,), generator=g)
    assert torch.equal(RepeatedRandom(seed=3).spans(RepeatedRandom(seed=3).batch(5, 7)), spans)


def test_a_batch_past_the_memory_budget_is_refused_with_its_estimate_before_it_is_drawn():
    """Bigram-Backcopy of 10 million tokens drew for minutes; sized first, it is refused at once. Under a 1 MB budget
    (1,048,576 bytes) a batch of 2 of vocab 16 needs 8·2·L + 12·16² + 16·2·16 = 16 L + 3,584 bytes to draw and
    4 L² for one head's scores: L = 509 fits (1,048,052 bytes), 510 does not (1,052,144)."""
    started = time.perf_counter()
    message = _one_line(lambda: BigramBackcopy(length=10**7).batch(2, 1), "a batch of 2 bigram-backcopy sequences of "
                        "10,000,000 tokens .vocab 64. needs ~153 MB to draw .~33 min. and ~381,469,727 MB for one "
                        "head's scores over one sequence: past the memory budget's")
    assert time.perf_counter() - started < 5 and "ATTNVIZ_MEMORY_MB" in message
    with settings.applied(memory_mb=1):
        assert BigramBackcopy(vocab=16, triggers=2, length=509).batch(2).shape == (2, 509)
        _one_line(lambda: BigramBackcopy(vocab=16, triggers=2, length=510).batch(2), "budget's 1 MB .ATTNVIZ_MEMORY_MB."
                  ": give a length of at most 509$")
        # the repeated task: 20·2·V + 16·2·L + 4 L² with V = 600: 24,000 + 32 L + 4 L² fits up to L = 502
        # (1,048,080 bytes; 503: 1,052,132)
        _one_line(lambda: RepeatedRandom(vocab=600, length=1000).batch(2), "give a length of at most 502$")
        assert RepeatedRandom(vocab=600, length=502).batch(2).shape == (2, 502)
        _one_line(lambda: BigramBackcopy(vocab=400, length=8).batch(2), "a smaller vocabulary or batch$")


def test_a_run_past_the_budget_is_refused_before_its_folder_is_made(tmp_path):
    with settings.applied(memory_mb=1):
        _one_line(lambda: train(Setup(steps=1, task=BigramBackcopy(length=600)), tmp_path / "run"), "past the memory")
    assert not (tmp_path / "run").exists()
