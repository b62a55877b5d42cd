"""Full maps held packed (docs/methods.md#full-maps-held-packed): each query row's span of keys, exact against the
whole arrays, in the store itself and through captures of several families, masks and interventions."""

import pickle
import threading

import numpy as np
import pytest
import torch

from attnviz import Keep, Recipe, capture
from attnviz.captured import Capture
from attnviz.core.record import packed
from attnviz.core.record.packed import Packed, PackedMaps, pack

from tiny import loaded

TEXT = "The quick brown fox jumps over the lazy dog, again and again. " * 3


def _masked(rng, h, n, m, keep):
    return (rng.random((h, n, m)) * keep).astype(np.float16)


def test_a_causal_map_holds_its_lower_triangle_and_reads_back_bit_for_bit():
    rng = np.random.default_rng(0)
    maps = _masked(rng, 3, 40, 40, np.tri(40, dtype=bool))
    held = pack(maps)
    assert isinstance(held, Packed)
    assert held.values.shape == (3, 40 * 41 // 2)  # every allowed cell, nothing else
    np.testing.assert_array_equal(held.lo, 0)
    np.testing.assert_array_equal(held.hi, np.arange(1, 41))
    assert (held.full().view(np.uint16) == maps.view(np.uint16)).all()


def test_spans_are_the_first_and_last_non_zero_key_over_every_head():
    maps = np.zeros((2, 4, 6), np.float16)
    maps[0, 0, 2] = 1
    maps[1, 0, 4] = 1  # row 0: 2 .. 4 from two heads
    maps[0, 2, 5] = -0.0  # a negative zero is kept (bitwise), not taken for nothing
    lo, hi = packed.spans(maps)
    assert lo.tolist() == [2, 0, 5, 0] and hi.tolist() == [5, 0, 6, 0]  # rows 1 and 3: nothing
    held = pack(maps)
    assert isinstance(held, Packed) and held.values.shape == (2, 4)
    assert (held.full().view(np.uint16) == maps.view(np.uint16)).all()


def test_a_map_that_fills_its_rows_is_kept_whole():
    maps = np.ones((2, 5, 5), np.float32)
    assert pack(maps) is maps
    band = np.triu(np.tri(8, k=0, dtype=bool), k=-1)  # a window of two keys: a quarter of the cells
    assert isinstance(pack(_masked(np.random.default_rng(1), 2, 8, 8, band)), Packed)


def test_blocks_written_in_pieces_are_the_whole_packing():
    rng = np.random.default_rng(2)
    n = 23
    window = np.tri(n, dtype=bool) & ~np.tri(n, k=-6, dtype=bool)
    maps = _masked(rng, 2, n, n, window)
    lo, hi = packed.row_spans(window)
    filled = Packed.empty(maps.shape, lo, hi, maps.dtype)
    for q0 in range(0, n, 5):  # blocks of rows, each over a range of keys, as the engine writes them
        for k0 in range(0, n, 7):
            filled.put(q0, k0, maps[:, q0:q0 + 5, k0:k0 + 7])
    assert (filled.full() == maps).all()
    assert (filled.values == pack(maps, lo, hi).values).all()


def test_the_store_reads_the_same_from_many_threads_and_pickles():
    rng = np.random.default_rng(3)
    whole = {layer: _masked(rng, 2, 30, 30, np.tri(30, dtype=bool)) for layer in range(5)}
    store = PackedMaps(whole)
    assert store.nbytes < sum(a.nbytes for a in whole.values())
    errors = []

    def read(seed):
        order = np.random.default_rng(seed).permutation(50) % 5
        for layer in order:
            if not (store[int(layer)] == whole[int(layer)]).all():
                errors.append(int(layer))

    threads = [threading.Thread(target=read, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(packed._READS) <= packed.READS_KEPT  # the reads kept whole: a few over the whole process
    back = pickle.loads(pickle.dumps(store))
    assert sorted(back) == list(range(5)) and all((back[l] == whole[l]).all() for l in range(5))
    with pytest.raises(ValueError):  # a read is shared: it cannot be written into
        store[0][0, 0, 0] = 1
    store[0] = whole[1]
    assert (store[0] == whole[1]).all()
    del store[0]
    assert 0 not in store and len(store) == 4


RECIPES = [("llama", "fwd", None), ("llama", "fwd*2 + bidir", None), ("llama", "sliding(w=7)*3", None),
           ("llama", "mask0-bidir(k=2)", "sinkscale(beta=0.2)@1-2; temperature(t=1.5)@0; ablate(heads=1)@1"),
           ("llama", "fwd", "headwindow(heads=1,3, s=2, w=5)@0"), ("llama", "stablemask(gamma=0.5)*3", None),
           ("qwen2", "fwd", None), ("gemma2", "fwd", None), ("gpt_oss", "fwd", "sinklogit(b=0)@2")]


@pytest.mark.parametrize("kind,arch,intervene", RECIPES)
def test_a_capture_holds_packed_maps_equal_to_the_whole_ones(monkeypatch, kind, arch, intervene):
    """The same capture with packing turned off (every map kept whole) reads the same maps, bit for bit; causal
    layers hold about half."""
    lm = loaded(kind)
    recipe = Recipe.of(lm, arch, intervene=intervene)
    cap = capture(lm, TEXT, recipe)
    with monkeypatch.context() as m:
        m.setattr(packed, "worth", lambda lo, hi, n_kv: False)
        whole = capture(lm, TEXT, recipe)
    assert all(isinstance(whole.probs.packed(l), np.ndarray) for l in whole.layers)
    for layer in cap.layers:
        assert (cap.probs[layer].view(np.uint16) == whole.probs[layer].view(np.uint16)).all(), layer
        np.testing.assert_array_equal(cap.layer_probs(layer), whole.layer_probs(layer))
    n = cap.n_tokens
    causal = [l for l in cap.layers if not cap.allowed[l][np.triu_indices(n, 1)].any()]
    for layer in causal:
        held = cap.probs.packed(layer)
        assert isinstance(held, Packed) and held.values.shape[1] <= n * (n + 1) // 2
    if arch == "fwd" and intervene is None:
        assert len(causal) == len(cap.layers)
        assert cap.probs.nbytes < 0.52 * sum(whole.probs.packed(l).nbytes for l in whole.layers)


def test_a_saved_capture_loads_back_packed(tmp_path):
    lm = loaded("llama")
    cap = capture(lm, TEXT, "fwd")
    back = Capture.load(cap.save(tmp_path / "c.npz"))
    assert isinstance(back.probs, PackedMaps)
    for layer in cap.layers:
        assert isinstance(back.probs.packed(layer), Packed)
        assert (back.probs[layer] == cap.probs[layer]).all()


def test_a_staged_layer_is_packed_once_it_lands():
    """The path of an accelerator with room for the layer (staged on the device, one copy to the host), taken on
    the CPU: the host copy is packed on the mask's spans when it lands."""
    from attnviz.core.record.recorders import FullMaps

    rng = np.random.default_rng(4)
    maps = torch.from_numpy(_masked(rng, 2, 9, 9, np.tri(9, dtype=bool)))[None]
    lo, hi = packed.row_spans(np.tri(9, dtype=bool))
    staged = FullMaps(tuple(maps.shape), torch.float16, torch.device("cpu"), stage=True, spans=(lo, hi))
    staged.put(0, 0, maps[:, :, :4].float())
    staged.put(4, 0, maps[:, :, 4:].float())
    staged.finish()
    assert tuple(staged.host_array.shape) == (2, 45)  # only the spans' cells crossed to the host
    held = staged.host()
    assert isinstance(held, Packed) and (held.full() == maps[0].numpy()).all()
    half = FullMaps(tuple(maps.shape), torch.bfloat16, torch.device("cpu"), stage=True, spans=(lo, hi))
    half.put(0, 0, maps.float())
    half.finish()
    held = half.host()  # numpy has no bfloat16: its values, held in float32
    assert isinstance(held, Packed) and held.dtype == np.float32
    assert (held.full() == maps[0].to(torch.bfloat16).float().numpy()).all()


@pytest.mark.parametrize("arch", ["fwd", "sliding(w=7)*3", "fwd*2 + bidir"])
def test_a_capture_staged_on_its_device_holds_the_same_maps(monkeypatch, arch):
    """The route of an accelerator with room for a layer (gathered on the device, packed there, one copy of the
    packed cells to the host), forced on the CPU: the same maps as blocks written straight to the host."""
    from attnviz.core.sizing.sizes import Sizes

    lm = loaded("llama")
    direct = capture(lm, TEXT, arch)
    with monkeypatch.context() as m:
        m.setattr(Sizes, "stages", staticmethod(lambda nbytes, device: True))
        staged = capture(lm, TEXT, arch)
    for layer in direct.layers:
        assert type(staged.probs.packed(layer)) is type(direct.probs.packed(layer))
        assert (staged.probs[layer].view(np.uint16) == direct.probs[layer].view(np.uint16)).all(), layer


def test_a_read_never_keeps_what_a_write_replaced(monkeypatch):
    """A layer set while another thread unpacks its old value: the old read is not kept, later reads see the new."""
    rng = np.random.default_rng(5)
    old, new = (_masked(rng, 2, 12, 12, np.tri(12, dtype=bool)) for _ in range(2))
    store = PackedMaps({0: old})
    unpack = Packed.full

    def slow_full(self):
        out = unpack(self)
        if self is store.packed(0):  # the write lands while this read unpacks
            store[0] = new
        return out

    monkeypatch.setattr(Packed, "full", slow_full)
    assert (store[0] == old).all()  # this read saw the value it began with
    monkeypatch.setattr(Packed, "full", unpack)
    assert (store[0] == new).all()


def test_bfloat16_maps_are_kept_in_float32_with_bfloat16_s_values():
    lm = loaded("llama")
    cap = capture(lm, TEXT, "fwd*2 + bidir", Keep(storage_dtype=torch.bfloat16, scores=True))
    exact = capture(lm, TEXT, "fwd*2 + bidir", Keep(storage_dtype=torch.float32))
    for layer in cap.layers:
        assert cap.probs[layer].dtype == np.float32 and cap.scores[layer].dtype == np.float32
        rounded = torch.from_numpy(np.array(exact.probs[layer])).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(cap.probs[layer], rounded)
    assert isinstance(cap.probs.packed(0), Packed) and not isinstance(cap.probs.packed(2), Packed)  # bidir: whole


def test_layer_probs_hold_the_storage_dtypes_values_as_documented():
    """docs/library.md: by default a float32 array of float16-rounded values; Keep(storage_dtype=torch.float32) keeps
    the float32 softmax's own values."""
    lm = loaded("llama")
    default = capture(lm, TEXT, "fwd*2 + bidir")
    exact = capture(lm, TEXT, "fwd*2 + bidir", Keep(storage_dtype=torch.float32))
    for layer in default.layers:
        kept, full = default.layer_probs(layer), exact.layer_probs(layer)
        assert kept.dtype == np.float32 and full.dtype == np.float32 and default.probs[layer].dtype == np.float16
        np.testing.assert_array_equal(kept, full.astype(np.float16).astype(np.float32))
        assert (full != full.astype(np.float16).astype(np.float32)).mean() > 0.5  # float32 keeps more than float16
        np.testing.assert_allclose(full.sum(-1), 1, atol=1e-6)


def test_layers_with_masks_of_their_own_share_one_gather_index(monkeypatch):
    """Each layer whose heads have masks of their own has an allow-set of its own; its spans are the layer mask's,
    so the staged route makes their gather index once, not once a layer."""
    from attnviz.core.record import recorders
    from attnviz.core.sizing.sizes import Sizes

    made = []
    real = recorders.Maps.start

    def start(self, run, layer, inputs):
        real(self, run, layer, inputs)
        made.append(self)

    monkeypatch.setattr(recorders.Maps, "start", start)
    monkeypatch.setattr(Sizes, "stages", staticmethod(lambda nbytes, device: True))
    lm = loaded("llama")
    cap = capture(lm, TEXT, Recipe.of(lm, "fwd", "headwindow(heads=1, s=2, w=5)"))
    assert len(cap.head_allowed) == len(cap.layers) == 3
    assert len({id(m) for m in made}) == 1 and len(made[0].indices) == 1
