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

import tiny

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
    # training under a sink logit (gpt-oss's learned one, sink(logit=0)): SDPA's output times sigma(lse - s)
    (Facts(sink_logits=True, grad=True), R.SDPA_SINK),
    (Facts(sink_logits=True, grad=True, plain_causal=True), R.SDPA_SINK),
    (Facts(sink_logits=True, grad=False, plain_causal=True), R.BLOCKS),  # a capture's unrecorded layers: unchanged
    (Facts(sink_logits=True, grad=True, recorded=True), R.BLOCKS),  # a recorded layer keeps its weights
    (Facts(sink_logits=True, grad=True, keep_graph=True), R.BLOCKS),
    (Facts(sink_logits=True, grad=True, stablemask=True), R.BLOCKS),
    (Facts(sink_logits=True, grad=True, reshapes=True), R.BLOCKS),  # sinklogit, temperature ...
    (Facts(sink_logits=True, grad=True, head_mask=True), R.BLOCKS),
    (Facts(sink_logits=True, grad=True, softcap=True), R.BLOCKS),
    (Facts(sink_logits=True, grad=True, position_bias=True), R.BLOCKS),
    (Facts(grad=True, plain_causal=True), R.SDPA_CAUSAL),  # the softmax's training
    (Facts(grad=True, plain_causal=True, reshapes=True), R.BLOCKS),  # softpick, sigmoid
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


def _explicit_sink(q, k, v, s, allow, scaling):
    """The definition written out: the sink logit s (H,) one more column of the softmax, dropped after it."""
    z = torch.matmul(q * scaling, k.transpose(-1, -2)).masked_fill(~allow, float("-inf"))
    z = torch.cat([z, s.reshape(1, -1, 1, 1).expand(*z.shape[:-1], 1)], dim=-1)
    return torch.matmul(torch.softmax(z, dim=-1)[..., :-1], v)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["flash-backward", "sdpa-and-scores"])
def test_sink_attention_and_its_gradients_are_the_explicit_softmax_s(causal, cpu_kernel, monkeypatch):
    """SDPA's output times sigma(lse - s) is the softmax with a sink column, and so are its gradients for q, k, v and
    a learned s, in float64: the CPU's flash backward with lse's gradient folded in, and the plain way (SDPA, lse from
    the scores) that other devices take; a window-like mask with GQA besides the causal one."""
    from attnviz.core.kernel import lse

    if not cpu_kernel:  # the way another device takes: SDPA's output, lse from the scores
        monkeypatch.setattr(lse._SinkAttention, "apply", lambda *a: (_ for _ in ()).throw(RuntimeError("no")))
    gen = torch.Generator().manual_seed(0)
    b, h, kv, n, d = 2, 4, 4 if causal else 2, 9, 8
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, kv, n, d, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    s = torch.randn(h, generator=gen, dtype=torch.float64, requires_grad=True)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allow = (j <= i) if causal else ((i - j).abs() < 3) | (j == 0)
    allow = allow[None, None].expand(b, 1, n, n)
    got = lse.sink_attention(q, k, v, s, None if causal else allow, 0.3, causal)
    assert (type(got.grad_fn).__name__ == "_SinkAttentionBackward") == cpu_kernel  # the way asked was taken
    want = _explicit_sink(q, k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1), s, allow, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    weight = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    for a, e in zip(torch.autograd.grad((got * weight).sum(), (q, k, v, s)),
                    torch.autograd.grad((want * weight).sum(), (q, k, v, s))):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["sink", "sink(logit=0)"])
def test_training_under_a_sink_takes_the_sink_route_with_the_block_route_s_gradients(kind, monkeypatch):
    """A lab model's training forward through the recipe (gpt-oss's learned sinks, off-by-one) takes the sink route,
    and its loss and every parameter's gradient, the learned sinks' included, are the block route's (float32, 1e-6);
    a capture of the same model still takes the block route."""
    from attnviz.core import engine
    from attnviz.core.engine import routes
    from attnviz.lab import train as lab

    model, loaded, built, x = tiny.lab_training(kind)
    taken, real = [], routes.choose_route
    monkeypatch.setattr(routes, "choose_route", lambda facts: taken.append(real(facts)) or taken[-1])

    def gradients(forced=None):
        if forced is not None:
            monkeypatch.setattr(routes, "choose_route", lambda facts: taken.append(forced) or forced)
        model.zero_grad(set_to_none=True)
        loss = lab.loss_of(built, loaded, x)
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    loss, grads = gradients()
    assert taken == [routes.Route.SDPA_SINK]
    block_loss, block_grads = gradients(routes.Route.BLOCKS)
    torch.testing.assert_close(loss, block_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == block_grads.keys() and ("model.layers.0.self_attn.sinks" in grads) == (kind == "sink")
    for name in grads:
        torch.testing.assert_close(grads[name], block_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    monkeypatch.setattr(routes, "choose_route", lambda facts: taken.append(real(facts)) or taken[-1])
    with torch.no_grad():
        built.forward(loaded, x, record=engine.Record.every_layer(storage_dtype=torch.float32))
    assert taken[-1] is routes.Route.BLOCKS


def test_an_unrecorded_block_layer_under_the_causal_mask_reads_arithmetic_ranges_and_computes_the_same(monkeypatch):
    """A layer nobody records under a plain causal mask (training under softpick) takes the block route with an
    arithmetic allow-set: its key ranges are those read from the whole allow-set, and its output is bit for bit the
    one the whole allow-set gives (a recorded forward of the same tokens), with a query block split in three."""
    from attnviz.core import engine
    from attnviz.core.spec.allowsets import AllowSet, AllowSets
    from attnviz.core.spec.arch import parse
    from attnviz.core.spec.kinds import parse as kind
    from tiny import build

    made = lambda q0, q1: torch.ones(2, 1, 7, 9, dtype=torch.bool).tril(2)[:, :, q0:q1]  # noqa: E731
    causal, whole = AllowSet("causal", (2, 1, 7, 9), "cpu", made), AllowSet("whole", (2, 1, 7, 9), "cpu", made)
    for rows in (1, 3, 7):
        assert causal.ranges(rows) == whole.ranges(rows)
        for q0 in range(0, 7, rows):
            assert torch.equal(causal.rows(q0, min(q0 + rows, 7)).expand(2, -1, -1, -1), whole.rows(q0, q0 + rows))
    model = build("llama")
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    computes = engine.Computes(tuple(parse("fwd", 3).layers), kind=kind("softpick"))
    small = dict(block_bytes=4 * 2 * 4 * 12 * 5)  # blocks of 5 query rows
    kinds, real = [], AllowSets.allow_set
    monkeypatch.setattr(AllowSets, "allow_set", lambda self, *a, **k: kinds.append(a[5]) or real(self, *a, **k))
    plain, _ = engine.forward(model, ids, computes, engine.Record.nothing(**small))
    assert kinds == ["causal"] * 3
    kept, _ = engine.forward(model, ids, computes, engine.Record.every_layer(storage_dtype=torch.float32, **small))
    assert kinds[3:] == ["whole"] * 3 and torch.equal(plain.logits, kept.logits)
