"""Bad or unusual input to path patching, the causal scan and activation patching, as a careless or hostile user
gives it: the library raises the project's input error in one line, naming what was wrong (never a foreign
exception, NaN or a silent wrong grid); a patching metric's result is checked before the grid runs; every null in
``paths --json`` has its reason beside it, and an empty result says why (docs/methods.md#path-patching)."""

import json
import re

import numpy as np
import pytest
import torch

import tiny
from attnviz.cli import main
from attnviz.effects import causal
from attnviz.effects.paths import paths
from attnviz.effects.patching import patching
from attnviz.errors import AttnvizError, InputError

TEXT = "The cat sat on the mat. The dog sat on the rug."
CLEAN, CORRUPTED = "The cat sat on the mat", "The dog sat on the rug"


@pytest.fixture(scope="module")
def llama():
    return tiny.loaded("llama")


# --- a patching metric's result, checked before the grid --------------------------------------------------------

def wide(logits):
    return logits[:, :2]


def a_float(logits):
    return 3.0


def an_array(logits):
    return np.zeros(logits.shape[0])


def not_a_number(logits):
    return torch.full((logits.shape[0],), float("nan"))


def a_scalar(logits):
    return logits[0, 0]


def nothing(logits):
    return None


def broken(logits):
    return logits[:, 10_000]


@pytest.mark.parametrize("metric, said", [
    (wide, r"returned a torch.float32 tensor of shape \(2, 2\)"),
    (a_float, r"returned 3.0 \(float\)"),
    (an_array, r"returned a numpy.ndarray of shape \(2,\)"),
    (not_a_number, r"returned \[nan, nan\]: a metric gives one finite number a batch row"),
    (a_scalar, r"returned a torch.float32 tensor of shape \(\)"),
    (nothing, r"returned None"),
    (broken, r"failed on a run's logits \(2, 96\): IndexError"),
], ids=lambda v: getattr(v, "__name__", ""))
def test_a_metric_s_result_is_refused_naming_it_before_any_patched_forward(llama, metric, said):
    calls = []

    def counted(logits):
        calls.append(logits.shape[0])
        return metric(logits)
    counted.__name__ = metric.__name__
    with pytest.raises(InputError, match=f"^the metric {metric.__name__} {said}") as err:
        patching(llama, CLEAN, CORRUPTED, metric=counted)
    assert "\n" not in str(err.value)
    assert calls == [2]  # once, on the clean and the corrupted run as one batch: never on a patched batch


def test_an_unnamed_metric_is_the_metric_and_a_nan_is_not_the_same_value(llama):
    with pytest.raises(InputError, match=r"^the metric returned \[nan, nan\]") as err:
        patching(llama, CLEAN, CORRUPTED, metric=lambda logits: logits[:, 0] * float("nan"))
    assert "nothing for a patch" not in str(err.value)


def test_a_metric_that_reads_the_first_row_alone_is_refused_not_broadcast_over_the_grid(llama):
    # one number for the batch, not one a row: read on one row at a time it would fill each layer's grid row with
    # the first patch's value
    with pytest.raises(InputError, match=r"^the metric returned a torch.float32 tensor of shape \(1,\): a metric "
                                         r"returns a torch tensor of shape \(2,\)"):
        patching(llama, CLEAN, CORRUPTED, metric=lambda logits: logits[:1, 0])


def test_a_good_metric_still_gives_the_grid(llama):
    def logit_0(logits):
        return logits[:, 0] - logits[:, 1]
    result = patching(llama, CLEAN, CORRUPTED, metric=logit_0)
    assert result.metric == "logit_0" and result.effect.shape == (llama.n_layers, len(result.positions))
    assert np.isfinite(result.effect).all()


@pytest.mark.parametrize("answer, said", [(1234, "the answer token is 1234, not a string"),
                                           (1.5, "the answer token is 1.5, not a string"),
                                           ("", "the answer token is empty")])
def test_an_answer_that_is_no_token_says_what_is_wrong_without_a_flag(llama, answer, said):
    with pytest.raises(InputError, match="^" + said) as err:
        patching(llama, CLEAN, CORRUPTED, answer=answer, wrong="x")
    assert "--" not in str(err.value)


# --- every public argument: the project's input error, never a foreign one ---------------------------------------

@pytest.mark.parametrize("senders", [5, [None], 1.5, [5], True, {"mlp.0": 1}, b"mlp.0"], ids=repr)
def test_senders_of_the_wrong_type_are_refused_in_one_line(llama, senders):
    with pytest.raises(InputError, match=r"^the senders are a comma-separated string or a list of strings"):
        paths(llama, TEXT, "fwd", senders, "head")


@pytest.mark.parametrize("receivers", [5, [None], 1.5, [3], True], ids=repr)
def test_receivers_of_the_wrong_type_are_refused_in_one_line(llama, receivers):
    with pytest.raises(InputError, match=r"^the receivers are a comma-separated string or a list of strings"):
        paths(llama, TEXT, "fwd", "mlp.0", receivers)


