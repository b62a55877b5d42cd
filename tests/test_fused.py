"""The fused statistics kernel (attnviz.core.kernel.kernels) in Triton's interpreter on the CPU:
its sums against the definitions computed from the full probabilities, and a whole capture by the
fused route against the block engine and docs/methods.md#sink-metrics."""

import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # conftest.py sets it on a machine without a GPU
    pytest.skip("the kernel runs compiled on this GPU machine: tests/test_cuda.py checks it there",
                allow_module_level=True)

from attnviz.core.spec import allowsets
from attnviz.core import engine  # noqa: E402
from attnviz.core.kernel import kernels
from attnviz.core.kernel.lse import attention_with_lse
from attnviz.stats import metrics
from attnviz.core.spec.arch import parse  # noqa: E402
from attnviz.capture import capture  # noqa: E402
from attnviz.plan import Keep
from attnviz.errors import InputError
from attnviz.settings import Settings
from attnviz.figures.style import max_pool  # noqa: E402
from attnviz.core.spec.masks import keep_self_if_empty  # noqa: E402
from attnviz.core.record.reduce import pool_factor  # noqa: E402

from tiny import loaded  # noqa: E402

N, H, H_KV, D = 75, 4, 2, 8
TEXT = "The quick brown fox jumps over the lazy dog, again. " * 4  # 208 tokens, one per character
SPECS = ["fwd", "back", "bidir", "nosink-fwd(m=2)", "sliding(w=9)", "global(w=5, g=2)"]


