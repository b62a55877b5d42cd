"""The one call syntax (docs/methods.md#the-call-syntax): one parser and one layer list for architectures,
interventions, presses and cache policies; registries read parameters from the classes' fields."""

import inspect
from dataclasses import dataclass
from typing import ClassVar

import pytest

from attnviz.core.spec import arch, interventions, syntax
from attnviz.errors import InputError
from attnviz.kv import presses
from attnviz.effects.streaming import POLICIES


def test_call_reads_name_arguments_and_layers():
    parsed = syntax.call(" SinkScale( key=1 , beta=.5 )@ 3-5,7", "the intervention", "x")
    assert (parsed.name, parsed.args, parsed.layers) == ("sinkscale", {"key": "1", "beta": ".5"}, "3-5,7")
    assert syntax.call("ablate(heads=0,3, how=mean)", "x", "x").args == {"heads": "0,3", "how": "mean"}
    assert syntax.call("tova", "x", "x") == syntax.Call("tova", {}, None, "tova")
    assert syntax.split("a(x=1,2); b ;; c@1-2") == ["a(x=1,2)", "b", "c@1-2"]
    for bad, message in [("a(", "cannot read"), ("a(x)", "expected key=value"), ("a(x=1, x=2)", "given twice"),
                         ("a(b(c))", "cannot read")]:
        with pytest.raises(InputError, match=message):
            syntax.call(bad, "thing", "a(x=X)")


@pytest.mark.parametrize("text,expected", [
    (None, list(range(6))), ("all", list(range(6))), ("", list(range(6))), ("5", [5]), ("-1", [5]),
    ("0,5,-2", [0, 4, 5]), ("2-4", [2, 3, 4]), ("1-2, 4", [1, 2, 4]), ([3, 1, 3], [1, 3]), ("-3--1", [3, 4, 5]),
])
def test_one_layer_list_syntax(text, expected):
    assert syntax.layers(text, 6) == expected


@pytest.mark.parametrize("text,message", [
    ("6", "layer 6 does not exist"), ("-7", "layer -7 does not exist"), ("x", "cannot read the layer 'x'"),
    ("4-2", "runs backwards"), ("1-9", "layer 9 does not exist"),
])
def test_bad_layer_lists(text, message):
    with pytest.raises(InputError, match=message):
        syntax.layers(text, 6)


def test_the_same_layer_list_in_captures_and_interventions():
    assert syntax.ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    acts = interventions.parse("temperature(t=2)@-2-29", 30, 9)  # -2 is layer 28: the range 28-29
    assert acts.items[0].layers == (28, 29) and acts.spec == "temperature(t=2)@28-29"


def test_registries_read_fields_types_and_defaults():
    params = {p.name: (p.type, p.default) for p in interventions.INTERVENTIONS.parameters("sinkscale")}
    assert params == {"key": (int, 0), "beta": (float, 1.0)}
    assert interventions.INTERVENTIONS.required("ablate") == ["heads"]
    assert presses.PRESSES.defaults("snapkv") == {"window": 64, "kernel": 5}
    assert POLICIES.required("sink") == ["s", "w"] and POLICIES.parameters("dense") == []
    assert arch.MASKS.required("dilated") == ["w", "d"] and arch.MASKS.defaults("nosink-fwd") == {"m": 1}
    assert arch.NAMED.required("mask0&bidir") == ["k", "k0"]
    # every registered class's fields are what its registry reports: nothing is listed twice
    for registry in (interventions.INTERVENTIONS, presses.PRESSES, POLICIES, arch.MASKS, arch.NAMED):
        for name in registry.names():
            signature = inspect.signature(registry.entries[name]).parameters
            assert [p.name for p in registry.parameters(name)] == [k for k in signature if k not in registry.skip]


def test_a_new_kind_registers_in_one_place():
    registry = syntax.Registry("widget")

    @registry.register()
    @dataclass(frozen=True)
    class Knob:
        name: ClassVar[str] = "knob"
        turns: int = 2
        label: str = "a"
        scale: tuple[int, ...] = (1,)

    built = registry.build(syntax.call("knob(turns=3, scale=1,2)", "widget", registry.usage()))
    assert built == Knob(3, "a", (1, 2)) and registry.spec(built) == "knob(turns=3, label=a, scale=1,2)"
    assert registry.usage() == "knob(turns=TURNS, label=LABEL, scale=SCALE)"
    with pytest.raises(InputError, match="unknown widget 'dial'"):
        registry.build(syntax.call("dial", "widget", ""))
    with pytest.raises(InputError, match=r"turns=2\.5 must be a whole number"):
        registry.build(syntax.call("knob(turns=2.5)", "widget", ""))
