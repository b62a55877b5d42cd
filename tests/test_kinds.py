"""Attention kinds against their written-out definitions (docs/methods.md#attention-kinds), and the lab's
Bigram-Backcopy task against its definition. Groundwork of the lab: not yet a recipe axis."""

import math

import pytest
import torch

from attnviz.core.spec import kinds
from attnviz.errors import InputError
from attnviz.lab.tasks import BOS, BigramBackcopy


def scores(seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(2, 3, 5, 5, generator=g) * 3
    causal = torch.ones(5, 5).tril().bool()
    return z.masked_fill(~causal, -math.inf), causal


def test_softmax_and_the_sink_logit_by_hand():
    z, allow = scores()
    e = torch.exp(z)
    torch.testing.assert_close(kinds.parse("softmax").weights(z), e / e.sum(-1, keepdim=True))
    torch.testing.assert_close(kinds.parse("sink(logit=0)").weights(z), e / (1 + e.sum(-1, keepdim=True)))
    learned = torch.tensor([0.5, -1.0, 2.0])
    by_hand = e / (torch.exp(learned).view(1, 3, 1, 1) + e.sum(-1, keepdim=True))
    torch.testing.assert_close(kinds.parse("sink").weights(z, learned), by_hand)
    with pytest.raises(InputError, match="no learned sink"):
        kinds.parse("sink").weights(z)


def test_softpick_by_hand_and_its_zero_rows():
    z, allow = scores(1)
    e = torch.where(allow, torch.exp(z) - 1, torch.zeros_like(z))
    by_hand = torch.relu(e) / (e.abs().sum(-1, keepdim=True) + kinds.EPS)
    torch.testing.assert_close(kinds.parse("softpick").weights(z), by_hand, rtol=1e-5, atol=1e-7)
    assert (kinds.parse("softpick").weights(z).sum(-1) <= 1 + 1e-6).all()
    negative = torch.full((1, 4), -2.0)  # every score below 0: nothing picked
    assert kinds.parse("softpick").weights(negative).abs().sum() == 0
    big = torch.tensor([[80.0, 79.0, -math.inf]])  # exp(80) overflows float32's naive form; the stable one does not
    assert torch.isfinite(kinds.parse("softpick").weights(big)).all()


def test_sigmoid_with_its_default_and_a_fixed_bias():
    z, allow = scores(2)
    n = allow.sum(-1, keepdim=True).float()
    by_hand = torch.where(allow, torch.sigmoid(z - torch.log(n)), torch.zeros_like(z))
    torch.testing.assert_close(kinds.parse("sigmoid").weights(z), by_hand)
    torch.testing.assert_close(kinds.parse("sigmoid(bias=0)").weights(z),
                               torch.where(allow, torch.sigmoid(z), torch.zeros_like(z)))


def test_the_gate_keeps_the_softmax_map_and_gates_the_output():
    z, _ = scores(3)
    gate = kinds.parse("gate(headwise)")
    torch.testing.assert_close(gate.weights(z), torch.softmax(z, -1))
    out, logits = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 1)
    torch.testing.assert_close(gate.gated(out, logits), out * torch.sigmoid(logits))
    assert gate.spec == "gate(headwise)" and kinds.parse("gate").spec == "gate"


def test_relu_by_hand_divides_by_the_keys_the_row_allows():
    z, allow = scores(4)
    n = torch.arange(1, 6).float().view(5, 1)  # the causal row i allows i + 1 keys
    by_hand = torch.where(allow, torch.clamp(z, min=0), torch.zeros_like(z)) / n
    relu = kinds.parse("relu")
    torch.testing.assert_close(relu.weights(z), by_hand, rtol=0, atol=0)
    hand = torch.tensor([[2.0, -1.0, 0.5, -math.inf]])  # three keys allowed: [2, 0, 0.5] / 3, a row past 0.5 and not 1
    torch.testing.assert_close(relu.weights(hand), torch.tensor([[2 / 3, 0.0, 0.5 / 3, 0.0]]))
    assert relu.weights(torch.full((1, 4), -2.0)).abs().sum() == 0  # every score below 0: an empty row
    assert relu.spec == "relu" and relu.weighs and not relu.with_stablemask and relu.trained_as() == "llama"


@pytest.mark.parametrize("bad", ["softmx", "sink(logit=x)", "sink(temp=1)", "softpick(eps=0)", "sigmoid(bias=inf)",
                                 "gate(rowwise)", 3, None, "relu(x=1)", "softmax@3", "sink(logit=nan)",
                                 "sink(logit=1, logit=2)", "sink(logit=0, init=-4)", ""])
