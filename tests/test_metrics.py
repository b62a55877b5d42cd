"""Metrics of docs/methods.md#sink-metrics on matrices whose answers are worked out by hand."""

import numpy as np
import pytest

from attnviz.stats import metrics
from attnviz.core.spec.masks import fwd, nosink

FWD3 = fwd().matrix(3)
# one head, causal: row 0 all on key 0; row 1 splits 0.8/0.2; row 2 0.6/0.1/0.3
A = np.array([[[1.0, 0, 0], [0.8, 0.2, 0], [0.6, 0.1, 0.3]]])


def gu_alpha(probs):
    """Gu et al.'s eval_sink_open_source.py, written out: sum_{i>=k} A[i, k] / (n - k) under FWD."""
    n = probs.shape[-1]
    return np.stack([[probs[h, k:, k].sum() / (n - k) for k in range(n)] for h in range(probs.shape[0])])


def test_alpha_includes_the_query_k_and_is_null_where_only_k_sees_the_key():
    got = metrics.alpha(A, FWD3)
    np.testing.assert_allclose(got[0, :2], [(1.0 + 0.8 + 0.6) / 3, (0.2 + 0.1) / 2])
    np.testing.assert_allclose(got[0, :2], gu_alpha(A)[0, :2])
    assert np.isnan(got[0, 2])  # key 2 is only seen by query 2 itself
    hidden = nosink(fwd()).matrix(3)
    assert np.isnan(metrics.alpha(A, hidden)[0, 0])  # NoSink: only query 0 itself sees key 0
    # BIDIR: every query sees every key, so the divisor is n for every key
    uniform = np.full((1, 3, 3), 1 / 3)
    np.testing.assert_allclose(metrics.alpha(uniform, np.ones((3, 3), bool))[0], [1 / 3] * 3)


def test_alpha_equals_gu_on_random_causal_maps():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 9, 9)) + np.where(FWD9 := fwd().matrix(9), 0, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(metrics.alpha(probs, FWD9)[:, :-1], gu_alpha(probs)[:, :-1], rtol=1e-6)


def test_sink_rate_counts_only_heads_where_alpha_is_defined():
    alphas = np.array([0.9, 0.31, 0.3, 0.1, np.nan])
    assert metrics.sink_rate(alphas) == pytest.approx(2 / 4)
    assert metrics.sink_rate(alphas, eps=0.05) == pytest.approx(4 / 4)
    assert np.isnan(metrics.sink_rate(np.array([np.nan, np.nan])))


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
