"""The engine's route choice is one function of plain facts (attnviz.core.engine.choose_route), tested alone;
reducers follow one protocol; every statistic is declared once (attnviz.stats.metrics.STATISTICS) and the
block reducer, the numpy reference and the memory estimate all read that declaration."""

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from attnviz.core.record import reduce
from attnviz.stats import metrics
from attnviz.core.engine import Facts, Route, choose_route

R = Route
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("facts,route", [
    (Facts(), R.SDPA_MASKED),
    (Facts(plain_causal=True), R.SDPA_CAUSAL),
    (Facts(plain_causal=True, recorded=True), R.BLOCKS),
    (Facts(plain_causal=True, head_mask=True), R.BLOCKS),  # a compressed cache: per-head masks
    (Facts(plain_causal=True, reshapes=True), R.BLOCKS),  # temperature, sinkscale, sinklogit
    (Facts(stablemask=True), R.BLOCKS),
    (Facts(softcap=True), R.BLOCKS),
    (Facts(sink_logits=True), R.BLOCKS),
    (Facts(keep_graph=True), R.BLOCKS),  # residual variants
    (Facts(recorded=True, block_reducer=True, fused_reducer=True, kernel=True), R.FUSED),
    (Facts(recorded=True, block_reducer=True, fused_reducer=True, kernel=False), R.BLOCKS),  # no GPU
    (Facts(recorded=True, block_reducer=True, fused_reducer=False, kernel=True), R.BLOCKS),  # a region's crop
    (Facts(recorded=True, block_reducer=True, fused_reducer=True, kernel=True, batch_one=False), R.BLOCKS),
    (Facts(recorded=True, block_reducer=True, fused_reducer=True, kernel=True, stablemask=True), R.BLOCKS),
    (Facts(recorded=True, block_reducer=True, fused_reducer=True, kernel=True, reshapes=True), R.BLOCKS),
    (Facts(recorded=True, block_reducer=True, fused_reducer=True, kernel=True, grad=True), R.BLOCKS),
    (Facts(recorded=True, block_reducer=True, fused_reducer=True, kernel=True, position_bias=True), R.BLOCKS),
    # per-head masks: the kernel reads one allow-set for every head
    (Facts(recorded=True, block_reducer=True, fused_reducer=True, kernel=True, head_mask=True), R.BLOCKS),
    (Facts(recorded=False, block_reducer=True, fused_reducer=True, kernel=True), R.SDPA_MASKED),
])
def test_route_table(facts, route):
    assert choose_route(facts) is route


def test_reducers_follow_one_protocol():
    from attnviz.regions import _Crop

    assert issubclass(reduce.Summaries, reduce.FusedReducer) and issubclass(_Crop, reduce.BlockReducer)
    assert not issubclass(_Crop, reduce.FusedReducer)
    for path in (ROOT / "attnviz" / "core" / "engine").glob("*.py"):  # the engine reads no reducer's attributes
        source = path.read_text()
        assert "hasattr(run.reducer" not in source and "getattr(run.reducer" not in source, path.name


def test_every_declared_statistic_is_computed_and_equals_its_reference():
    gen = torch.Generator().manual_seed(0)
    n, heads = 7, 3
    allowed = np.tril(np.ones((n, n), dtype=bool))
    allowed[2:, 0] = False  # NoSink-like: alpha_0 undefined, key 0 column masked
    scores = torch.randn(heads, n, n, generator=gen).masked_fill(~torch.from_numpy(allowed), float("-inf"))
    probs = torch.softmax(scores, -1).numpy() * 0.9  # rows lose mass (a learned sink)
    tokens = ["<s>", "a", ",", "b", ".", "c", "\n"]
    got = reduce.summarise(probs, allowed, tokens)
    assert list(got) == [s.name for s in metrics.STATISTICS]
    for stat in metrics.STATISTICS:
        np.testing.assert_allclose(got[stat.name], stat.reference(probs, allowed, tokens), rtol=1e-5, atol=1e-6,
                                   equal_nan=True, err_msg=stat.name)
        assert got[stat.name].size == heads * n * stat.floats, stat.name
    # the memory estimate's share is what the declarations say, and what every statistic really takes
    assert metrics.statistic_floats() * heads * n == sum(got[s.name].size for s in metrics.STATISTICS)


