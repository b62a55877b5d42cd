"""The capture plan is the library's (attnviz.plan): full maps, statistics with pooled maps, or a refusal
that says what would fit, decided from the estimate before anything runs."""

import pytest

from attnviz import plan
from attnviz.capture import capture
from attnviz.plan import Keep

from tiny import loaded

BIG = 10**12


def test_full_maps_when_they_fit_else_statistics_with_pooled_maps_and_checkpoints():
    lm = loaded("llama")
    asked = Keep(hidden_states=True)
    full = asked.host_bytes(lm, 200)
    p = plan.plan(lm, 200, per_capture=full, left=BIG, keep=asked)
    assert p.full_maps and p.keep == asked and p.estimate == full
    p = plan.plan(lm, 200, per_capture=full - 1, left=BIG, keep=asked)
    assert not p.full_maps and p.keep.pool == plan.POOL and p.keep.checkpoints >= 1 and not p.keep.hidden_states
    assert p.estimate == Keep(statistics=True, pool=plan.POOL, checkpoints=p.keep.checkpoints).host_bytes(lm, 200)
    cap = capture(lm, "word " * 60, "fwd", p.keep)  # the plan's keep is what capture takes
    assert cap.reduced and cap.checkpoints


def test_refusals_say_what_would_fit():
    lm = loaded("llama")
    asked = Keep(hidden_states=True)
    limit = asked.host_bytes(lm, 100)
    with pytest.raises(plan.CaptureTooLarge, match=r"A residual variant needs the full maps.*at most ~(\d+) tokens"):
        plan.plan(lm, 400, per_capture=limit, left=BIG, keep=asked, residual="method1")
    with pytest.raises(plan.CaptureTooLarge, match="This view needs the full maps") as refused:
        plan.plan(lm, 400, per_capture=limit, left=BIG, keep=Keep(hidden_states=True, activations=True))
    fit = int(str(refused.value).split("at most ~")[1].split(" ")[0])
    assert 0 < fit <= 100 and plan.plan(lm, fit, per_capture=limit, left=BIG, keep=asked).full_maps
    stats = Keep(statistics=True, pool=plan.POOL).host_bytes(lm, 400)
    with pytest.raises(plan.CaptureTooLarge, match="even as statistics only"):
        plan.plan(lm, 400, per_capture=1, left=stats - 1)
