"""What the fused statistics kernel costs a GPU thread, without a GPU.

    python bench/kernel_regs.py [--capability 90 80]

Compiles every variant the engine launches with Triton's CUDA backend and reads ptxas's report:
registers a thread, spill bytes a thread (stores/loads to local memory inside the tile loops: the
first thing that makes a kernel slow), shared memory a program, and the disassembled tile loops.
Prints one line a variant:
``kernel sm=<cc> dtype=<dtype> d=<head dim> mask=<causal|packed> outputs=<...> passes=<1|2> warps=<w>
registers=<r> spill_stores=<B> spill_loads=<B> shared=<B> tile_instructions=<full>,<masked>
tile_barriers=<full>,<masked> warp_instructions=<...> full_vs_masked=<x>``: ``tile_instructions`` a thread runs
for one tile in each loop (a causal kernel's full tiles, then its masked ones), ``tile_barriers`` how many of them
make a warp wait for the program's other warps, ``warp_instructions`` the instructions times the warps (what an
SM issues for one tile of a program). Each variant at the row groups it launches with
(``attnviz.core.kernel.kernels.row_groups``: a warp's each on sm_90 in half precision).

Each line also gives ``programs_per_sm``: how many programs an SM holds at once by CUDA's occupancy rules
(``attnviz.core.kernel.kernels.programs_per_sm``: the registers, the shared memory, the warps). Then one line a register
cap that could let Hopper hold one program more: ``cap sm=90 outputs=<...> stages=<s> registers_cap=<r>
registers=<r> spill_stores=<B> programs_per_sm=<uncapped>-><capped> tile_instructions=<full>,<masked>
vs_uncapped=<x>`` (the long capture's launch, ``ATTNVIZ_KERNEL_REGISTERS``; whether it pays is timed on a GPU by
bench/kernel_sweep.py --registers).

The baselines are the kernel's own alternatives in the same run: the masked tile against the full one
(every tile cost the masked tile's work before full tiles were split off), 4 warps against 8
(``attnviz.core.kernel.kernels.num_warps`` picks 4 on sm_90 in half precision, 8 elsewhere), and at the
launched warps one pass over QKᵀ (the row log-sum-exp read from the attention kernel, what the engine
launches) against two (the kernel finds it itself: the fallback). These are compiler figures, not
timings: timings need a GPU (bench/gpu.py).
"""

from __future__ import annotations

import argparse
import itertools

from attnviz.core.kernel import kernels

OUTPUTS = {"stats": dict(pool=False), "pooled": dict(pool=True), "pooled+value+scores": dict(pool=True, value=True,
                                                                                            scores=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capability", type=int, nargs="+", default=[90, 80])
    args = parser.parse_args()
    rows = [dict(capability=cc, dtype=dtype, head_dim=d, causal=causal, num_warps=warps, lse=lse, **OUTPUTS[outputs])
            | {"_outputs": outputs}
            for cc, dtype, d, causal, outputs, warps, lse in itertools.product(
                args.capability, ("bf16", "fp32"), (64, 128), (True, False), OUTPUTS,
                (kernels.HOPPER_WARPS, kernels.NUM_WARPS), (True, False))
            if lse or warps == kernels.warps_for(cc, dtype == "fp32")]
    results = kernels.compiled_resources(*({k: v for k, v in row.items() if k != "_outputs"} for row in rows))
    for row, got in zip(rows, results):
        # the statistics' loops: full and masked tiles for a causal half-precision kernel, else masked only
        # (the two-pass kernel's log-sum-exp loops come first)
        split = row["causal"] and row["dtype"] != "fp32"
        loops = got.pop("tile_instructions")[-2 if split else -1:]
        barriers = got.pop("tile_barriers")[-2 if split else -1:]
        got.pop("num_warps")
        ratio = f" full_vs_masked={loops[0] / loops[1]:.2f}" if split else ""
        print(f"kernel sm={row['capability']} dtype={row['dtype']} d={row['head_dim']} "
              f"mask={'causal' if row['causal'] else 'packed'} outputs={row['_outputs']} passes={1 if row['lse'] else 2} "
              f"warps={row['num_warps']} " + " ".join(f"{k}={v}" for k, v in got.items())
              + f" tile_instructions={','.join(map(str, loops))} tile_barriers={','.join(map(str, barriers))}"
              f" warp_instructions={','.join(str(n * row['num_warps']) for n in loops)}{ratio}", flush=True)
    # register caps on the long capture's launch (sm_90: 64 x 64, 4 warps, a warp's row groups): at 2 stages the
    # shared memory leaves room for 4 programs (3 at 3 stages), so 128 registers give 4; the heaviest variant's 168, 3
    caps = [("pooled", 2, 128), ("pooled+value+scores", 2, 168), ("pooled+value+scores", 3, 168)]
    base = dict(capability=90, dtype="bf16", head_dim=128, causal=True, tile=(64, 64))
    variants = [dict(base, num_stages=stages, **OUTPUTS[outputs], **extra)
                for outputs, stages, cap in caps for extra in ({}, {"maxnreg": cap})]
    results = kernels.compiled_resources(*variants)
    for (outputs, stages, cap), free, capped in zip(caps, results[::2], results[1::2]):
        print(f"cap sm=90 outputs={outputs} stages={stages} registers_cap={cap} registers={capped['registers']} "
              f"spill_stores={capped['spill_stores']} programs_per_sm={free['programs_per_sm']}->"
              f"{capped['programs_per_sm']} tile_instructions={','.join(map(str, capped['tile_instructions'][-2:]))} "
              f"vs_uncapped={capped['tile_instructions'][-2] / free['tile_instructions'][-2]:.3f}", flush=True)



if __name__ == "__main__":
    main()
