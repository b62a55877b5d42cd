"""Bad or unusual input to the sinks, the valley, a capture's sinks and the learned sink, as a careless or hostile
user gives it: the library raises the project's input error in one line (never a foreign exception, NaN or a silent
no-op), the command line exits 2 with one line, and every null in a document comes with its reason."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import tiny
from attnviz.capture import capture
from attnviz.effects import valley
from attnviz.errors import AttnvizError, InputError
from attnviz.plan import Keep
from attnviz.support import in_dtype
from attnviz.tokens import tokenize

TEXT = "The cat sat on the mat."
BAD_EPS = [float("nan"), float("inf"), 2, -1, None, "0.3", True]


@pytest.fixture(scope="module")
def llama():
    return tiny.loaded("llama")


@pytest.fixture(scope="module", params=["maps", "statistics"])
def either_capture(request, llama):
    keep = Keep() if request.param == "maps" else Keep(statistics=True)
    return capture(llama, TEXT, "fwd", keep)


@pytest.mark.parametrize("eps", BAD_EPS, ids=repr)
def test_a_capture_s_sinks_refuse_an_eps_outside_0_to_1(either_capture, eps):
    with pytest.raises(InputError, match="eps must be"):
        either_capture.sinks(0, eps)


@pytest.mark.parametrize("layer", ["0", 99, -1, None, 1.0, True], ids=repr)
def test_a_capture_s_sinks_and_learned_sink_refuse_a_layer_not_recorded(either_capture, layer):
    with pytest.raises(InputError, match="no recorded layer .*recorded layers 0-2"):
        either_capture.sinks(layer)
    with pytest.raises(InputError, match="no recorded layer"):
        either_capture.learned_alpha(layer)


def test_good_eps_and_layers_still_answer(either_capture):
    assert either_capture.learned_alpha(1) is None  # a model with no learned sink: None means that, and only that
    assert either_capture.sinks(np.int64(0), 0) == either_capture.sinks(0, 0.0)  # eps 0: every defined alpha counts
    assert isinstance(either_capture.sinks(1, 1), list)


@pytest.mark.parametrize("cap", [2.5, "7", 0, -3, True], ids=repr)
def test_the_valley_and_tokenize_refuse_a_cap_that_is_no_whole_count(llama, cap, monkeypatch):
    import importlib

    capture_mod = importlib.import_module("attnviz.capture")

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran before the refusal")

    monkeypatch.setattr(capture_mod, "prepare", no_forward)
    with pytest.raises(InputError, match="max_tokens must be"):
        valley.measure(llama, TEXT, max_tokens=cap)
    with pytest.raises(InputError, match="max_tokens must be"):
        tokenize(llama, TEXT, cap)


def test_the_valley_s_document_refuses_a_nan_eps_and_gives_reasons_for_its_nulls(llama):
    found = valley.measure(llama, TEXT)
    with pytest.raises(InputError, match="eps must be"):
        found.as_json(eps=float("nan"))
    assert "null_reasons" not in json.loads(json.dumps(found.as_json()))  # nothing null: nothing to explain
    one = valley.measure(llama, "T").as_json()
    assert all(row["entropy"] is None and row["sink_rate"] is None for row in one["layers"])
    assert "two or more tokens" in one["null_reasons"]["entropy"]
    assert "one-token text" in one["null_reasons"]["sink_rate"]


def test_token_ids_past_the_embedding_are_refused_naming_the_token():
    class Wide(tiny.CharTokenizer):  # a tokenizer from a larger vocabulary than the model's
        def __call__(self, text, add_special_tokens=True, **kwargs):
            ids = super().__call__(text)["input_ids"]
            return {"input_ids": ids[:2] + [10_000] + ids[2:]}

    model = tiny.build("llama")
    loaded = tiny.LoadedModel(model, Wide(), "tiny-llama", None, 0.0)
    rows = model.get_input_embeddings().num_embeddings
    with pytest.raises(InputError, match=rf"token 2 .*id 10000\) is past tiny-llama's embedding, which has {rows} rows"):
        capture(loaded, "abc", "fwd")


def test_a_float16_overflow_is_refused_in_one_line_by_the_valley_not_by_the_eigensolver(gemma3_model):
    """Gemma 3 270M's stream passes float16's largest value on a short sentence: it has no spectrum, so the entropy
    is left undefined and the forward's own overflow check refuses the run, as it does for a capture (before:
    "linalg.eigh: The algorithm failed to converge", an internal error)."""
    with pytest.raises(AttnvizError, match="overflows float16 before layer .*: load it in bfloat16 or float32"):
        valley.measure(in_dtype(gemma3_model, torch.float16), TEXT)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "attnviz", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=600)


def test_the_sinks_command_refuses_corpus_options_with_one_text_and_explains_its_nulls(model_cache):
    for flags in (["--max-len", "4"], ["--samples", "2"]):
        out = run_cli("sinks", "--text", TEXT, *flags)
        assert out.returncode == 2 and "corpus" in out.stderr and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1
    doc = json.loads(run_cli("sinks", "--text", "Hi", "--json").stdout)
    assert doc["n_tokens"] == 1
    assert set(doc["null_reasons"]) == {"alpha", "sink_rate", "entropy"}
    assert "one-token" in doc["null_reasons"]["entropy"]
