"""The capture plan is the library's (attnviz.plan): full maps, statistics with pooled maps, or a refusal
that says what would fit, decided from the estimate before anything runs."""

import pytest

from attnviz import plan
from attnviz.capture import capture
from attnviz.errors import InputError
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


def test_a_keep_refuses_an_unknown_statistic_at_once():
    """Named when the keep is made, with the known ones: before, it failed late, inside the engine's reducer."""
    with pytest.raises(InputError, match=r"unknown statistics 'alpah': choose from allocation, alpha, column_mean") as err:
        Keep(statistics=("alpah",))
    assert "\n" not in str(err.value)
    assert Keep(statistics="alpha").statistics == ("alpha",) and Keep(statistics=("alpha", "entropy")).statistics


def test_the_device_estimate_charges_what_the_route_makes():
    """A statistics capture of a text whose allow-set is above the whole-allow size makes it a block of rows at a
    time: it is charged a block's rows, not n × n (1 GiB at 32k tokens); full maps keep theirs whole. A keep that
    names one statistic is charged that one and the cheap ones, not every statistic."""
    from attnviz.stats import metrics

    lm = loaded("llama")
    n = int((plan.whole_allow_bytes() * 2) ** 0.5)  # n × n bools over the whole-allow size
    stats, full = Keep(statistics=True), Keep()
    rows = max(1, plan.block_bytes(lm, stats) // (4 * lm.n_heads * n))
    assert full.device_bytes(lm, n) - stats.device_bytes(lm, n) >= 2 * (n - rows) * n - 4 * lm.n_heads * n * 4 * 10
    assert metrics.statistic_floats(("alpha",)) == 4 and metrics.statistic_floats() == 10
    one, every = Keep(statistics=("alpha",)), Keep(statistics=True)
    assert every.host_bytes(lm, 300) - one.host_bytes(lm, 300) == 3 * lm.n_heads * 300 * 4 * 6


def test_prepare_plans_once_and_its_run_is_the_capture(monkeypatch, use_settings):
    """``prepare`` decides everything before anything runs (the plan under a budget, the device check) and its
    ``run`` is the capture itself: the same maps and statistics as ``capture`` of the keep it chose, run after
    run (each run records afresh)."""
    from dataclasses import replace

    import numpy as np

    from attnviz import recipe as recipe_mod
    from attnviz.capture import prepare
    from attnviz.core.model import devices

    lm, text = loaded("llama"), "The keeper lit the lamp at dusk."
    asked = Keep(hidden_states=True)
    prepared = prepare(lm, text, "fwd", asked, plan.Budget(per_capture=1, left=BIG, max_tokens=200))
    assert not prepared.plan.full_maps and prepared.keep.statistics is True and prepared.keep.pool == plan.POOL
    assert prepared.keep.checkpoints > 0 and "long text" in prepared.label
    assert prepared.key == (prepared.built.recipe.key, text, replace(prepared.keep, checkpoints=0))
    first, again = prepared.run(), prepared.run()
    direct = capture(lm, text, "fwd", prepared.keep)
    assert first.stats.keys() == direct.stats.keys() == set(range(lm.n_layers))
    for layer in direct.stats:
        for name, value in direct.stats[layer].items():
            np.testing.assert_array_equal(first.stats[layer][name], value)
            np.testing.assert_array_equal(again.stats[layer][name], value)
    assert prepare(lm, text, "fwd", asked).plan.full_maps  # no budget: the keep as asked

    ran = []
    monkeypatch.setattr(recipe_mod, "forward", lambda *a, **k: ran.append(1))
    use_settings(device_mb=0.01)
    with pytest.raises(devices.DeviceMemoryError, match="What would fit"):
        prepare(lm, text * 12, "fwd", Keep())
    with pytest.raises(InputError, match="captures at most 3"):
        prepare(lm, text, "fwd", Keep(), plan.Budget(BIG, BIG, max_tokens=3))
    assert not ran