def _reference(spec, seed=0, dtype=torch.float32):
    """Random q and k in ``dtype``, the mask's allow-set, and the scores and probabilities of those very values."""
    torch.manual_seed(seed)
    q, k = torch.randn(H, N, D).to(dtype), torch.randn(H_KV, N, D).to(dtype)
    pos = torch.arange(N)
    mask = parse(spec, 1).layers[0]
    allow = keep_self_if_empty(mask.allow(pos[:, None], pos[None, :]))
    scores = (q.float() @ k.float().repeat_interleave(H // H_KV, 0).transpose(-1, -2)) * D ** -0.5
    probs = torch.softmax(scores.masked_fill(~allow, float("-inf")), -1)
    return q, k, allow, scores, probs


@pytest.mark.parametrize("spec", SPECS)
def test_kernel_sums_equal_the_full_probabilities(spec):
    q, k, allow, scores, probs = _reference(spec)
    delim = torch.from_numpy((np.arange(N) % 7 == 3).astype(np.float32))
    norms = torch.rand(H, N) + 0.5
    f = pool_factor(N, 9)  # ceil(75 / 9) = 9 → 16: a multiple of the 16-cell granularity
    shape = (-(-N // f), -(-N // f))
    ranges = allowsets._block_ranges(allow[None, None], 32)
    raw = kernels.layer_statistics(q, k, allow, ranges, D ** -0.5, delim, f, shape, norms, scores=True, block=(32, 32))
    _assert_definitions(raw, probs, scores, allow, delim, norms, 9, f)


def _assert_definitions(raw, probs, scores, allow, delim, norms, pool, factor):
    """Every sum and pooled map of the kernel against its definition from the full probabilities."""
    p = probs.double()
    expected = {"rowsum": p.sum(-1), "plogp": torch.special.xlogy(p, p).sum(-1), "colsum": p.sum(1),
                "diag": torch.diagonal(p, dim1=-2, dim2=-1), "key0": p[:, :, 0], "delim": p @ delim.double()}
    for name, value in expected.items():
        torch.testing.assert_close(raw[name].double(), value, atol=2e-6, rtol=1e-5, msg=name)
    grid = allow.numpy()
    for name, full in (("pooled", probs), ("pooled_value", probs * norms[:, None, :]), ("pooled_scores", scores)):
        ref = np.stack([max_pool(np.where(grid, m, np.nan), pool, factor=factor) for m in full.numpy()])
        seen = ~np.isnan(ref)
        np.testing.assert_allclose(raw[name].numpy()[seen], ref[seen], atol=1e-6, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("spec", ["fwd", "bidir", "sliding(w=9)", "global(w=5, g=2)"])
def test_one_pass_with_the_forwards_log_sum_exp_gives_the_two_pass_sums(spec):
    """Given every row's log-sum-exp (the attention kernel's, attention_with_lse), the kernel passes over QK^T
    once and its sums equal the two-pass kernel's and the definitions'; the attention output is SDPA's."""
    q, k, allow, scores, probs = _reference(spec)
    v = torch.randn(H_KV, N, D)
    causal = spec == "fwd"
    out, lse = attention_with_lse(q[None], k[None], v[None], None if causal else allow[None, None],
                                          D ** -0.5, causal)
    torch.testing.assert_close(lse[0], torch.logsumexp(scores.masked_fill(~allow, float("-inf")), -1),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0], probs @ v.repeat_interleave(H // H_KV, 0), atol=1e-5, rtol=1e-5)
    delim = torch.from_numpy((np.arange(N) % 7 == 3).astype(np.float32))
    f = pool_factor(N, 9)
    options = dict(pool_factor=f, pooled_shape=(-(-N // f), -(-N // f)), norms=torch.rand(H, N) + 0.5, scores=True,
                   block=(32, 32), causal=causal)
    ranges = allowsets._block_ranges(allow[None, None], 32)
    mask = None if causal else allow
    two = kernels.layer_statistics(q, k, mask, ranges, D ** -0.5, delim, **options)
    one = kernels.layer_statistics(q, k, mask, ranges, D ** -0.5, delim, lse=lse[0], **options)
    for name in two:
        torch.testing.assert_close(one[name], two[name], atol=2e-6, rtol=1e-5, msg=name)
    torch.testing.assert_close(one["colsum"].double(), probs.double().sum(1), atol=2e-6, rtol=1e-5)
    shifted = kernels.layer_statistics(q, k, mask, ranges, D ** -0.5, delim, lse=lse[0] + 1.0, **options)
    torch.testing.assert_close(shifted["rowsum"], torch.full((H, N), float(np.exp(-1.0))), atol=1e-5, rtol=1e-5)


def test_pack_allow_puts_key_j_in_bit_j_mod_32_of_word_j_div_32():
    torch.manual_seed(1)
    allow = torch.rand(5, 70) < 0.5
    allow[:, 31] = allow[:, 63] = True  # the sign bits
    words = kernels.pack_allow(allow)
    assert words.dtype == torch.int32 and words.shape == (5, 3)
    unpacked = [[bool((int(words[i, j // 32]) >> (j % 32)) & 1) for j in range(96)] for i in range(5)]
    assert unpacked == [row + [False] * 26 for row in allow.tolist()]


def test_the_causal_route_computes_the_mask_from_indices():
    """A plain causal layer passes no allow matrix (n x n bytes at 32k tokens: 1 GB, read per head):
    the kernel's index test gives the same sums as the allow matrix, bit for bit."""
    q, k, allow, scores, probs = _reference("fwd")
    delim = torch.from_numpy((np.arange(N) % 5 == 1).astype(np.float32))
    f = pool_factor(N, 9)
    shape = (-(-N // f), -(-N // f))
    ranges = allowsets._block_ranges(allow[None, None], 32)
    options = dict(pool_factor=f, pooled_shape=shape, norms=torch.rand(H, N) + 0.5, scores=True, block=(32, 32))
    read = kernels.layer_statistics(q, k, allow, ranges, D ** -0.5, delim, **options)
    computed = kernels.layer_statistics(q, k, None, ranges, D ** -0.5, delim, causal=True, **options)
    assert read.keys() == computed.keys()
    for name in read:
        torch.testing.assert_close(computed[name], read[name], atol=0, rtol=0, msg=name)
    torch.testing.assert_close(computed["rowsum"], torch.ones(H, N), atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="square"):
        kernels.layer_statistics(q[:, 1:], k, None, ranges, D ** -0.5, delim, causal=True)


@pytest.mark.parametrize("spec", ["fwd", "nosink-fwd*2 + bidir", "back*3", "sliding(w=9)*3", "mask0-bidir(k=1)"])
def test_a_capture_by_the_fused_route_equals_the_block_engine(spec, monkeypatch, use_settings):
    lm = loaded("llama")
    keep = Keep(statistics=True, pool=24, value_norms=True, scores=True)
    use_settings(fused=False)
    blocks = capture(lm, TEXT, spec, keep)
    calls = []
    real = kernels.layer_statistics
    monkeypatch.setattr(kernels, "layer_statistics",
                        lambda *a, **k: calls.append((k["causal"], k["lse"] is not None)) or real(*a, **k))
    use_settings(fused=True)
    fused = capture(lm, TEXT, spec, keep)
    assert len(calls) == 3  # every layer took the fused route
    assert [c for c, _ in calls] == [m.name == "fwd" for m in parse(spec, 3).layers]  # plain causal: mask from indices
    assert all(lse for _, lse in calls)  # one pass over QK^T: the attention kernel gave every row's log-sum-exp
    np.testing.assert_allclose(fused.next_logprobs, blocks.next_logprobs, atol=1e-5)
    for layer in range(3):
        for name, value in blocks.stats[layer].items():  # pooled maps are kept in fp16: one ulp apart at most
            np.testing.assert_allclose(fused.stats[layer][name].astype(np.float32), value.astype(np.float32),
                                       atol=2e-5, rtol=1e-3 if name.startswith("pooled") else 1e-4, equal_nan=True,
                                       err_msg=f"{name} L{layer}")
    full = capture(lm, TEXT, spec, Keep(storage_dtype=torch.float32))
    for layer in range(3):  # and the definitions themselves (docs/methods.md#sink-metrics)
        a, allowed = full.layer_probs(layer), full.allowed[layer]
        np.testing.assert_allclose(fused.stats[layer]["alpha"], metrics.alpha(a, allowed), atol=1e-5, equal_nan=True)
        np.testing.assert_allclose(fused.stats[layer]["entropy"], metrics.entropy(a, allowed, normalised=True),
                                   atol=1e-5)
        np.testing.assert_allclose(fused.stats[layer]["allocation"], metrics.allocation(a, full.tokens), atol=1e-5)


@pytest.mark.parametrize("spec", ["fwd", "nosink-fwd*2 + bidir"])
def test_fused_layers_finished_together_equal_each_finished_alone(spec, monkeypatch, use_settings):
    """Fused layers' sums wait and are finished together (one set of operations for the group, stacked over the
    layers, each mask's layers apart); finishing each layer alone (a group of one byte) gives the same arrays."""
    from attnviz.core.record import reduce

    lm = loaded("llama")
    keep = Keep(statistics=True, pool=24, value_norms=True, scores=True)
    use_settings(fused=True)
    finished = []
    real = reduce.FusedLayers.finish
    monkeypatch.setattr(reduce.FusedLayers, "finish", lambda self: finished.append(len(self.layers)) or real(self))
    together = capture(lm, TEXT, spec, keep)
    assert finished[0] == 3  # one group: every layer (later calls find it finished)
    monkeypatch.setattr(reduce, "GROUP_BYTES", 1)
    finished.clear()
    alone = capture(lm, TEXT, spec, keep)
    assert finished[:3] == [1, 1, 1]
    for layer in range(3):
        assert together.stats[layer].keys() == alone.stats[layer].keys()
        for name, value in alone.stats[layer].items():
            np.testing.assert_array_equal(together.stats[layer][name], value, err_msg=f"{name} L{layer}")
    assert not np.array_equal(together.stats[0]["alpha"], together.stats[2]["alpha"], equal_nan=True)


def test_masks_the_kernel_cannot_express_keep_the_block_engine(monkeypatch, use_settings):
    use_settings(fused=True)
    calls = []
    real = kernels.layer_statistics
    monkeypatch.setattr(kernels, "layer_statistics", lambda *a, **k: calls.append(1) or real(*a, **k))
    cap = capture(loaded("llama"), TEXT, "stablemask(gamma=0.5)", Keep(statistics=True, pool=24))
    assert calls == [] and cap.stats[0]["discarded"].max() > 0  # pseudo-slots took mass: the block engine ran


def test_pool_factor_rounding():
    assert [pool_factor(n, 512) for n in (100, 512, 513, 2000, 4096, 8192, 8193, 30000, 32768)] == \
        [1, 1, 2, 4, 8, 16, 32, 64, 64]
    for n in (513, 8193, 30000, 32768, 100000):
        f = pool_factor(n, 512)
        assert 256 <= -(-n // f) <= 512 and f % kernels.granularity(f) == 0 and 64 % kernels.granularity(f) == 0


def test_a_kernel_that_fails_falls_back_to_the_block_engine_in_that_run_only(monkeypatch, caplog, use_settings):
    """A Triton or driver the kernel was never tried with must not break captures: the layer is computed by the
    block engine, said on the log and in the capture (with the reason), and the route is off for that device and
    shape in that run only: it is tried once a run, and the next capture (another visitor's on a shared server)
    takes the kernel again."""
    lm = loaded("llama")
    use_settings(fused=False)
    blocks = capture(lm, TEXT, "fwd", Keep(statistics=True, pool=24))
    use_settings(fused=True)
    real, launched = kernels.layer_statistics, []

    def broken(*args, **kwargs):
        launched.append(tuple(args[0].shape))
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(kernels, "layer_statistics", broken)
    with caplog.at_level("WARNING"):
        fell_back = capture(lm, TEXT, "fwd", Keep(statistics=True, pool=24))
    assert "PTX assembly failed" in caplog.text
    assert len(launched) == 1  # one shape on one device: tried once in the run, then the block engine
    (reason,) = fell_back.meta["fused_fallback"]
    assert reason.startswith("cpu float32 (1, 4, ") and reason.endswith("RuntimeError: PTX assembly failed"), reason
    assert kernels.wanted(torch.device("cpu"))  # nothing switched off for the process
    for layer in range(3):
        np.testing.assert_allclose(fell_back.stats[layer]["alpha"], blocks.stats[layer]["alpha"], atol=1e-6,
                                   equal_nan=True)
    monkeypatch.setattr(kernels, "layer_statistics",
                        lambda *a, **k: launched.append(tuple(a[0].shape)) or real(*a, **k))
    launched.clear()
    again = capture(lm, TEXT, "fwd", Keep(statistics=True, pool=24))
    assert len(launched) == 3 and "fused_fallback" not in again.meta  # the next run takes the kernel, every layer


def test_a_failed_launch_leaves_the_route_on_for_another_shape(monkeypatch, use_settings):
    """A launch that fails for one shape (a GPU that refuses long layers, simulated by failing the launch whenever
    the queries are longer than a short text's) switches the route off for that shape, in that run: right after it,
    a capture of another shape on the same device takes the kernel on every layer, as it did before."""
    from attnviz.core.engine import routes

    lm = loaded("llama")
    use_settings(fused=True)
    real, launched = kernels.layer_statistics, []
    short, long_ = "The cat sat.", TEXT
    limit = len(lm.tokenizer(short)["input_ids"])
    assert limit < len(lm.tokenizer(long_)["input_ids"])

    def fails_for_long(query, *args, **kwargs):
        launched.append(query.shape[1])
        if query.shape[1] > limit:
            raise RuntimeError("too long for this GPU")
        return real(query, *args, **kwargs)

    monkeypatch.setattr(kernels, "layer_statistics", fails_for_long)
    run_of = {}
    real_route = routes.choose_route
    monkeypatch.setattr(routes, "choose_route", lambda facts: run_of.setdefault("facts", []).append(facts)
                        or real_route(facts))
    long_cap = capture(lm, long_, "fwd", Keep(statistics=True))
    assert len(long_cap.meta["fused_fallback"]) == 1
    assert [f.kernel for f in run_of["facts"]] == [True, False, False]  # tried once, then off for that shape
    launched.clear()
    run_of.clear()
    short_cap = capture(lm, short, "fwd", Keep(statistics=True))
    assert "fused_fallback" not in short_cap.meta and len(launched) == 3
    assert [f.kernel for f in run_of["facts"]] == [True, True, True]


class _Largest(torch.utils._python_dispatch.TorchDispatchMode):
    """Every tensor an operation makes inside, by element count."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made.append((t.numel(), str(func)))
        return out


@pytest.mark.parametrize("pool", [None, 24])
def test_a_causal_statistics_capture_makes_nothing_of_n_squared_elements(pool, monkeypatch, use_settings):
    """The fused route under the plain causal mask: the counts of allowed keys per row and per column, the
    diagonal and the pooled grid of seen cells are arithmetic (reduce.Layout.causal), the key ranges too, and
    SDPA runs is_causal, so no tensor of n_q × n_kv elements exists on the device (it was 8 GB of int64 sums
    and a 1 GB allow-set per layer at 32,768 tokens). The statistics stay the block engine's."""
    use_settings(fused=True)
    lm = loaded("llama")
    n = len(lm.tokenizer(TEXT)["input_ids"])
    with _Largest() as seen:
        fused = capture(lm, TEXT, "fwd", Keep(statistics=True, pool=pool))
    assert "fused_fallback" not in fused.meta  # the kernel ran
    biggest = max(seen.made)
    assert biggest[0] < n * n, f"{biggest[1]} made {biggest[0]} elements, n² = {n * n}"
    use_settings(fused=False)
    blocks = capture(lm, TEXT, "fwd", Keep(statistics=True, pool=pool))
    for layer in fused.layers:
        for name, value in blocks.stats[layer].items():
            np.testing.assert_allclose(np.asarray(fused.stats[layer][name], np.float32),
                                       np.asarray(value, np.float32), atol=1e-4, equal_nan=True, err_msg=name)
    np.testing.assert_array_equal(fused.allowed[0], np.tri(n, dtype=bool))


@pytest.mark.parametrize("spec", ["nosink-fwd(m=2)*3", "bidir*3", "sliding(w=9)*3", "mask0-bidir(k=1)"])
@pytest.mark.parametrize("pool", [None, 24])
def test_the_block_route_makes_each_blocks_allow_set_alone(spec, pool, monkeypatch, use_settings):
    """Any mask on the block route (the CPU's statistics route): each block of query rows gets its own rows of the
    allow-set, so no tensor of n_q × n_kv elements exists during a statistics capture (before, one whole allow-set
    per mask); the host's copy the capture keeps is made a chunk of rows at a time. Statistics, pooled maps and the
    kept allow-set equal the whole-allow-set route's (full maps, which keep it whole)."""
    from attnviz.core.record import reduce

    use_settings(fused=False)
    monkeypatch.setattr(allowsets, "CHUNK_ELEMENTS", 256)
    use_settings(whole_allow_mb=0)  # as for a text whose allow-set is over 256 MB
    lm = loaded("llama")
    n = len(lm.tokenizer(TEXT)["input_ids"])
    keep = Keep(statistics=True, pool=pool, block_bytes=4 * 4 * n * 7)  # several blocks a layer
    with _Largest() as seen:
        stats = capture(lm, TEXT, spec, keep)
    biggest = max(seen.made)
    assert biggest[0] < n * n, f"{biggest[1]} made {biggest[0]} elements, n² = {n * n}"
    full = capture(lm, TEXT, spec, Keep(storage_dtype=torch.float32))
    for layer in full.layers:
        np.testing.assert_array_equal(stats.allowed[layer], full.allowed[layer])
        for name, value in stats.stats[layer].items():
            if name.startswith("pool"):
                continue
            np.testing.assert_allclose(np.asarray(value, np.float32), np.asarray(full.stat(layer, name), np.float32),
                                       atol=1e-5, equal_nan=True, err_msg=f"{spec} {name}")


@pytest.mark.parametrize("spec", ["nosink-fwd(m=2)", "back", "sliding(w=9)", "global(w=5, g=2)"])
def test_a_masks_layout_counted_by_chunks_equals_its_sums(spec, monkeypatch):
    """Any other mask's counts come from its allow-set a chunk of rows at a time, never as one n × n temporary."""
    from attnviz.core.record import reduce

    monkeypatch.setattr(allowsets, "CHUNK_ELEMENTS", 5 * 75)  # five rows a chunk
    allow = _reference(spec)[2]
    layout = reduce.Layout.of(allow)
    torch.testing.assert_close(layout.col_counts, allow.sum(0).float())
    torch.testing.assert_close(layout.row_counts, allow.sum(-1).float())
    assert torch.equal(layout.diagonal, torch.diagonal(allow)) and torch.equal(layout.key0, allow[:, 0])
    for f in (1, 4, 16):
        expected = torch.from_numpy(~np.isnan(max_pool(np.where(allow.numpy(), 1.0, np.nan), 512, factor=f)))
        assert torch.equal(layout.seen(f), expected), f
    causal = reduce.Layout.causal(75, "cpu")
    tri = torch.ones(75, 75, dtype=torch.bool).tril()
    torch.testing.assert_close(causal.col_counts, tri.sum(0).float())
    torch.testing.assert_close(causal.row_counts, tri.sum(-1).float())
    for f in (1, 4, 16):
        expected = torch.from_numpy(~np.isnan(max_pool(np.where(tri.numpy(), 1.0, np.nan), 512, factor=f)))
        assert torch.equal(causal.seen(f), expected), f


def test_a_statistic_the_kernel_does_not_compute_takes_the_block_engine_never_a_zero(monkeypatch, use_settings):
    """Adding a statistic is one declaration: a new per-query sum (the largest probability of each row) that
    the fused kernel does not compute sends the capture to the block engine, which finishes it from its
    declaration; the plan says so; nothing comes back as a zero-filled buffer."""
    from attnviz import plan
    from attnviz.stats.metrics import RowSum, Statistic

    peak = Statistic("peak", 1, lambda p, a, t: np.asarray(p, np.float32).max(-1),
                     (RowSum("rowmax", lambda probs, allow: probs.amax(-1)),), lambda s, xp: s["rowmax"])
    monkeypatch.setattr(metrics, "STATISTICS", metrics.STATISTICS + (peak,))
    use_settings(fused=True)
    calls = []
    real = kernels.layer_statistics
    monkeypatch.setattr(kernels, "layer_statistics", lambda *a, **k: calls.append(1) or real(*a, **k))
    lm = loaded("llama")
    cap = capture(lm, TEXT, "fwd", Keep(statistics=True, pool=24))
    assert calls == []  # the block engine ran
    full = capture(lm, TEXT, "fwd", Keep(storage_dtype=torch.float32))
    for layer in cap.layers:
        np.testing.assert_allclose(cap.stats[layer]["peak"], full.layer_probs(layer).max(-1), atol=1e-6)
        assert cap.stats[layer]["peak"].min() > 0
    assert any("peak needs rowmax" in note and "block engine" in note for note in plan.route_notes())
    monkeypatch.setattr(metrics, "STATISTICS", metrics.STATISTICS[:-1])
    assert plan.route_notes() == ()
    capture(lm, TEXT, "fwd", Keep(statistics=True, pool=24))
    assert calls  # without it, the fused route again


@pytest.mark.parametrize("f, groups", [(32, 1), (64, 1), (64, 2)], ids=["f32", "f64", "f64-2groups"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "packed"])
@pytest.mark.parametrize("one_pass", [True, False], ids=["lse", "two-pass"])
def test_full_tiles_and_one_cell_tiles_equal_the_definitions(causal, one_pass, f, groups, monkeypatch, use_settings):
    """Tiles of 32 x 32 over 75 causal keys in float16 (a float32 kernel masks every tile): rows 32-63 have a
    full tile below the diagonal (key 0's), rows 64-74 are a partial block that masks every tile; a pooling
    factor of 32 puts each tile in one cell (one maximum a tile), a factor of 64 two tiles a cell side (the cell
    found without an integer division), and two row groups send two maxima a tile. Every sum and every map (the
    probabilities', A·‖W_O v‖'s, the scores') equals the definitions, through either kind of tile."""
    q, k, allow, scores, probs = _reference("fwd", seed=3, dtype=torch.float16)
    delim = torch.from_numpy((np.arange(N) % 6 == 2).astype(np.float32))
    norms = torch.rand(H, N) + 0.5
    cells = -(-N // f)
    lse = torch.logsumexp(scores.masked_fill(~allow, float("-inf")), -1) if one_pass else None
    use_settings(kernel_groups=groups)
    launched = []
    constants = kernels.constants
    monkeypatch.setattr(kernels, "constants", lambda *a: launched.append(constants(*a)) or launched[-1])
    raw = kernels.layer_statistics(q, k, None if causal else allow, allowsets._block_ranges(allow[None, None], 32),
                                   D ** -0.5, delim, f, (cells, cells), norms, scores=True, block=(32, 32),
                                   causal=causal, lse=lse)
    # tf32: full tiles on
    assert [(c["WHOLE"], c["PRECISION"], c["SPLIT"]) for c in launched] == [(True, "tf32", groups)]
    _assert_definitions(raw, probs, scores, allow, delim, norms, cells, f)


def test_a_row_with_no_key_gives_zeros_not_nan():
    """A packed mask whose row 5 allows nothing, with the attention kernel's log-sum-exp of -inf there:
    every sum of that row is 0, and the other rows are untouched."""
    q, k, allow, scores, probs = _reference("bidir", seed=4)
    allow[5] = False
    lse = torch.logsumexp(scores.masked_fill(~allow, float("-inf")), -1)
    assert torch.isinf(lse[:, 5]).all()
    raw = kernels.layer_statistics(q, k, allow, allowsets._block_ranges(allow[None, None], 32), D ** -0.5,
                                   torch.zeros(N), block=(32, 32), lse=lse)
    for name in ("rowsum", "plogp", "diag", "key0", "delim"):
        assert torch.isfinite(raw[name]).all() and (raw[name][:, 5] == 0).all(), name
    torch.testing.assert_close(raw["rowsum"][:, :5], torch.ones(H, 5), atol=2e-6, rtol=0)


@pytest.mark.parametrize("tile", [(64, 64), (128, 64), (64, 128)], ids=["64x64", "128x64", "64x128"])
@pytest.mark.parametrize("one_pass", [True, False], ids=["lse", "two-pass"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "packed"])
def test_the_launch_geometry_in_half_precision_gives_the_definitions(causal, one_pass, tile):
    """The kernel's 64 x 64 tiles (and the larger ones a GPU's measured launch may take: a tile then spans two
    pooled cells), float16 inputs and head dim 128 over 600 keys: full tiles below the diagonal, a partial last
    block, each 64 x 64 tile pooled to one cell (a factor of 64, as at 32,768 tokens on a 512-cell map), with the attention kernel's log-sum-exp (what a GPU launches) and without. (Triton's
    interpreter multiplies bfloat16 as raw bits, so bfloat16 is checked on a GPU: tests/test_cuda.py.)"""
    from tiny import long_kernel_case

    got, expected = long_kernel_case("cpu", torch.float16, causal, one_pass, tile)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=2e-5, rtol=2e-5, msg=name)


@pytest.mark.parametrize("tile, groups", [((64, 64), 4), ((128, 64), 4), ((64, 64), 2)], ids=["64x64-4", "128x64-4",
                                                                                              "64x64-2"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "packed"])
def test_column_sums_added_a_row_group_at_a_time_give_the_definitions(causal, tile, groups, monkeypatch, use_settings):
    """Hopper's launch adds a tile's column sums one group of 16-row slabs at a time, a warp's each
    (kernels.row_groups), so that no warp waits for another; a tile of 128 rows holds two slabs a group. The column
    sums, and every other sum and map, still equal the definitions."""
    from tiny import long_kernel_case

    use_settings(kernel_groups=groups)
    launched = []
    constants = kernels.constants
    monkeypatch.setattr(kernels, "constants", lambda *a: launched.append(constants(*a)) or launched[-1])
    got, expected = long_kernel_case("cpu", torch.float16, causal, True, tile)
    assert [c["SPLIT"] for c in launched] == [groups]
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=2e-5, rtol=2e-5, msg=name)


def test_the_row_groups_follow_the_gpu_and_a_wrong_setting_is_refused(monkeypatch, use_settings):
    """One group a warp on Hopper in half precision, where a warp holds 16 of every 64 rows; one group elsewhere
    (an A100's 8 warps, float32 models, the CPU's interpreter). ATTNVIZ_KERNEL_GROUPS overrides it; a setting that
    splits a 16-row slab is refused with the reason."""
    use_settings(kernel_groups=None, kernel_tile=None)
    assert kernels.row_groups(90, False, 64, 4) == 4 and kernels.row_groups(90, False, 128, 4) == 4
    assert kernels.row_groups(80, False, 64, 8) == 1 and kernels.row_groups(90, True, 64, 8) == 1
    assert kernels.row_groups(0, False, 64, 8) == 1
    assert kernels.launch(torch.device("cpu"), False)[4] == 1
    use_settings(kernel_groups=2)
    assert kernels.launch(torch.device("cpu"), False)[4] == 2
    assert kernels.launch(torch.device("cpu"), False, (32, 64))[:2] == (32, 64)
    use_settings(kernel_groups=8)
    with pytest.raises(ValueError, match="16-row slab"):
        kernels.launch(torch.device("cpu"), False)
    assert kernels.launch(torch.device("cpu"), False, (128, 64))[4] == 8  # the caller's tile holds 8 slabs


def test_a_register_cap_reaches_the_launch_and_a_wrong_one_is_refused(monkeypatch, use_settings):
    """ATTNVIZ_KERNEL_REGISTERS caps a thread's registers (so that an SM holds more programs:
    kernels.programs_per_sm): the cap reaches the kernel's launch as Triton's ``maxnreg``, the sums still equal the
    definitions, 0 means no cap, and a cap ptxas cannot take is refused with the reason."""
    from tiny import long_kernel_case

    use_settings(kernel_registers=128)
    assert kernels.launch(torch.device("cpu"), False)[5] == 128
    launched = []
    kernel = kernels.kernel()

    class Recording:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launched.append(kwargs)
                return kernel[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(kernels, "kernel", lambda: Recording())
    got, expected = long_kernel_case("cpu", torch.float16, True, True, (64, 64))
    assert [kwargs.get("maxnreg") for kwargs in launched] == [128]
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=2e-5, rtol=2e-5, msg=name)
    use_settings(kernel_registers=0)
    assert kernels.launch(torch.device("cpu"), False)[5] is None
    for wrong in ("100", "32", "256", "255"):
        use_settings(kernel_registers=int(wrong))
        with pytest.raises(ValueError, match="multiple of 8 from 64 to 248"):
            kernels.launch(torch.device("cpu"), False)
    with pytest.raises(InputError, match="ATTNVIZ_KERNEL_REGISTERS='many': not a whole number"):
        Settings.from_environment({"ATTNVIZ_KERNEL_REGISTERS": "many"})


def test_more_keys_than_one_cell_pooling_counts_exactly_are_refused():
    """A tile pooled to one cell finds its cell in float32, exact below 2^20 tiles: a layer of 2^26 keys (meta
    tensors: nothing is allocated) is refused with the reason, before any launch."""
    n = 2**26
    q, k = (torch.empty(1, n, 64, dtype=torch.float16, device="meta") for _ in range(2))
    with pytest.raises(ValueError, match="one-cell pooling counts exactly"):
        kernels.layer_statistics(q, k, None, torch.empty(n // 64, 2, dtype=torch.int32, device="meta"), 0.125,
                                 torch.empty(n, device="meta"), 64, (n // 64, n // 64), causal=True, block=(64, 64))
