"""Named architectures and the docs/methods.md#the-call-syntax grammar."""

import pytest

from attnviz.core.spec.arch import parse
from attnviz.errors import ArchitectureError

L = 6


def names(spec, n=L):
    return parse(spec, n).layer_names


def test_single_mask_fills_every_layer():
    assert names("fwd") == ["fwd"] * L
    assert names(" NoSink-FWD ( m = 2 ) ") == ["nosink-fwd(m=2)"] * L
    assert names("sliding(w=64, dir=bidir)") == ["sliding(w=64, dir=bidir)"] * L
    assert names("stablemask(slopes=alibi)") == ["stablemask(slopes=alibi)"] * L
    assert parse("STABLEMASK(gamma=0.25)", L).spec == "stablemask(gamma=0.25)"


@pytest.mark.parametrize("spec,expected", [
    ("inplace-bidir(k=2)", ["fwd"] * 4 + ["bidir"] * 2),
    ("inplace-back(k=2)", ["fwd"] * 4 + ["back"] * 2),
    ("mask0-fwd(k=2)", ["fwd"] * 4 + ["nosink-fwd"] * 2),
    ("mask0-bidir(k=2)", ["fwd"] * 4 + ["nosink-bidir"] * 2),
    ("mask0-all(k=2)", ["nosink-fwd"] * 4 + ["nosink-bidir"] * 2),
    ("mask0-all(k=0)", ["nosink-fwd"] * 6),
    ("mask0&bidir(k=4, k0=1)", ["fwd"] * 2 + ["bidir"] * 3 + ["nosink-bidir"]),
    ("mask0&bidir(k=3, k0=3)", ["fwd"] * 3 + ["nosink-bidir"] * 3),
    ("inplace-bidir(k=0)", ["fwd"] * 6),
    ("inplace-bidir(k=6)", ["bidir"] * 6),
])
def test_named_architectures(spec, expected):
    arch = parse(spec, L)
    assert arch.layer_names == expected
    assert arch.spec == spec.replace(", ", ", ")


def test_per_layer_list_and_canonical_form():
    arch = parse("fwd*3 + bidir*1 + nosink-bidir(m=2)*2", L)
    assert arch.layer_names == ["fwd"] * 3 + ["bidir"] + ["nosink-bidir(m=2)"] * 2
    assert arch.spec == "fwd*3 + bidir*1 + nosink-bidir(m=2)*2"
    assert parse("fwd*2+fwd*2+back+back", L).spec == "fwd*4 + back*2"
    # the list form of a named architecture parses back to the same layers
    named = parse("mask0&bidir(k=4, k0=1)", L)
    assert parse(named.as_list(), L).layer_names == named.layer_names


@pytest.mark.parametrize("spec,message", [
    ("", "empty architecture"),
    ("mask0-bidir(k=40)", "k=40 but the model has 6 layers"),
    ("mask0-bidir", "needs k="),
    ("mask0&bidir(k=2, k0=3)", "k0=3 must be between 0 and k=2"),
    ("mask0&bidir(k=2)", "needs k0="),
    ("fwd*3 + bidir*2", "covers 5 layers but the model has 6"),
    ("fwd*3 + bidr*3", "unknown mask type 'bidr'"),
    ("fwd*3 + mask0-bidir(k=2)*3", "named architectures cannot be list items"),
    ("fwd*x + bidir*3", "count 'x'"),
    ("fwd*0 + bidir*6", "count '0'"),
    ("sliding", "sliding needs w="),
    ("sliding(w=abc)", "w=abc is not a number"),
    ("sliding(w=2.5)", "must be a whole number"),
    ("nosink-fwd(q=1)", "unknown parameter 'q'"),
    ("nosink-fwd(m)", "expected key=value"),
    ("fwd(", "cannot read"),
    ("fwd*3 ++ bidir*3", "empty item"),
    ("sliding(w=4, dir=up)", "dir must be"),
    ("mask0-bidir(k=2)*3", "cannot take"),
    ("stablemask(gamma=0)", "gamma must be > 0"),
])
def test_malformed_strings_name_the_bad_part(spec, message):
    with pytest.raises(ArchitectureError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        parse(spec, L)


def test_impossible_layer_count():
    with pytest.raises(ArchitectureError, match="positive integer"):
        parse("fwd", 0)
