"""Long texts: pooled maps, zoomed regions, size estimates and the memory budget."""


import numpy as np
import pytest
import torch

from attnviz.core import engine
from attnviz import regions
from attnviz.capture import capture
from attnviz.plan import checkpoint_bytes, checkpoint_count, checkpoint_layers
from attnviz.plan import Keep
from attnviz.recipe import Recipe
from attnviz.errors import InputError
from attnviz.figures.style import max_pool
from ui.lru import ByteLRU, nbytes

from tiny import ARCHS, loaded

TEXT = "The quick brown fox jumps over the lazy dog, again. " * 4  # 208 tokens, one per character
SPECS = ["fwd", "nosink-fwd*2 + bidir", "back*3", "stablemask(gamma=0.5)", "sliding(w=9)*3"]


@pytest.mark.parametrize("spec", SPECS)
def test_pooled_maps_are_the_max_pool_of_the_full_maps(spec):
    lm = loaded("llama")
    full = capture(lm, TEXT, spec, Keep(storage_dtype=torch.float32))
    long = capture(lm, TEXT, spec, Keep(statistics=True, pool=24, block_bytes=4 * 4 * len(TEXT) * 7))  # 7-row blocks
    assert not long.probs and long.pool_factor(0) == 16  # ceil(208 / 24) = 9, rounded up to a power of two
    for layer in range(3):
        values, allowed = long.layer_view(layer)
        probs = full.layer_probs(layer)
        expected = np.stack([max_pool(np.where(full.allowed[layer], p, np.nan), 24, factor=16) for p in probs])
        np.testing.assert_allclose(values, expected, atol=2e-3, rtol=2e-3, equal_nan=True)
        np.testing.assert_array_equal(allowed, ~np.isnan(expected[0]))


def test_pooled_value_weighted_maps_and_scores_are_the_max_pool_of_the_full_ones():
    lm = loaded("llama")
    full = capture(lm, TEXT, "fwd + back + bidir", Keep(storage_dtype=torch.float32, value_norms=True, scores=True))
    long = capture(lm, TEXT, "fwd + back + bidir", Keep(statistics=True, pool=24, value_norms=True, scores=True, block_bytes=4 * 4 * len(TEXT) * 7))  # 7-row blocks
    for layer in range(3):
        for view, maps in ((long.value_view, full.value_weighted), (long.scores_view, full.layer_scores)):
            values, allowed = view(layer)
            expected = np.stack([max_pool(np.where(full.allowed[layer], v, np.nan), 24, factor=16)
                                 for v in maps(layer)])
            np.testing.assert_allclose(values, expected, atol=2e-3, rtol=2e-3, equal_nan=True)
            np.testing.assert_array_equal(allowed, ~np.isnan(expected[0]))
        np.testing.assert_allclose(long.layer_value_norms(layer), full.layer_value_norms(layer), rtol=1e-5)


def test_reduced_scores_need_a_pool():
    with pytest.raises(InputError, match="give a pool size as well"):
        capture(loaded("llama"), TEXT, "fwd", Keep(statistics=True, scores=True))


@pytest.mark.parametrize("spec", SPECS)
def test_a_region_equals_the_slice_of_the_full_map(spec):
    lm = loaded("llama")
    full = capture(lm, TEXT, spec, Keep(storage_dtype=torch.float32))
    steps = []
    region = regions.region(lm, TEXT, spec, 1, (150, 208), (3, 70), on_layer=lambda d, t: steps.append((d, t)),
                         block_bytes=4 * 4 * len(TEXT) * 11)  # 11-row blocks: the region crosses several
    np.testing.assert_allclose(region.values, full.layer_probs(1)[:, 150:208, 3:70], atol=1e-6)
    np.testing.assert_array_equal(region.allowed, full.allowed[1][150:208, 3:70])
    assert region.row_tokens == full.tokens[150:208] and region.col_tokens == full.tokens[3:70]
    assert steps == [(1, 2), (2, 2)]  # the forward stopped after layer 1
    cut = regions.from_capture(full, 1, (150, 208), (3, 70))
    np.testing.assert_array_equal(cut.values, full.layer_probs(1)[:, 150:208, 3:70])


@pytest.mark.parametrize("spec,runs", [("fwd", 90), ("nosink-fwd + sliding(w=9)*2", 90), ("fwd + bidir*2", 208),
                                       ("bidir + fwd*2", 208)])
