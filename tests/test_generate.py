"""Greedy generation under an architecture: FWD matches transformers' own greedy search; others are refused."""

import pytest
import torch

from attnviz.errors import ArchitectureError, InputError
from attnviz.generate import generate

from tiny import loaded


def test_fwd_generation_matches_transformers_greedy():
    lm = loaded("qwen2")
    ids = lm.tokenizer("greedy")["input_ids"]
    new, _ = generate(lm, "greedy", "fwd", max_new_tokens=6)
    lm.model.generation_config.eos_token_id = None
    with torch.no_grad():
        reference = lm.model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                      pad_token_id=0)[0, len(ids):].tolist()
    assert new == reference


def test_nosink_changes_the_continuation_but_is_allowed():
    lm = loaded("llama")
    fwd, _ = generate(lm, "a sink", "fwd", max_new_tokens=8)
    nosink, _ = generate(lm, "a sink", "nosink-fwd(m=2)", max_new_tokens=8)
    assert len(fwd) == len(nosink) == 8


@pytest.mark.parametrize("spec", ["bidir", "mask0-bidir(k=1)", "back", "stablemask(gamma=0.5)"])
def test_non_causal_architectures_are_refused(spec):
    with pytest.raises(ArchitectureError, match="cannot generate"):
        generate(loaded("llama"), "no", spec)


def test_bad_length():
    with pytest.raises(InputError, match="max_new_tokens"):
        generate(loaded("llama"), "no", "fwd", max_new_tokens=0)
