"""Metrics of SPEC §6 on matrices whose answers are worked out by hand."""

import numpy as np
import pytest

from attnviz import metrics
from attnviz.masks import fwd, nosink

FWD3 = fwd().matrix(3)
# one head, causal: row 0 all on key 0; row 1 splits 0.8/0.2; row 2 0.6/0.1/0.3
A = np.array([[[1.0, 0, 0], [0.8, 0.2, 0], [0.6, 0.1, 0.3]]])


def test_alpha_excludes_the_diagonal_and_is_null_where_no_query_sees_the_key():
    got = metrics.alpha(A, FWD3)
    np.testing.assert_allclose(got[0, :2], [(0.8 + 0.6) / 2, 0.1])
    assert np.isnan(got[0, 2])  # key 2 is only seen by query 2 itself
    hidden = nosink(fwd()).matrix(3)
    assert np.isnan(metrics.alpha(A, hidden)[0, 0])  # NoSink: no later query sees key 0


def test_sink_rate():
    alphas = np.array([0.9, 0.31, 0.3, 0.1, np.nan])
    assert metrics.sink_rate(alphas) == pytest.approx(2 / 5)
    assert metrics.sink_rate(alphas, eps=0.05) == pytest.approx(4 / 5)


def test_key_profile_and_sink_key():
    np.testing.assert_allclose(metrics.key_profile(A, FWD3, 0)[0], [1.0, 0.8, 0.6])
    prof = metrics.key_profile(A, FWD3, 2)[0]
    assert np.isnan(prof[:2]).all() and prof[2] == pytest.approx(0.3)
    np.testing.assert_allclose(metrics.column_mean(A)[0], [2.4 / 3, 0.3 / 3, 0.3 / 3])
    assert metrics.sink_key(A).tolist() == [0]
    # a late key seen by one query with weight 1 must not beat an early key seen a little by many
    late = np.array([[[1, 0, 0, 0], [0.5, 0.5, 0, 0], [0.4, 0.3, 0.3, 0], [0.1, 0.3, 0.3, 0.3]]])
    assert metrics.sink_key(late).tolist() == [0]


def test_shift_rate():
    assert metrics.shift_rate([0, 0, 0, 3], [1, 1, 2, 1], m=1) == pytest.approx(2 / 4)
    assert metrics.shift_rate([0, 0], [2, 2], m=2) == 1.0


def test_entropy_raw_and_normalised():
    uniform = np.array([[[1, 0, 0], [0.5, 0.5, 0], [1 / 3, 1 / 3, 1 / 3]]])
    np.testing.assert_allclose(metrics.entropy(uniform, FWD3)[0], [0, np.log(2), np.log(3)], atol=1e-6)
    np.testing.assert_allclose(metrics.entropy(uniform, FWD3, normalised=True)[0], [0, 1, 1], atol=1e-6)


def test_discarded_mass():
    stable = np.array([[[0.5, 0, 0], [0.4, 0.3, 0], [0.2, 0.3, 0.5]]])
    np.testing.assert_allclose(metrics.discarded_mass(stable)[0], [0.5, 0.3, 0.0], atol=1e-7)


def test_delimiters():
    assert metrics.is_delimiter(",") and metrics.is_delimiter(" .\n") and metrics.is_delimiter("\n\n")
    assert metrics.is_delimiter("—") and not metrics.is_delimiter(" the") and not metrics.is_delimiter("")


def test_allocation_by_token_type():
    tokens = ["The", " cat", ",", " sat"]
    probs = np.array([[
        [1.0, 0, 0, 0],
        [0.5, 0.5, 0, 0],
        [0.2, 0.3, 0.5, 0],
        [0.1, 0.2, 0.3, 0.3],  # 0.1 discarded
    ]])
    parts = metrics.allocation(probs, tokens)[0]
    assert list(metrics.ALLOCATION_PARTS) == ["first", "delimiter", "diagonal", "other", "discarded"]
    np.testing.assert_allclose(parts[0], [1, 0, 0, 0, 0], atol=1e-6)  # key 0 is first, not diagonal
    np.testing.assert_allclose(parts[2], [0.2, 0, 0.5, 0.3, 0], atol=1e-6)  # diagonal beats delimiter
    np.testing.assert_allclose(parts[3], [0.1, 0.3, 0.3, 0.2, 0.1], atol=1e-6)
    np.testing.assert_allclose(parts.sum(-1), 1, atol=1e-6)