def test_a_causal_region_runs_only_the_text_up_to_its_last_token(spec, runs, monkeypatch):
    """Rows 40..90 and keys 10..60 of layer 1: where no query sees a later key up to that layer, the
    forward gets the first 90 tokens only, and the region still equals the full map's slice."""
    lm = loaded("llama")
    full = capture(lm, TEXT, spec, Keep(storage_dtype=torch.float32))
    lengths = []
    real = engine.forward
    monkeypatch.setattr(engine, "forward", lambda model, ids, *a, **k: lengths.append(ids.shape[1]) or
                        real(model, ids, *a, **k))
    region = regions.region(lm, TEXT, spec, 1, (40, 90), (10, 60))
    assert lengths == [runs]
    np.testing.assert_allclose(region.values, full.layer_probs(1)[:, 40:90, 10:60], atol=1e-6)
    np.testing.assert_array_equal(region.allowed, full.allowed[1][40:90, 10:60])
    assert region.row_tokens == full.tokens[40:90] and region.col_tokens == full.tokens[10:60]


@pytest.mark.parametrize("made_with", [dict(intervene="temperature(t=2)"), dict(prepend="#"),
                                       dict(intervene="sinkscale(beta=0.3)@1; ablate(heads=1)@0", prepend="#"),
                                       dict(residual="method2")], ids=["intervention", "prefix", "both", "residual"])
def test_a_long_captures_region_is_made_with_what_the_capture_was_made_with(made_with):
    """The Heatmaps page's region of a long text (statistics only, no full maps) is recomputed with
    the capture's own intervention, BOS control and residual variant: its cells are the full capture's
    (before, it was recomputed without them: other values, and rows shifted by the prefix)."""
    lm = loaded("llama")
    recipe = Recipe.of(lm, "fwd", **made_with)
    full = capture(lm, TEXT, recipe, Keep(storage_dtype=torch.float32))
    reduced = capture(lm, TEXT, recipe, Keep(statistics=True, pool=24))
    assert 2 not in reduced.probs
    region = regions.of_capture(lm, reduced, 2, (150, 200), (0, 60))
    np.testing.assert_allclose(region.values, full.layer_probs(2)[:, 150:200, 0:60], atol=1e-6)
    assert region.row_tokens == full.tokens[150:200] and region.col_tokens == full.tokens[0:60]
    plain = regions.region(lm, TEXT, "fwd", 2, (150, 200), (0, 60))
    # what the capture was made with matters here: well above the 1e-6 the equality allows
    assert np.abs(plain.values - region.values).max() > 2e-5
    cut = regions.of_capture(lm, full, 2, (150, 200), (0, 60))  # full maps: cut, not recomputed
    np.testing.assert_array_equal(cut.values, full.layer_probs(2)[:, 150:200, 0:60])


@pytest.mark.parametrize("kind", [k for k in ARCHS if k != "gpt2"])
def test_a_region_resumes_from_the_captures_nearest_kept_layer_input(kind):
    """A long capture with checkpoints keeps layer inputs; a region of layer 2 then runs layer 2 only
    (its progress starts there) and its cells are the full capture's, bit for bit in fp32."""
    lm = loaded(kind)
    cap = capture(lm, TEXT, "fwd", Keep(statistics=True, pool=24, checkpoints=2))
    assert sorted(cap.checkpoints) == [1, 2] and cap.checkpoints[1].shape == (len(TEXT), lm.config.hidden_size)
    full = capture(lm, TEXT, "fwd", Keep(storage_dtype=torch.float32))
    for layer, runs in ((2, [(3, 3)]), (1, [(2, 2)]), (0, [(1, 1)])):
        steps = []
        region = regions.of_capture(lm, cap, layer, (150, 208), (0, 60), on_layer=lambda d, t: steps.append((d, t)))
        assert steps == runs, layer  # resumed at the layer's own kept input
        np.testing.assert_array_equal(region.values, full.layer_probs(layer)[:, 150:208, 0:60])


def test_resuming_keeps_the_captures_intervention_prefix_and_mask():
    lm = loaded("llama")
    made_with = dict(intervene="temperature(t=2)@0,2; ablate(heads=1)@1", prepend="#")
    recipe = Recipe.of(lm, "nosink-fwd + sliding(w=9) + fwd", **made_with)
    cap = capture(lm, TEXT, recipe, Keep(statistics=True, pool=24, checkpoints=1))
    assert sorted(cap.checkpoints) == [2]  # one checkpoint: every ceil(3 / 2) = 2 layers
    full = capture(lm, TEXT, recipe, Keep(storage_dtype=torch.float32))
    steps = []
    region = regions.of_capture(lm, cap, 2, (40, 90), (10, 60), on_layer=lambda d, t: steps.append(d))
    assert steps == [3]
    np.testing.assert_allclose(region.values, full.layer_probs(2)[:, 40:90, 10:60], atol=1e-6)