@pytest.mark.parametrize("call", [
    lambda lm: paths(lm, None, "fwd", "mlp.0", "head"),
    lambda lm: paths(lm, 5, "fwd", "mlp.0", "head"),
    lambda lm: causal.scan(lm, None, leaders=False),
    lambda lm: patching(lm, 5, CORRUPTED, metric="kl"),
    lambda lm: patching(lm, CLEAN, None, metric="kl"),
], ids=["paths-None", "paths-int", "scan-None", "patching-clean-int", "patching-corrupted-None"])
def test_a_text_that_is_no_string_is_named_so(llama, call):
    with pytest.raises(InputError, match=r"reads a text \(a string\), not (int|NoneType)$"):
        call(llama)


@pytest.mark.parametrize("recipe", [None, 5, 1.5], ids=repr)
def test_a_recipe_that_is_no_string_is_named_so(llama, recipe):
    with pytest.raises(InputError, match="runs under a recipe"):
        paths(llama, TEXT, recipe, "mlp.0", "head")
    with pytest.raises(InputError, match="runs under a recipe"):
        patching(llama, CLEAN, CORRUPTED, metric="kl", recipe=recipe)


@pytest.mark.parametrize("call", [
    lambda lm: paths(lm, TEXT, "fwd", ["mlp.-1"], "head"),
    lambda lm: paths(lm, TEXT, "fwd", "mlp.0", "keys.1.h-1"),
    lambda lm: paths(lm, TEXT, "fwd", "", "head"),
    lambda lm: paths(lm, TEXT, "fwd", "mlp.0", [""]),
    lambda lm: paths(lm, TEXT, "fwd", "mlp.0", "head", value=None),
    lambda lm: causal.scan(lm, TEXT, value=5, leaders=False),
    lambda lm: patching(lm, CLEAN, CORRUPTED, metric="kl", site=None),
    lambda lm: patching(lm, CLEAN, CORRUPTED, metric=5),
])
def test_other_hostile_values_were_already_refused_and_stay_so(llama, call):
    with pytest.raises(InputError) as err:
        call(llama)
    assert "\n" not in str(err.value)


# --- a reason beside every null in the paths' document ------------------------------------------------------------

def nulls_have_reasons(doc: dict) -> None:
    """Every null field, and every list with a null, has ``<field>_undefined`` beside it (``reached_from``: the
    reached drop's reason, which says why no layer is reached)."""
    for key, value in doc.items():
        if value is None:
            assert f"{'sink_drop_reached' if key == 'reached_from' else key}_undefined" in doc, key
        elif isinstance(value, list) and any(v is None for v in value):
            assert f"{key}_undefined" in doc, key


def test_every_null_in_a_path_has_its_reason_and_reached_from_is_a_layer(llama):
    doc = paths(llama, TEXT, "fwd", "mlp.0,mlp.1", "head,mlp.2,mlp.*,keys.2").as_json()
    by = {(p["sender"], p["receiver"]): p for p in doc["paths"]}
    top = llama.n_layers - 1
    for p in doc["paths"]:
        nulls_have_reasons(p)
        assert p["reached_from"] is None or 0 <= p["reached_from"] <= top
    # the head and the top MLP are read after the top layer's attention: no layer's sink can move
    for key in [("mlp.0", "head"), ("mlp.0", "mlp.2"), ("mlp.1", "mlp.*")]:
        assert by[key]["reached_from"] is None and by[key]["sink_drop_reached"] is None
        assert "after the top layer's attention" in by[key]["sink_drop_reached_undefined"]
    assert by["mlp.0", "mlp.*"]["reached_from"] == 2 and by["mlp.0", "mlp.*"]["sink_drop_reached"] is not None
    assert by["mlp.0", "keys.2"]["reached_from"] == 2
    nulls_have_reasons({k: v for k, v in doc.items() if k != "paths"})
    json.dumps(doc, allow_nan=False)


