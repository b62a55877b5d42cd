"""The fused statistics route: one Triton kernel computes a layer's sink statistics and
pooled maps straight from Q and K, without writing a single probability to memory.

Why this route. On a GPU the block engine's statistics are memory-bound: every fp32 block of scores
is written, then read and rewritten by about ten elementwise passes (mask, max, exp, sum, divide,
entropy, column sums, pooling, the cast for P·V). At 32k tokens on a Llama-3-8B shape that is ~40 TB
of traffic, ten times the SDPA forward. The alternative the issue names, SDPA for the output plus a
torch pass over the log-sum-exp, saves only the max/sum/divide passes. A kernel keeps each 64 × 64
tile of scores in registers and accumulates every statistic from it, given each row's log-sum-exp.
That log-sum-exp comes from the layer's own attention kernel (:func:`attnviz.core.kernel.lse.attention_with_lse`:
flash or memory-efficient attention compute it anyway, for their backward), which also gives the layer's output,
so the statistics cost one more QKᵀ product, compute-bound like the forward itself. Where no such kernel
runs, the statistics kernel finds the log-sum-exp itself in a first pass (as flash attention does) and
SDPA gives the output: two QKᵀ products.

Which layers take it: a recorded layer of a statistics capture (``Keep(statistics=True)``) on a CUDA
device with Triton available, batch 1, no StableMask/SM-I pseudo-logits, learned sinks, softcapping or
position bias (those keep the block engine, which handles every case). The settings' ``fused``
(``ATTNVIZ_FUSED=0`` for the CLI and the app: :mod:`attnviz.settings`) turns the route off; ``ATTNVIZ_FUSED=1``
forces it on any device, which with ``TRITON_INTERPRET=1`` runs the kernel in Triton's interpreter on the CPU (how
the tests check it against docs/methods.md#sink-metrics). A caller forces or forbids the route for its own calls, in
its own thread, with :func:`attnviz.core.engine.routes.forcing`. A launch that fails switches the route off for that
device and shape in that run only (:func:`failure`; the capture says so: ``Capture.meta["fused_fallback"]``).

The kernel's outputs per head: row sums, Σ p·log p, the diagonal, key 0's probability and the delimiter share per
query; column sums per key (atomic adds across query blocks and, on Hopper, across a block's warps:
:func:`row_groups`); and max-pooled maps of the probabilities (and, when asked, of A·‖W_O v‖ and of the allowed
scores) by atomic max on the pooled grid. Pooling factors are multiples of
the pooling granularity G (a power of two up to 16; :func:`attnviz.core.record.reduce.pool_factor`); where the
factor is a multiple of both tile sides (64 and up), a tile lies in one cell and pools to one maximum.

What a tile costs: scores in base 2 (one ``exp2`` a probability); a causal half-precision kernel runs each row
block's *full* tiles, wholly below the diagonal, without a mask, and masks only the few at the diagonal
(:mod:`attnviz.core.kernel._triton_stats`; the SASS counts: ``compiled_resources``, ``python bench/kernel_regs.py``).

The statistics are finished from these sums by their declarations (:mod:`attnviz.stats.metrics`), several fused
layers at once (:class:`attnviz.core.record.reduce.FusedLayers`).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import NamedTuple

import torch

from attnviz import settings


BLOCK_M = 64  # query rows per program
BLOCK_N = 64  # keys per tile
# Warps per program: 8 before Hopper and for fp32 models (with 4, ptxas spills there), 4 on sm_90 (Hopper) in half
# precision, where one warpgroup's 64-row wgmma holds a whole tile: 28 % fewer warp-instructions a tile, 12 barriers
# instead of 19, no spill (compiler figures: tests/test_kernel_sm90.py, `python bench/kernel_regs.py`);
# ATTNVIZ_KERNEL_WARPS=4 or 8 overrides the choice (`python bench/gpu.py --warps 4 8` times both on a card).
NUM_WARPS = 8
HOPPER_WARPS = 4


def warps_for(capability: int, fp32: bool) -> int:
    """The warps a program runs on an NVIDIA GPU of compute ``capability`` (90: sm_90), by the figures above:
    Hopper in half precision takes 4; newer GPUs, never compiled for here, keep 8 with the rest."""
    return HOPPER_WARPS if capability // 10 == 9 and not fp32 else NUM_WARPS


def num_warps(device: torch.device, fp32: bool) -> int:
    """The warps a program of the kernel runs on ``device`` (:func:`warps_for`; ROCm and the rest keep 8)."""
    setting = settings.active().kernel_warps
    if setting in (4, 8):
        return setting
    capability = _capability(device)
    return NUM_WARPS if capability is None else warps_for(capability, fp32)


def _capability(device: torch.device) -> int | None:
    if device.type == "cuda" and not getattr(torch.version, "hip", None):
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    return None


class Tuned(NamedTuple):
    """A launch measured on a card: its tile (query rows, keys), the K loads' pipeline stages and a cap on a thread's
    registers (None: the compiler's choice)."""

    bm: int
    bn: int
    stages: int | None
    registers: int | None = None


#: Measured choices per GPU (compute capability, half precision), from ``python bench/kernel_sweep.py`` on the card
#: (docs/gpu.md#the-register-cap-timed-on-an-h200), for the statistics and the pooled attention map. sm_90: on an
#: H200, 64 x 64 at 4 warps, 2 stages and 128 registers a thread (four programs an SM instead of three) took 18.4-18.5
#: ms a layer of the 8B shape at 32,768 tokens in two sweeps, against 23.6 ms uncapped at 3 stages (the launch
#: before); an H100 (sm_90 too) takes it unmeasured. A GPU not listed, fp32 and the CPU's interpreter keep
#: (BLOCK_M, BLOCK_N), Triton's default stages and no cap.
TUNED: dict[int, Tuned] = {90: Tuned(64, 64, 2, 128)}
#: The same for the variant that also pools A·‖W_O v‖ or the scores (253 registers uncapped on sm_90, which a cap of
#: 128 would spill): the launch measured before the cap was timed (3 stages, uncapped); its own cap is untimed.
TUNED_HEAVY: dict[int, Tuned] = {90: Tuned(64, 64, 3, None)}


def launch(device: torch.device, fp32: bool, tile: tuple[int, int] | None = None,
           heavy: bool = False) -> tuple[int, int, int, int | None, int, int | None]:
    """(BM, BN, warps, stages, row groups, registers) of the statistics kernel on ``device``: :data:`TUNED` (or
    :data:`TUNED_HEAVY` for a ``heavy`` launch, one that also pools A·‖W_O v‖ or the scores) where the card is
    listed, else the defaults, and :func:`row_groups` for the tile; ``registers`` a cap on a thread's registers
    (None: the compiler's choice; a cap lets an SM hold more programs: :func:`programs_per_sm`).
    The settings' ``kernel_tile``, ``kernel_warps``, ``kernel_stages``, ``kernel_groups`` and ``kernel_registers``
    (0: no cap; ``ATTNVIZ_KERNEL_TILE=BMxBN``, ``ATTNVIZ_KERNEL_WARPS``, ... for the CLI and bench/kernel_sweep.py,
    which times the choices) override each, and a caller's ``tile`` (BM, BN) overrides the tile."""
    given = settings.active()
    bm, bn, stages, registers = BLOCK_M, BLOCK_N, None, None
    capability = _capability(device)
    tuned = TUNED_HEAVY if heavy else TUNED
    if capability in tuned and not fp32:
        bm, bn, stages, registers = tuned[capability]
    if given.kernel_tile:
        bm, bn = given.kernel_tile
    if tile is not None:
        bm, bn = tile
    stages = stages if given.kernel_stages is None else given.kernel_stages
    warps = num_warps(device, fp32)
    groups = given.kernel_groups
    groups = row_groups(capability or 0, fp32, bm, warps) if groups is None else groups
    if groups < 1 or bm % (16 * groups):
        raise ValueError(f"ATTNVIZ_KERNEL_GROUPS={groups}: a tile of {bm} rows holds no whole 16-row slab a group")
    registers = registers if given.kernel_registers is None else (given.kernel_registers or None)
    if registers is not None and not (MIN_REGISTERS <= registers <= 248 and registers % 8 == 0):
        raise ValueError(f"ATTNVIZ_KERNEL_REGISTERS={registers}: a thread's registers are capped at a multiple of 8 "
                         f"from {MIN_REGISTERS} to 248 (0: no cap)")
    return bm, bn, warps, stages, groups, registers


#: The smallest register cap taken: a 64 x 64 tile's scores alone are 32 fp32 a thread at 4 warps, and its
#: probabilities as many. How low a cap goes without spilling depends on the variant (the compiled figures say:
#: tests/test_kernel_sm90.py).
MIN_REGISTERS = 64

#: What an NVIDIA SM holds, by compute capability: (32-bit registers, shared memory in bytes, warps, programs);
#: each program also takes 1 KB of shared memory the runtime reserves (CUDA's occupancy rules).
SM_LIMITS = {80: (65536, 164 * 1024, 64, 32), 90: (65536, 228 * 1024, 64, 32)}


def programs_per_sm(capability: int, registers: int, shared: int, warps: int) -> int | None:
    """How many programs of ``warps`` warps, each thread with ``registers`` registers and the program with ``shared``
    bytes of shared memory, one SM of ``capability`` runs at once (None: a capability not listed in
    :data:`SM_LIMITS`). Registers go to warps 256 at a time (a thread's count rounded up to 8). More programs give
    each scheduler more warps to switch to while one waits for a load, an exp2 or a shuffle. Exact for programs of 4
    warps or more (the kernel's): smaller ones also meet a register limit of each quarter of the SM."""
    if capability not in SM_LIMITS:
        return None
    file, memory, max_warps, max_programs = SM_LIMITS[capability]
    by_registers = file // (-(-registers // 8) * 8 * 32 * warps)
    by_shared = memory // (shared + 1024)
    return min(by_registers, by_shared, max_warps // warps, max_programs)


def row_groups(capability: int, fp32: bool, bm: int, warps: int) -> int:
    """How many groups of a tile's rows add their column sums to memory apart (the kernel's ``SPLIT``). On Hopper in
    half precision a warp of the warpgroup holds 16 of every 64 rows of the tensor cores' result, so one group a
    warp sums (and takes a one-cell tile's maximum) within the warp and exchanges nothing between warps: 2 barriers
    a full tile instead of 12, 19 % fewer instructions with a 512-cell map, 14 % without
    (`python bench/kernel_regs.py`), for ``warps`` times the column sums' atomic adds
    (docs/gpu.md#column-sums-a-warp-at-a-time-counted-on-a-cpu). Elsewhere the warps share rows and columns
    differently and one group (the program's sums) compiles to less."""
    return warps if capability // 10 == 9 and not fp32 and bm % (16 * warps) == 0 else 1


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def failure(err: BaseException, where: str) -> str:
    """The reason a launch of the kernel failed to compile or run (a Triton or driver this code was not tried
    with), said on the log: the caller switches the route off for that device and shape (``where``) in that run
    only, and the block engine computes the same statistics, slower. The next run tries the kernel again, so a
    shared server's other visitors, and this one's next capture, keep the route."""
    import logging

    reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    logging.getLogger("attnviz").warning("fused statistics kernel failed at %s (%s); using the block engine",
                                         where, reason)
    return reason


def wanted(device: torch.device, fused: bool | None = None) -> bool:
    """Whether recorded layers on ``device`` take the fused route (see the module docstring): ``fused`` True
    forces it, False forbids it (a caller's choice: :func:`attnviz.core.engine.routes.forcing`), None leaves it to
    the settings' ``fused`` (``ATTNVIZ_FUSED``), else to the device."""
    fused = settings.active().fused if fused is None else fused
    if fused is False:
        return False
    if fused:
        return available()
    return device.type == "cuda" and available()


def granularity(factor: int) -> int:
    """The pooling granularity G the kernel reduces a tile to before its atomic max: a power of two
    dividing the pooling factor, at most 16."""
    g = 1
    while g < 16 and factor % (2 * g) == 0:
        g *= 2
    return g


@functools.cache
def kernel():
    """The Triton kernel itself (:func:`attnviz.core.kernel._triton_stats.layer_stats`), imported when first asked."""
    from attnviz.core.kernel._triton_stats import layer_stats

    return layer_stats


def pack_allow(allow: torch.Tensor) -> torch.Tensor:
    """An (n_q, n_kv) boolean allow-set as (n_q, ⌈n_kv / 32⌉) int32 words, bit j of word w for key
    32·w + j: what the kernel reads for a mask it cannot compute from indices. At 32,768 tokens that
    is 128 MB instead of 1 GB of bytes, and the kernel loads 2 words a row of a 64-key tile instead of
    64 bytes through 64 pointers. Packed on the allow-set's device, one bit plane at a time (no
    temporary larger than the result)."""
    n_q, n_kv = allow.shape
    padded = torch.nn.functional.pad(allow, (0, -n_kv % 32)) if n_kv % 32 else allow
    words = torch.zeros(n_q, padded.shape[1] // 32, dtype=torch.int32, device=allow.device)
    for bit in range(32):  # bit 31 wraps to the sign bit: the kernel masks each bit, so signs do not matter
        words |= padded[:, bit::32].to(torch.int32) << bit
    return words


#: The sums of attnviz.stats.metrics.SUMS the kernel computes (the probabilities are 0 wherever the mask forbids,
#: so its column sums are the allowed-only ones too). A statistic finished from any other sum takes the block engine.
SUMS = frozenset({"rowsum", "plogp", "diag", "key0", "delim", "colsum", "colsum_allowed"})


def constants(bm: int, bn: int, head_dim: int, fp32: bool, g: int, pool: bool, value: bool,
               scores: bool, causal: bool, lse: bool = True, whole: bool = False, split: int = 1) -> dict:
    """The kernel's compile-time constants, one definition for the launch and for
    :func:`compiled_resources`, so the variants checked for spills are the ones launched."""
    return dict(BM=bm, BN=bn, D=max(16, 1 << (head_dim - 1).bit_length()), G=g, POOL=pool, VALUE=value,
                SCORES=scores, CAUSAL=causal, LSE=lse, WHOLE=whole, SPLIT=split,
                PRECISION="ieee" if fp32 else "tf32")  # fp32 models: no TF32 rounding (docs/methods.md#devices)


def layer_statistics(query: torch.Tensor, key: torch.Tensor, allow: torch.Tensor | None, ranges: torch.Tensor,
                     scaling: float, delim: torch.Tensor, pool_factor: int | None = None,
                     pooled_shape: tuple[int, int] | None = None, norms: torch.Tensor | None = None,
                     scores: bool = False, block: tuple | None = None,
                     causal: bool = False, lse: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Raw per-row, per-column and pooled sums of one layer (batch of one) on the layer's device.

    ``query`` (H, n_q, d), ``key`` (H_kv, n_kv, d), ``allow`` (n_q, n_kv) bool or packed by
    :func:`pack_allow` (ignored, may be None,
    with ``causal``: the plain causal mask with queries at the last n_q positions, computed inside the
    kernel from the indices instead of read from n_q x n_kv bytes; square only), ``ranges`` the
    (blocks, 2) key range of every block of ``block[0]`` query rows (the engine's ``_block_ranges``; ``block``
    (BM, BN), or the whole (BM, BN, warps, stages, row groups, registers) of :func:`launch`; None: :func:`launch`'s
    for the device), ``delim`` (n_kv,) delimiter flags, ``norms`` (H, n_kv) value norms for pooled A·‖W_O v‖, ``lse``
    (H, n_q) every row's log-sum-exp of its scaled allowed scores (natural log, float32) when the forward's
    attention computed it (:func:`attnviz.core.kernel.lse.attention_with_lse`): the kernel then passes over QKᵀ
    once instead of twice.
    Returns fp32 ``rowsum``, ``plogp`` (Σ p·log p), ``diag``, ``key0``, ``delim`` (H, n_q),
    ``colsum`` (H, n_kv) and, with a pool, ``pooled`` (and ``pooled_value`` / ``pooled_scores``)
    (H, rows, cols), NaN-free: cells no query may see hold 0 (-inf for scores).
    """
    heads, n_q, dim = query.shape
    n_kv = key.shape[1]
    device = query.device
    if block is not None and len(block) == 6:  # the caller's launch() already: the settings read once a layer
        bm, bn, warps, stages, groups, registers = block
    else:
        bm, bn, warps, stages, groups, registers = launch(device, query.dtype == torch.float32, block,
                                                          heavy=norms is not None or scores)
    f32 = {"dtype": torch.float32, "device": device}
    # read by their strides in int32: copied where the last dimension is strided or an offset would pass 2^31
    query, key = (x if x.stride(-1) == 1 and _span(x) < 2**31 else x.contiguous() for x in (query, key))
    # every output in one allocation (one launch to zero it, not ten: on a small model launches are the cost)
    pool = pool_factor is not None
    rows, cols = pooled_shape if pool else (1, 1)
    maps = 1 + (norms is not None) if pool else 0
    flat = torch.zeros(heads * (5 * n_q + n_kv + maps * rows * cols), **f32)
    names = ("rowsum", "plogp", "diag", "key0", "delim")
    out = dict(zip(names, flat[:5 * heads * n_q].view(5, heads, n_q)))
    out["colsum"] = flat[5 * heads * n_q:heads * (5 * n_q + n_kv)].view(heads, n_kv)
    grids = flat[heads * (5 * n_q + n_kv):].view(maps, heads, rows, cols) if pool else None
    g = granularity(pool_factor) if pool else 1
    whole = pool and pool_factor % bm == 0 and pool_factor % bn == 0  # a tile lies in one pooled cell
    if whole and n_kv // bn >= 2**20:  # the kernel finds a tile's cell in float32, exact below 2^20 tiles
        raise ValueError(f"{n_kv} keys are more than the kernel's one-cell pooling counts exactly in {bn}-key tiles")
    if bn % 32:
        raise ValueError(f"key tiles of {bn} do not hold whole 32-key words of the packed allow-set")
    if pool and (bm % g or bn % g):
        raise ValueError(f"pooling granularity {g} does not divide the kernel's {bm} x {bn} tiles")
    dummy = zeros(device)  # read by no program: the pointer of an output or input a launch leaves out
    pooled = grids[0] if pool else dummy
    pooled_value = grids[1] if pool and norms is not None else pooled
    pooled_scores = torch.full((heads, rows, cols), float("-inf"), **f32) if scores else pooled
    if causal:
        if n_q != n_kv:
            raise ValueError(f"the causal route takes square layers, not {n_q} queries over {n_kv} keys")
        packed = zeros(device, 1, torch.int32)
    else:
        packed = allow if allow.dtype == torch.int32 else pack_allow(allow)
    kernel()[(heads, -(-n_q // bm))](
        query, key, packed,
        _on(ranges, device, torch.int32), _on(delim, device), dummy if norms is None else _on(norms, device),
        dummy if lse is None else _on(lse, device),
        out["rowsum"], out["plogp"], out["diag"], out["key0"], out["delim"], out["colsum"],
        pooled, pooled_value, pooled_scores,
        n_q, n_kv, dim, heads // key.shape[0], float(scaling), 0, pool_factor or 1, rows, cols,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        **constants(bm, bn, dim, query.dtype == torch.float32, g, pool, norms is not None, scores, causal,
                     lse is not None, whole, groups),
        num_warps=warps, **({} if stages is None else {"num_stages": stages}),
        **({} if registers is None else {"maxnreg": registers}))
    if pool:
        out["pooled"] = pooled
        if norms is not None:
            out["pooled_value"] = pooled_value
        if scores:
            out["pooled_scores"] = pooled_scores
    return out


def _span(tensor: torch.Tensor) -> int:  # the largest offset read
    return sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride()))


def _on(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``tensor`` as the kernel reads it: itself where it is so already (no operation dispatched), else a copy."""
    if tensor.dtype == dtype and tensor.device == device and tensor.is_contiguous():
        return tensor
    return tensor.to(device, dtype).contiguous()


@functools.lru_cache(maxsize=16)
def zeros(device: torch.device, n: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``n`` zeros on ``device``, made once, read only: a pointer a launch leaves unread, or no delimiter flags."""
    return torch.zeros(n, dtype=dtype, device=device)


def compiled_resources(*variants: dict) -> list[dict]:
    """Compile the kernel ahead of time for NVIDIA GPUs and read what ptxas allocates, one dict per
    variant: ``registers`` a thread, ``spill_stores`` / ``spill_loads`` bytes a thread, ``shared``
    bytes a program. A variant names ``capability`` (90: H100/H200, 80: A100), ``dtype`` ("bf16",
    "fp16", "fp32"), ``head_dim`` and optionally ``pool``, ``value``, ``scores``, ``causal``,
    ``granularity``, ``whole``, ``num_warps``, ``lse``, ``tile`` (BM, BN), ``num_stages``, ``maxnreg`` (a cap on a
    thread's registers), ``split`` (row groups: :func:`row_groups`), or ``build`` ("module:function": another
    kernel's, its caller's to name, such as the routes kernel's ``attnviz.flow.contributions.RESOURCES``, with the
    variant's other keys as its arguments) (defaults: what a 512-px statistics capture of a causal model launches at
    32,768 tokens). Each dict also gives ``tile_instructions``: the SASS
    instructions a thread runs for one tile in each tile loop (and ``tile_barriers``, the barriers among them, where
    a warp waits for the program's others), in the kernel's order (a causal kernel's
    full tiles, then its masked ones). Where the kernel is bound by its arithmetic, as it is at long
    contexts, a GPU's time per tile follows that count.

    Needs Triton's CUDA backend and its bundled ptxas, not a GPU: this is how a CPU-only machine
    checks that a change still compiles for the GPUs it cannot run on, and does not spill registers
    to local memory inside the tile loops (tests/test_kernel_sm90.py, bench/kernel_regs.py). Runs in
    a fresh Python process without ``TRITON_INTERPRET``: a process that imported Triton with its
    interpreter on cannot compile."""
    import json
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[3])  # the folder that holds the attnviz package
    env = settings.environment_without("TRITON_INTERPRET")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    code = ("import importlib, json, sys; from attnviz.core.kernel._kernel_build import resources\n"
            "def built(v):\n"
            "    if 'build' not in v:\n        return resources(**v)\n"
            "    module, name = v.pop('build').split(':')\n"
            "    return getattr(importlib.import_module(module), name)(**v)\n"
            "print(json.dumps([built(v) for v in json.loads(sys.argv[1])]))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(variants)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"compiling the kernel failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])
