"""The fused statistics kernel compiled ahead of time for the GPUs it is meant for,
on this CPU: Triton's CUDA backend and its bundled ptxas need no GPU. A change that no longer
compiles for sm_90 (H100/H200) or sm_80 (A100), or that makes ptxas spill registers to local
memory inside the tile loops, fails here before anyone runs it on a GPU.

The interpreter tests (tests/test_fused.py) check what the kernel computes; these check that the
same source becomes a GPU kernel that keeps its working set in registers. Spills are checked for
the half-precision variants, the GPU default (``devices.default_dtype``); fp32 models (ieee dot
products, no tensor cores) must compile, and spill a little (see bench/kernel_regs.py)."""

import itertools

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton was built without its CUDA backend")

from attnviz.core.kernel import kernels  # noqa: E402

# every output the kernel can be asked for at once (the most registers), pooled by whole tiles and by G x G
# cells, and the plain statistics; at the warps kernels.num_warps launches on each GPU
HALF = [dict(capability=cap, dtype="bf16", head_dim=d, causal=causal, **outputs)
        for cap, d, causal, outputs in itertools.product(
            (90, 80), (64, 128), (True, False), (dict(pool=True, value=True, scores=True),
                                                 dict(pool=True, value=True, scores=True, whole=False),
                                                 dict(pool=False)))]
FP32 = [dict(capability=90, dtype="fp32", head_dim=64, causal=False)]
WARPS = [dict(capability=90, dtype="bf16", head_dim=128, causal=False, num_warps=w)
         for w in (kernels.HOPPER_WARPS, kernels.NUM_WARPS)]
# what a 512-cell statistics capture of a causal model launches at 32,768 tokens, and with a packed mask
LONG = [dict(capability=90, dtype="bf16", head_dim=128, causal=causal) for causal in (True, False)]
# a text whose length is not a multiple of 16 (the launcher specialises only what divides by 16)
UNALIGNED = [dict(capability=cap, dtype="bf16", head_dim=128, causal=causal, value=True, scores=True, whole=False,
                  aligned=False) for cap in (90, 80) for causal in (True, False)]
# the two-pass fallback (no log-sum-exp from the attention kernel), at its heaviest
TWO_PASSES = [dict(capability=cap, dtype="bf16", head_dim=128, causal=False, pool=True, value=True, scores=True,
                   lse=False) for cap in (90, 80)]


@pytest.fixture(scope="module")
def used():
    """Every variant compiled in one child process (Triton's import is the slow part)."""
    variants = HALF + FP32 + WARPS + TWO_PASSES + LONG + UNALIGNED
    return dict(zip(map(repr, variants), kernels.compiled_resources(*variants)))


@pytest.mark.parametrize("variant", HALF, ids=lambda v: "sm{capability}-d{head_dim}-{causal}-{pool}{value}{scores}"
                         "{whole}".format(**{"value": False, "scores": False, "whole": True, **v}))
def test_half_precision_variants_compile_without_spilling(used, variant):
    got = used[repr(variant)]
    assert got["spill_stores"] == 0 and got["spill_loads"] == 0, got
    assert got["registers"] <= 255 and 0 < got["shared"] <= 100 * 1024, got


@pytest.mark.parametrize("variant", TWO_PASSES + UNALIGNED,
                         ids=lambda v: f"sm{v['capability']}-{'unaligned' if 'aligned' in v else 'two-pass'}-{v['causal']}")
def test_the_two_pass_fallback_and_unaligned_lengths_compile_without_spilling(used, variant):
    got = used[repr(variant)]
    assert got["spill_stores"] == 0 and got["spill_loads"] == 0, got
    assert got["registers"] <= 255 and 0 < got["shared"] <= 100 * 1024, got


def test_fp32_models_compile_for_sm90(used):
    got = used[repr(FP32[0])]
    assert 0 < got["registers"] <= 255 and got["shared"] > 0


def test_the_heaviest_variant_compiles_without_spilling_at_either_warp_count(used):
    """The heaviest variant (every pooled output, a packed mask, head dim 128) at 4 and at 8 warps:
    it compiles, spills nothing and stays within the register file. How many registers each takes changes
    with Triton's version (8 warps took fewer than 4 on one, more on another), so the figures themselves
    are printed by bench/kernel_regs.py, not asserted."""
    for got in (used[repr(v)] for v in WARPS):
        assert got["spill_stores"] == 0 and got["spill_loads"] == 0, got
        assert 0 < got["registers"] <= 255 and 0 < got["shared"] <= 100 * 1024, got


