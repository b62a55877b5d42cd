"""The capture plan is the library's (attnviz.plan): full maps, statistics with pooled maps, or a refusal
that says what would fit, decided from the estimate before anything runs."""

import pytest

from attnviz import plan
from attnviz.capture import capture, estimate_bytes

from tiny import loaded

BIG = 10**12


def test_full_maps_when_they_fit_else_statistics_with_pooled_maps_and_checkpoints():
    lm = loaded("llama")
    full = estimate_bytes(lm, 200, hidden_states=True)
    p = plan.plan(lm, 200, per_capture=full, left=BIG)
    assert p.full_maps and p.options == {} and p.estimate == full
    p = plan.plan(lm, 200, per_capture=full - 1, left=BIG)
    assert not p.full_maps and p.options["pool"] == plan.POOL and p.options["checkpoints"] >= 1
    assert p.estimate == estimate_bytes(lm, 200, reduce=True, pool=plan.POOL, checkpoints=p.options["checkpoints"])
    cap = capture(lm, "word " * 60, **p.options)  # the plan is what capture takes
    assert cap.reduced and cap.checkpoints


def test_refusals_say_what_would_fit():
    lm = loaded("llama")
    limit = estimate_bytes(lm, 100, hidden_states=True)
    with pytest.raises(plan.CaptureTooLarge, match=r"A residual variant needs the full maps.*at most ~(\d+) tokens"):
        plan.plan(lm, 400, per_capture=limit, left=BIG, residual="method1")
    with pytest.raises(plan.CaptureTooLarge, match="This view needs the full maps") as refused:
        plan.plan(lm, 400, per_capture=limit, left=BIG, extras=("activations",))
    fit = int(str(refused.value).split("at most ~")[1].split(" ")[0])
    assert 0 < fit <= 100 and plan.plan(lm, fit, per_capture=limit, left=BIG).full_maps
    stats = estimate_bytes(lm, 400, reduce=True, pool=plan.POOL)
    with pytest.raises(plan.CaptureTooLarge, match="even as statistics only"):
        plan.plan(lm, 400, per_capture=1, left=stats - 1)