def test_learned_positions_resume_too():
    """GPT-2 adds its learned positions before the first layer, so a layer's input holds them: its regions resume
    from a checkpoint like a rotary model's, and equal the full maps."""
    lm = loaded("gpt2")
    cap = capture(lm, TEXT, "fwd", Keep(statistics=True, pool=24, checkpoints=1))
    assert sorted(cap.checkpoints) == [2]
    full = capture(lm, TEXT, "fwd", Keep(storage_dtype=torch.float32))
    steps = []
    region = regions.of_capture(lm, cap, 2, (150, 208), (0, 60), on_layer=lambda d, t: steps.append(d))
    assert steps == [3]
    np.testing.assert_allclose(region.values, full.layer_probs(2)[:, 150:208, 0:60], atol=1e-5)


def test_families_that_cannot_resume_keep_no_checkpoints_and_run_from_the_start():
    import dataclasses

    from attnviz.core.model import anatomy

    lm = loaded("gpt2")  # its anatomy made to say it cannot (as for a layer called with arguments attnviz cannot make)
    found = anatomy.of(lm.model)
    lm.model.__dict__["_attnviz_anatomy"] = dataclasses.replace(found, resumable=False,
                                                                 why_not_resumable="gpt2 cannot resume: a test")
    cap = capture(lm, TEXT, "fwd", Keep(statistics=True, pool=24, checkpoints=2))
    assert cap.checkpoints == {}
    steps = []
    regions.of_capture(lm, cap, 2, (150, 208), (0, 60), on_layer=lambda d, t: steps.append(d))
    assert steps == [1, 2, 3]


def test_checkpoints_are_counted_and_only_kept_by_the_run_that_asked():
    lm = loaded("llama")
    assert [sorted(checkpoint_layers(lm, k)) for k in (0, 1, 2, 9)] == [[], [2], [1, 2], [1, 2]]
    plain = capture(lm, TEXT, "fwd", Keep(statistics=True, pool=24))
    kept = capture(lm, TEXT, "fwd", Keep(statistics=True, pool=24, checkpoints=2))
    assert checkpoint_bytes(lm, len(TEXT)) == len(TEXT) * 32 * 4  # (n, hidden) in the model's fp32
    assert 0 <= nbytes(kept) - nbytes(plain) - 2 * checkpoint_bytes(lm, len(TEXT)) < 256  # + the dict's keys
    assert (Keep(statistics=True, pool=24, checkpoints=2).host_bytes(lm, len(TEXT))
            - Keep(statistics=True, pool=24).host_bytes(lm, len(TEXT))) == 2 * checkpoint_bytes(lm, len(TEXT))
    assert capture(lm, TEXT, "fwd", Keep(statistics=True, pool=24)).checkpoints == {}  # the hooks stay, idle
    assert checkpoint_count(lm, len(TEXT), 3 * checkpoint_bytes(lm, len(TEXT)) + 1) == 3
    assert checkpoint_count(lm, len(TEXT), 10**12) == 8


@pytest.mark.parametrize("queries,keys,message", [
    ((10, 5), (0, 4), "query range 10..5"), ((0, 4), (0, 500), "not inside the text's 0..208"),
    ((0, 200), (0, 4), "at most 96"),
])
def test_bad_regions_are_refused(queries, keys, message):
    with pytest.raises(InputError, match=message):
        regions.region(loaded("llama"), TEXT, "fwd", 0, queries, keys)


@pytest.mark.parametrize("keep", [Keep(), Keep(statistics=True, pool=32), Keep(hidden_states=True), Keep(scores=True),
                                  Keep(statistics=True), Keep(statistics=True, pool=32, value_norms=True, scores=True),
                                  Keep(statistics=("alpha",)), Keep(statistics=("entropy",), pool=16)])
def test_size_estimates_bound_what_a_capture_holds(keep):
    lm = loaded("llama")
    cap = capture(lm, TEXT, "fwd*2 + bidir", keep)
    estimate = keep.host_bytes(lm, cap.n_tokens)
    assert nbytes(cap) <= estimate <= 1.6 * nbytes(cap) + 64 * 1024


def test_shared_buffers_count_once_and_reserve_evicts_first():
    a = np.zeros((100, 100), dtype=np.float32)
    assert nbytes({"x": a, "y": a, "z": a[None]}) < 2 * a.nbytes
    store = ByteLRU(1000)
    store.put("old", b"", size=600)
    store.put("new", b"", size=300)
    assert store.reserve(500) and "old" not in store and "new" in store and store.used == 300
    assert not store.reserve(2000)