def test_paths_with_no_necessary_writer_say_so(llama, capsys, monkeypatch):
    assert causal.scan(llama, TEXT, leaders=False).necessary == []  # the tiny random model's sink needs no write
    found = paths(llama, TEXT)
    assert found.senders == [] and found.after == {}
    assert found.as_json()["note"].startswith("the causal scan finds no necessary writer")
    monkeypatch.setattr("attnviz.cli.common.load", lambda args: llama)
    assert main(["paths", "--text", TEXT, "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["note"] == found.note
    assert err.strip() == f"attnviz: note: {found.note}"
    assert "note" not in paths(llama, TEXT, "fwd", "mlp.0", "head").as_json()  # a named sender: no note


# --- a bidirectional layer: refused, as docs/methods.md says ------------------------------------------------------

@pytest.mark.parametrize("recipe, layer", [("bidir", 0), ("mask0-bidir(k=1)", 2), ("stablemask(gamma=0.5)", 0)])
def test_paths_and_the_scan_refuse_a_bidirectional_layer_saying_why(llama, recipe, layer):
    for call, what in ((lambda: paths(llama, TEXT, recipe, "mlp.0", "head"), "path patching"),
                       (lambda: causal.scan(llama, TEXT, recipe, leaders=False), "the causal scan")):
        with pytest.raises(AttnvizError, match=rf"^cannot run {what}, which measures the text's perplexity, with "
                                                rf"'{re.escape(recipe)}': layer {layer} uses"):
            call()


def test_the_docs_say_a_bidirectional_layer_is_refused():
    from pathlib import Path

    text = " ".join((Path(__file__).parents[1] / "docs" / "methods.md").read_text().split())
    section = text[text.index("## Path patching"):text.index("### Heads as receivers")]
    assert "is refused by path patching and the causal scan" in section
    assert "a bidirectional layer) or a learned sink" not in section


# --- the reached drop: a number over the layers a cut can move, or a refusal -------------------------------------

def _three_layers():
    """Paths of mlp.0 on three layers, by hand: before, the sink's attention 0.5, 0.4, 0.6 in layers 0-2."""
    from attnviz.effects.opening import SinkProfile
    from attnviz.effects.paths import Paths

    keys = [0, 0, 0]
    after = {("mlp.0", "keys.2"): [0.5, 0.4, 0.3], ("mlp.0", "mlp.1"): [0.5, 0.4, 0.15],
             ("mlp.0", "head"): [0.5, 0.4, 0.6], ("mlp.0", "mlp.2"): [0.5, 0.4, 0.6]}
    return Paths({}, 5, "zero", SinkProfile(keys, [0.5, 0.4, 0.6], 10.0), ["mlp.0"],
                 {k: SinkProfile(keys, v, 11.0) for k, v in after.items()}, {k: [k[1]] for k in after})


def test_the_reached_drop_is_the_fall_over_the_layers_the_cut_can_move():
    """keys.2 is read in layer 2: (0.6 - 0.3) / 0.6 = 0.5 there, against the drop over layers 1-2, (0.5 - 0.35) / 0.5
    = 0.3; mlp.1's output enters layer 2: (0.6 - 0.15) / 0.6 = 0.75."""
    found = _three_layers()
    assert found.reach_from("mlp.0", "keys.2") == 2 and found.reached("mlp.0", "keys.2") == pytest.approx(0.5)
    assert found.drop("mlp.0", "keys.2") == pytest.approx(0.3)
    assert found.reach_from("mlp.0", "mlp.1") == 2 and found.reached("mlp.0", "mlp.1") == pytest.approx(0.75)
    assert found.reaches("mlp.0", "keys.2") and not found.reaches("mlp.0", "head")
    assert found.strongest("mlp.0") == [("mlp.1", pytest.approx(0.75)), ("keys.2", pytest.approx(0.5))]


@pytest.mark.parametrize("receiver, read", [("head", "head is read"), ("mlp.2", "mlp.2 is read")])
def test_a_cut_read_after_the_top_layer_has_no_reached_drop_and_says_which_do(receiver, read):
    """The head and the top MLP are read after the top layer's attention: reached() was NaN and reach_from() said
    layer 2n - 1 for the head (59 on a 30-layer model); both are refused naming the receivers that have one."""
    found = _three_layers()
    for call in (found.reached, found.reach_from):
        with pytest.raises(InputError, match=f"mlp.0 → {receiver}: {read} after the top layer's attention.*"
                                             "the receivers of mlp.0 with a reached drop: keys.2, mlp.1 ") as err:
            call("mlp.0", receiver)
        assert "\n" not in str(err.value)
    assert found.drop("mlp.0", receiver) == pytest.approx(0.0)  # the scan's scale stays defined: unchanged


@pytest.mark.parametrize("sender, receiver, said", [
    ("mlp.0", "attn.9", "no path mlp.0 → 'attn.9' was measured: mlp.0's receivers are keys.2, mlp.1, head, mlp.2"),
    ("attn.1", "head", "no path from 'attn.1' was measured: the senders are mlp.0"),
])
def test_a_path_not_measured_is_refused_naming_those_that_were(sender, receiver, said):
    found = _three_layers()
    for call in (found.drop, found.reached, found.reach_from, found.reaches):
        with pytest.raises(InputError, match=re.escape(said)):
            call(sender, receiver)


def test_a_real_reached_drop_is_its_definition_and_the_head_is_refused(llama):
    found = paths(llama, TEXT, "fwd", "mlp.0", "head,keys.2")
    before, after = found.before.attention[2], found.after["mlp.0", "keys.2"].attention[2]
    assert found.reached("mlp.0", "keys.2") == pytest.approx((before - after) / before)
    with pytest.raises(InputError, match="mlp.0 → head: head is read after the top layer's attention"):
        found.reached("mlp.0", "head")
