"""Every mask type against matrices written out by hand (rows = queries, columns = keys)."""

import numpy as np
import pytest
import torch

from attnviz.core.spec import masks as M
from attnviz.errors import MaskError


def m(rows: str) -> np.ndarray:
    return np.array([[c == "1" for c in row] for row in rows.split()], dtype=bool)


CASES = {
    "fwd": (M.fwd(), m("1000 1100 1110 1111")),
    "back": (M.back(), m("1111 0111 0011 0001")),
    "bidir": (M.bidir(), m("1111 1111 1111 1111")),
    "nosink-fwd": (M.nosink(M.fwd()), m("1000 0100 0110 0111")),
    "nosink-fwd(m=2)": (M.nosink(M.fwd(), 2), m("10000 01000 00100 00110 00111")),
    "nosink-bidir": (M.nosink(M.bidir()), m("1111 0111 0111 0111")),
    "nosink-bidir(m=2)": (M.nosink(M.bidir(), 2), m("11111 01111 00111 00111 00111")),
    "nosink-back": (M.nosink(M.back()), m("1111 0111 0011 0001")),
    "sliding(w=2)": (M.sliding(2), m("10000 11000 01100 00110 00011")),
    "sliding(w=4, dir=bidir)": (M.sliding(4, "bidir"), m("11100 11110 11111 01111 00111")),
    "dilated(w=2, d=2)": (M.dilated(2, 2), m("100000 010000 101000 010100 001010 000101")),
    "global(w=2, g=1)": (M.global_sliding(2, 1), m("10000 11000 11100 10110 10011")),
    "global(w=2, g=2)": (M.global_sliding(2, 2), m("10000 11000 11100 11110 11011")),
    "global(w=2, g=1, dir=bidir)": (M.global_sliding(2, 1, "bidir"), m("11111 11100 11110 10111 10011")),
    "stablemask(gamma=0.5)": (M.stablemask(0.5), m("100 110 111")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mask_matrix_and_name(name):
    mask, expected = CASES[name]
    assert mask.name == name
    np.testing.assert_array_equal(mask.matrix(expected.shape[0]), expected)


def test_no_row_is_ever_empty():
    for mask, expected in CASES.values():
        assert mask.matrix(7).any(1).all(), mask.name


def test_keep_self_repairs_only_empty_rows():
    never = M.custom(lambda b, h, q, kv: kv > 100, name="never")
    np.testing.assert_array_equal(never.matrix(3), np.eye(3, dtype=bool))
    # rows that have a key keep exactly their keys
    allow = torch.tensor([[False, False, False], [True, False, False], [False, False, False]])
    np.testing.assert_array_equal(M.keep_self_if_empty(allow).numpy(), m("100 100 001"))
    # when queries are the last keys (KV cache), "self" is the query's own key index
    allow = torch.zeros(1, 3, dtype=torch.bool)
    np.testing.assert_array_equal(M.keep_self_if_empty(allow).numpy(), m("001"))


def test_composition_and_or_not():
    even_keys = M.custom(lambda b, h, q, kv: kv % 2 == 0).predicate
    both = M.Mask("x", M.and_masks(M.causal, even_keys))
    np.testing.assert_array_equal(both.matrix(4), m("1000 1000 1010 1010"))
    either = M.Mask("y", M.or_masks(M.causal, even_keys))
    np.testing.assert_array_equal(either.matrix(4), m("1010 1110 1110 1111"))
    neither = M.Mask("z", M.not_mask(M.causal))
    np.testing.assert_array_equal(neither.matrix(3), m("011 001 001"))  # row 2 repaired to itself


def test_composition_matches_transformers_masking_utils():
    """Our and_masks / or_masks are transformers' composition, written out for start-up time."""
    from transformers import masking_utils

    even_keys = M.custom(lambda b, h, q, kv: kv % 2 == 0).predicate
    q, kv, zero = torch.arange(6)[:, None], torch.arange(6)[None, :], torch.tensor(0)
    for ours, theirs in ((M.and_masks, masking_utils.and_masks), (M.or_masks, masking_utils.or_masks)):
        for parts in ((M.causal, even_keys), (M.causal, M.hide_first_keys(2), even_keys), (M.anticausal,)):
            assert torch.equal(ours(*parts)(zero, zero, q, kv), theirs(*parts)(zero, zero, q, kv))


def test_masks_use_positions_not_indices():
    """Under padding the engine passes real-token positions; NoSink hides position 0, wherever it is."""
    mask = M.nosink(M.fwd())
    pos = torch.tensor([0, 0, 1, 2])  # a left pad (clamped to 0), then three real tokens
    allow = mask.allow(pos[:, None], pos[None, :])
    np.testing.assert_array_equal(allow[1:, 1:].numpy(), m("100 010 011"))


def test_custom_matrix_validation():
    ok = M.custom(np.array([[1, 0], [1, 1]]))
    np.testing.assert_array_equal(ok.matrix(2), m("10 11"))
    assert ok.causal_compatible
    assert not M.custom(m("11 11")).causal_compatible
    with pytest.raises(MaskError, match="square"):
        M.custom(np.ones((2, 3)))
    with pytest.raises(MaskError, match="boolean"):
        M.custom(np.array([[0.5, 0], [1, 1]]))
    with pytest.raises(MaskError, match=r"row\(s\) \[1\]"):
        M.custom(m("10 00"))
    with pytest.raises(MaskError, match="2x2 but the text has 3"):
        ok.matrix(3)


@pytest.mark.parametrize("bad", [lambda: M.sliding(0), lambda: M.nosink(M.fwd(), 0), lambda: M.dilated(2, 1.5),
                                 lambda: M.stablemask(-1.0), lambda: M.stablemask(slopes="x"),
                                 lambda: M.sliding(4, "sideways")])
def test_bad_parameters(bad):
    with pytest.raises(MaskError):
        bad()


def test_stablemask_pseudo_logits_and_alibi():
    pos = torch.arange(4)
    np.testing.assert_allclose(M.stablemask(0.5).pseudo_logits(pos, 2).numpy(), np.tile(-0.5 * np.arange(4), (2, 1)))
    batch = torch.stack([pos, pos + 1])  # (B, n): the heads broadcast against the batch, (H, B, n)
    np.testing.assert_allclose(M.stablemask(0.5).pseudo_logits(batch, 2).numpy(),
                               np.tile(-0.5 * batch.numpy(), (2, 1, 1)))
    slopes = M.stable_gammas("alibi", 4).numpy()
    np.testing.assert_allclose(slopes, [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8])


def test_causal_compatibility():
    assert M.fwd().causal_compatible and M.nosink(M.fwd()).causal_compatible and M.sliding(3).causal_compatible
    assert not M.bidir().causal_compatible and not M.back().causal_compatible
    assert not M.stablemask(0.5).causal_compatible and not M.nosink(M.bidir()).causal_compatible


@pytest.mark.parametrize("heads,expected", [
    (8, [2.0 ** -e for e in range(1, 9)]),
    # not a power of two: the 8-head slopes, then every other slope of the 16-head set
    (9, [2.0 ** -e for e in range(1, 9)] + [2.0 ** -0.5]),
    (12, [2.0 ** -e for e in range(1, 9)] + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5]),
])
def test_alibi_slopes_match_the_standard_table(heads, expected):
    np.testing.assert_allclose(M.stable_gammas("alibi", heads).numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("stable", [0.5, "alibi"])
def test_sm_i_extra_logit_closed_form(stable):
    T, heads = 12, 9
    mask = M.stablemask(gamma=None if stable == "alibi" else stable, slopes="alibi" if stable == "alibi" else None, T=T)
    tau = mask.inference_logits(torch.arange(T)[None], heads)[0, :, :, 0]  # (H, T)
    gammas = M.stable_gammas(stable, heads).double()
    for i in range(T):
        if i == T - 1:
            assert torch.isinf(tau[:, i]).all() and (tau[:, i] < 0).all()  # no future slot left
            continue
        j = torch.arange(i + 1, T).double()
        expected = torch.logsumexp(-gammas[:, None] * j[None], dim=-1)
        torch.testing.assert_close(tau[:, i].double(), expected, rtol=1e-5, atol=1e-5)
    assert mask.causal_compatible and mask.name.endswith(", T=12)")
