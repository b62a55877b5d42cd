"""The walkthrough's arithmetic, checked by hand on the lecture's matrices."""

import numpy as np
import pytest

from attnviz.effects import walkthrough as W
from attnviz.errors import InputError


def test_fwd_steps_by_hand():
    s = W.steps(W.Q, W.K, W.V, "FWD")
    # row 0 of Q·Kᵀ: [1*6+2*5, 1*4+2*3, 1*2+2*1] = [16, 10, 4], scaled by 1/sqrt(2)
    np.testing.assert_allclose(s["scores"][0], np.array([16, 10, 4]) / np.sqrt(2))
    assert s["weights"][0].tolist() == [1.0, 0.0, 0.0]  # the first token only sees itself
    w1 = np.exp(np.array([38, 24]) / np.sqrt(2))
    np.testing.assert_allclose(s["weights"][1, :2], w1 / w1.sum())
    np.testing.assert_allclose(s["output"][0], [2, 4])
    np.testing.assert_allclose(s["weights"].sum(1), 1)


def test_stablemask_keeps_less_than_one():
    s = W.steps(W.Q, W.K, W.V, "StableMask (gamma=0.5)")
    assert (np.triu(s["weights"], 1) == 0).all()
    assert s["discarded"][0] > 0 and s["discarded"][-1] == pytest.approx(0)


def test_bad_matrices():
    with pytest.raises(InputError, match="same number of entries"):
        W.parse_matrix("1 2\n3", "Q")
    with pytest.raises(InputError, match="must match"):
        W.steps([[1, 2]], [[1, 2, 3]], [[1]], "FWD")