def test_no_import_cycle_between_the_reference_and_the_reducers():
    tree = ast.parse((ROOT / "attnviz" / "stats" / "metrics.py").read_text())
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names} | {
        node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any("reduce" in name or "engine" in name for name in imported), imported


def test_a_capture_keeps_only_the_statistics_it_names():
    from attnviz.capture import capture
    from attnviz.plan import Keep
    from attnviz.errors import AttnvizError

    from tiny import loaded

    lm = loaded("llama")
    text = "The keeper lit the lamp, and the ships passed the rocks."
    full = capture(lm, text, "nosink-fwd", Keep(statistics=True))
    some = capture(lm, text, "nosink-fwd", Keep(statistics=("alpha", "column_mean", "discarded")))
    assert set(full.stats[1]) == {s.name for s in metrics.STATISTICS}
    assert set(some.stats[1]) == {"alpha", "column_mean", "key0", "discarded"}
    for name in some.stats[1]:
        np.testing.assert_array_equal(some.stats[1][name], full.stats[1][name])
    with pytest.raises(AttnvizError, match="not entropy"):
        some.stat(1, "entropy")
    with pytest.raises(AttnvizError, match="unknown statistics 'beta'"):  # refused by the keep, before any run
        capture(lm, text, "fwd", Keep(statistics=("alpha", "beta")))


@pytest.mark.parametrize("facts,route", [
    # a large allow-set, every recorder streamed: made a block of rows at a time
    (Facts(recorded=True, block_reducer=True, large_allow=True, streamed=True), R.ROWWISE),
    (Facts(recorded=True, block_reducer=True, large_allow=False, streamed=True), R.BLOCKS),  # made whole, shared
    (Facts(recorded=True, large_allow=True, streamed=False), R.BLOCKS),  # full scores keep every key
    (Facts(recorded=True, large_allow=True, streamed=True, stablemask=True), R.BLOCKS),
    (Facts(recorded=True, large_allow=True, streamed=True, head_mask=True), R.BLOCKS),
    (Facts(recorded=True, large_allow=True, streamed=True, keep_graph=True), R.BLOCKS),
    (Facts(recorded=True, large_allow=True, streamed=True, grad=True), R.BLOCKS),
    (Facts(recorded=False, large_allow=True, streamed=True), R.SDPA_MASKED),
    # the fused route comes first where it can run
    (Facts(recorded=True, block_reducer=True, fused_reducer=True, kernel=True, large_allow=True, streamed=True),
     R.FUSED),
])
def test_rows_at_a_time_is_a_route_of_the_table(facts, route):
    assert choose_route(facts) is route


def test_recorders_own_their_results_and_the_run_keeps_no_store():
    """The run reads each kind of result from the recorders that own it: no per-kind store on the run, and two runs
    never share a recorder (the residual variants' live probabilities are the run's own)."""
    import dataclasses

    from attnviz.core import engine
    from attnviz.core.record import recorders
    from attnviz.core.spec.arch import parse
    from tiny import build

    fields = {f.name for f in dataclasses.fields(engine.Run)}
    assert not fields & {"probs", "scores", "reduced", "value_norms", "qkv", "live"}
    model = build("llama")
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    masks = list(parse("fwd", 3).layers)
    _, run = engine.forward(model, ids, masks, engine.Record(layers=frozenset({1}), value_norms=True, qkv=True,
                                                             storage_dtype=torch.float32))
    maps = next(r for r in run.recorders if isinstance(r, recorders.Maps))
    assert run.probs is maps.results and set(run.probs) == {1} and set(run.value_norms) == set(run.qkv) == {1}
    _, other = engine.forward(model, ids, masks, engine.Record(layers=frozenset({2}), storage_dtype=torch.float32))
    assert set(other.probs) == {2} and set(run.probs) == {1} and run._live is not other._live