def test_a_kernel_that_does_not_compile_says_why():
    with pytest.raises(RuntimeError, match="compiling the kernel failed"):
        kernels.compiled_resources(dict(capability=90, dtype="bf16", head_dim=64, granularity=128, whole=False))


def test_a_causal_kernel_runs_full_tiles_without_the_masks_work(used):
    """A causal kernel has two tile loops, the full tiles' first: it masks no score, tests no diagonal and
    (key 0's tile aside) no key, so a thread's tile costs clearly fewer instructions than a masked tile's.
    A packed mask has only the masked loop."""
    causal, packed = (used[repr(v)] for v in LONG)
    full, masked = causal["tile_instructions"]
    assert full <= 0.85 * masked, causal
    assert len(packed["tile_instructions"]) == 1, packed
    assert causal["num_warps"] == kernels.HOPPER_WARPS  # sm_90 in half precision


def test_hopper_s_column_sums_a_warp_at_a_time_exchange_nothing_between_warps():
    """The launch on sm_90 in half precision adds a tile's column sums one warp at a time (kernels.row_groups): the
    reshape into warps' 16-row slabs stays in registers, so a full tile of a 512-cell capture at 32,768 tokens waits
    at no more than 3 barriers (12 with the program's column sums, whose rows sit in four warps) and runs fewer
    instructions; nothing spills."""
    bm, bn, stages, _ = kernels.TUNED[90]
    groups = kernels.row_groups(90, False, bm, kernels.HOPPER_WARPS)
    assert groups == kernels.HOPPER_WARPS
    base = dict(capability=90, dtype="bf16", head_dim=128, causal=True, tile=(bm, bn), num_stages=stages)
    split, whole = kernels.compiled_resources(dict(base, split=groups), dict(base, split=1))
    assert split["spill_stores"] == split["spill_loads"] == 0, split
    assert split["tile_barriers"][0] <= 3 < 10 <= whole["tile_barriers"][0], (split, whole)
    assert split["tile_instructions"][0] <= 0.92 * whole["tile_instructions"][0], (split, whole)


def test_the_tuned_launch_and_the_routes_kernel_compile_without_spilling():
    """The launch kept for sm_90 (kernels.TUNED: its tile and pipeline stages) at what a 512-cell capture of a causal
    model launches, and the routes kernel (attnviz.flow._triton_routes) at its tile, for sm_90 and sm_80: nothing
    spills to local memory."""
    bm, bn, stages, registers = kernels.TUNED[90]
    tuned = dict(capability=90, dtype="bf16", head_dim=128, causal=True, tile=(bm, bn), num_stages=stages,
                 whole=bm == bn == 64, split=kernels.row_groups(90, False, bm, kernels.HOPPER_WARPS), maxnreg=registers)
    heavy = kernels.TUNED_HEAVY[90]  # pooling A·||W_O v|| and the scores too: uncapped
    tuned_heavy = dict(tuned, tile=heavy[:2], num_stages=heavy.stages, maxnreg=heavy.registers, value=True, scores=True)
    routes = "attnviz.flow.contributions:kernel_resources"  # the routes kernel, named by its caller (flow/)
    for got in kernels.compiled_resources(tuned, tuned_heavy, dict(build=routes, capability=90),
                                          dict(build=routes, capability=80)):
        assert got["spill_stores"] == 0 and got["spill_loads"] == 0, got
        assert got["tile_instructions"], got


def test_the_programs_an_sm_holds_follow_cuda_s_occupancy_rules():
    """Registers go to warps 256 at a time and each program takes 1 KB of shared memory beside its own; the
    smallest of the register file's, the shared memory's, the warps' and the programs' limits counts."""
    assert kernels.programs_per_sm(90, 167, 66560, 4) == 3  # 168 x 128 = 21,504 registers; 67,584 bytes
    assert kernels.programs_per_sm(90, 128, 50176, 4) == 4  # 16,384 registers; 51,200 of 233,472 bytes: 4.56
    assert kernels.programs_per_sm(90, 64, 0, 4) == 8 and kernels.programs_per_sm(90, 32, 0, 4) == 16  # 64 warps
    assert kernels.programs_per_sm(90, 255, 50176, 4) == 2  # 256 x 128 registers
    assert kernels.programs_per_sm(80, 168, 66560, 8) == 1  # 43,008 registers a program
    assert kernels.programs_per_sm(75, 128, 0, 4) is None