def test_a_bad_kind_is_one_line(bad):
    with pytest.raises(InputError) as err:
        kinds.parse(bad)
    assert "\n" not in str(err.value)


def test_the_specs_read_back_and_bare_words_stand_for_their_arguments():
    for spec in ("softmax", "sink", "sink(logit=0)", "sink(logit=1.5)", "softpick", "softpick(eps=1e-05)", "sigmoid",
                 "sigmoid(bias=0)", "gate", "gate(headwise)", "relu"):
        assert kinds.parse(spec).spec == spec and kinds.parse(kinds.parse(spec).spec) == kinds.parse(spec)
    assert kinds.parse("softpick(eps=1e-6)") == kinds.parse("softpick") == kinds.Softpick()  # the default: one spec
    assert kinds.parse("gate(elementwise)") == kinds.parse("gate(headwise=false)") == kinds.Gate()
    assert kinds.parse(" Sink( logit = 0 ) ") == kinds.Sink(logit=0.0)


def test_a_kind_registered_in_kinds_alone_is_parsed_listed_and_trained():
    """Adding a kind is one class in kinds.py: the parser, the help every front end shows, the app's what-ifs, the
    lab's family and the recipe's checks read the registry."""
    from dataclasses import dataclass
    from typing import ClassVar

    from attnviz.lab import models

    @kinds.KINDS.register()
    @dataclass(frozen=True)
    class Square(kinds.Kind):
        name: ClassVar[str] = "square"
        forms: ClassVar[tuple[str, ...]] = ("square", "square(scale=s)")
        line: ClassVar[str] = "(s·ReLU(z))² / n"
        what_ifs: ClassVar[tuple[str, ...]] = ("square",)
        weighs: ClassVar[bool] = True
        scale: float = 1.0

        def weights(self, z, sink=None):
            return kinds.Relu().weights(z) ** 2 * self.scale

    try:
        made = kinds.parse("square(scale=2)")
        assert made == Square(2.0) and made.spec == "square(scale=2)" and "square" in kinds.names()
        assert kinds.help(trained=True).endswith("relu, square, square(scale=s)") and kinds.what_ifs()[-1] == "square"
        assert "`square`, `square(scale=s)`: (s·ReLU(z))² / n" in kinds.lines()
        assert models.family("square") == "llama" and kinds.weigher(made) == made.weights
        assert models.check("square", "stablemask", 1, "rope") == "square(scale=1)"  # every field, as the registry writes
        with pytest.raises(InputError, match="unknown parameter 'eps': square takes scale"):
            kinds.parse("square(eps=1)")
    finally:
        del kinds.KINDS.entries["square"]


def test_every_kind_is_in_the_help_of_the_commands_and_the_apps_lists(capsys):
    import ui.emergence
    import ui.sidebar
    from attnviz.cli import build_parser

    assert kinds.names() == ("softmax", "sink", "softpick", "sigmoid", "gate", "relu")
    for command, listed in (("train", kinds.help(trained=True)), ("capture", kinds.help())):
        with pytest.raises(SystemExit):
            build_parser(command).parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"attention kind: {listed}" in text and "relu" in text
    assert kinds.help(trained=True) == kinds.help().replace(" gate(headwise),", "")  # the one the lab refuses
    assert ui.sidebar.KINDS == [ui.sidebar.OWN, "softmax", "sink(logit=0)", "softpick", "sigmoid", "sigmoid(bias=0)",
                                "relu"]
    assert ui.emergence.KINDS == kinds.help(trained=True) and "relu" in ui.emergence.KINDS


def test_bigram_backcopy_follows_its_definition():
    task = BigramBackcopy(vocab=16, triggers=2, length=40, p_trigger=0.2, seed=1)
    x = task.batch(64)
    assert torch.equal(x, task.batch(64)) and not torch.equal(x, task.batch(64, step=1))
    assert (x[:, 0] == BOS).all() and (x[:, 1:] != BOS).all()
    trig = task.needs_attention(x)
    assert trig.any()
    # after a trigger, the token before it
    rows, cols = torch.nonzero(trig[:, 1:-1], as_tuple=True)
    cols = cols + 1
    assert torch.equal(x[rows, cols + 1], x[rows, cols - 1])
    # after an ordinary token: an ordinary token the bigram table allows, or a trigger
    table = task.table()
    for b, t in zip(*torch.nonzero(~trig[:, 1:-1], as_tuple=True)):
        prev, nxt = x[b, t + 1], x[b, t + 2]
        assert nxt <= task.triggers or table[prev, nxt] > 0
    with pytest.raises(InputError):
        BigramBackcopy(vocab=4, triggers=2)