def test_a_register_cap_lets_hopper_hold_one_program_more_without_spilling():
    """At 2 stages the long capture's launch on sm_90 takes 168 registers a thread, so an SM holds 3 programs; capped
    at 128 (``ATTNVIZ_KERNEL_REGISTERS``, bench/kernel_sweep.py --registers) it holds 4 (its shared memory allows 4),
    spills nothing and runs at most 8 % more instructions a tile. The heaviest pooled variant (251 registers at 2
    stages: 2 programs) holds 3 at 168. Whether the extra warps pay is timed on a GPU, not here."""
    base = dict(capability=90, dtype="bf16", head_dim=128, causal=True, tile=(64, 64), num_stages=2)
    heavy = dict(base, value=True, scores=True)
    free, capped, heavy_free, heavy_capped = kernels.compiled_resources(
        base, dict(base, maxnreg=128), heavy, dict(heavy, maxnreg=168))
    assert (free["programs_per_sm"], capped["programs_per_sm"]) == (3, 4), (free, capped)
    assert (heavy_free["programs_per_sm"], heavy_capped["programs_per_sm"]) == (2, 3), (heavy_free, heavy_capped)
    for got in (capped, heavy_capped):
        assert got["spill_stores"] == got["spill_loads"] == 0, got
    assert capped["tile_instructions"][0] <= 1.08 * free["tile_instructions"][0], (free, capped)
    assert heavy_capped["tile_instructions"][0] <= 1.08 * heavy_free["tile_instructions"][0], (heavy_free, heavy_capped)


def test_hopper_launches_the_statistics_capped_and_the_heavy_variant_uncapped(monkeypatch, use_settings):
    """The launch measured on an H200 (docs/gpu.md#the-register-cap-timed-on-an-h200): the statistics and the pooled
    attention map at 2 stages and 128 registers a thread; the variant that also pools A·||W_O v|| or the scores, which
    a cap of 128 would spill, at 3 stages uncapped. ``kernel_registers=0`` lifts the cap, a number sets it; fp32 and
    an unlisted card take no cap."""
    monkeypatch.setattr(kernels, "_capability", lambda device: 90)
    hopper = torch.device("cpu")  # the card is pretended: only the capability is read
    assert kernels.launch(hopper, False) == (64, 64, 4, 2, 4, 128)
    assert kernels.launch(hopper, False, heavy=True) == (64, 64, 4, 3, 4, None)
    assert kernels.launch(hopper, True)[5] is None
    use_settings(kernel_registers=0)
    assert kernels.launch(hopper, False)[3:] == (2, 4, None)
    use_settings(kernel_registers=168)
    assert kernels.launch(hopper, False, heavy=True)[5] == 168
    monkeypatch.setattr(kernels, "_capability", lambda device: 80)
    use_settings(kernel_registers=None)
    assert kernels.launch(hopper, False)[5] is None


def test_the_fused_layer_asks_for_the_heavy_launch_when_it_pools_value_norms_or_scores(monkeypatch):
    """The engine's fused layer asks ``launch`` once a layer, naming whether the recorders pool A·||W_O v|| or the
    scores (what decides the register cap), and hands that launch to the kernel."""
    from attnviz.core.engine import routes

    asked = []

    def launch(device, fp32, tile=None, heavy=False):
        asked.append(heavy)
        raise RuntimeError("stop here")

    monkeypatch.setattr(kernels, "launch", launch)

    class Needs:
        def __init__(self, needs):
            self.needs = needs

        def fused_needs(self, run, layer):
            return self.needs

    q = torch.zeros(1, 2, 4, 8)
    for needs, heavy in (({"pool": 4}, False), ({"pool": 4, "value_norms": torch.ones(2, 4)}, True),
                         ({"pool": 4, "scores": True}, True)):
        with pytest.raises(RuntimeError, match="stop here"):
            routes.fused_layer(None, 0, [Needs(needs)], q, q, q, None, 1.0, True)
        assert asked[-1] is heavy
