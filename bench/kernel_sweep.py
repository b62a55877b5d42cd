"""The statistics kernel's launch choices timed on one layer of a GPU, against the flash attention forward of the
same layer, same run: the figures :data:`attnviz.core.kernel.kernels.TUNED` keeps per GPU.

    python bench/kernel_sweep.py [--n 32768] [--heads 32 --kv-heads 8 --head-dim 128] [--repeat 5]

One layer shaped like Llama-3-8B's (random bfloat16 Q, K, V; causal; every row's log-sum-exp from the flash
kernel, as a capture takes it; a 512-cell pooled map of the probabilities), the kernel launched at each tile
(BM x BN), warp count, number of pipeline stages, row groups (``kernels.row_groups``: 1, the program's column
sums; 4, a warp's each) and register cap (``--registers``: 0, the compiler's choice; 128 lets an H100 or H200 hold
four programs an SM at 2 stages where it holds three: ``kernels.programs_per_sm``). Each line: ``sweep
tile=<BMxBN> warps=<w> stages=<s> groups=<g> registers=<r> kernel_ms=<ms> flash_ms=<ms> ratio=<kernel / flash>
max_diff=<largest difference from the default launch's sums>`` (``failed`` where the compiler refuses a choice: out
of shared memory or registers). Ends with ``best tile=... warps=... stages=... groups=... registers=...``, the
fastest choice whose sums equal the default's (1e-4 of a row's, every statistic). Needs a CUDA GPU; the baseline
and every choice are timed in the same process.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tiles", nargs="*", default=["64x64", "128x64", "64x128", "128x128"])
    parser.add_argument("--warps", nargs="*", type=int, default=[4, 8])
    parser.add_argument("--stages", nargs="*", type=int, default=[1, 2, 3, 4])
    parser.add_argument("--groups", nargs="*", type=int, default=[1, 4],
                        help="row groups that add their column sums apart (kernels.row_groups; 4: a warp each)")
    parser.add_argument("--registers", nargs="*", type=int, default=[0],
                        help="caps on a thread's registers (0: none; kernels.launch's registers)")
    args = parser.parse_args()

    from attnviz import settings
    from attnviz.core.kernel import kernels, lse as attention
    from attnviz.core.record.pooled import pool_factor

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    n, h, hk, d = args.n, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(1, h, n, d, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, hk, n, d, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, hk, n, d, device=device, dtype=torch.bfloat16, generator=gen)
    scaling = d ** -0.5
    factor = pool_factor(n, 512)
    shape = (-(-n // factor), -(-n // factor))
    delim = torch.zeros(n, device=device)

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    flash_ms = timed(lambda: attention.attention_with_lse(q, k, v, None, scaling, True))
    _, lse = attention.attention_with_lse(q, k, v, None, scaling, True)
    print(f"# {torch.cuda.get_device_name()} capability={torch.cuda.get_device_capability()} n={n} heads={h}/{hk} "
          f"d={d} flash_ms={flash_ms:.2f}", flush=True)

    def run(bm: int, bn: int):
        ends = torch.arange(bm, n + bm, bm, device=device)
        ranges = torch.stack([torch.zeros_like(ends), ends.clamp(max=n)], dim=-1).to(torch.int32)
        return kernels.layer_statistics(q[0], k[0], None, ranges, scaling, delim, factor, shape, causal=True,
                                        lse=lse[0], block=(bm, bn))


    reference = None
    best = None
    for tile, warps, stages, groups, cap in itertools.product(args.tiles, args.warps, args.stages, args.groups,
                                                              args.registers):
        bm, bn = (int(x) for x in tile.split("x"))
        if bm % (16 * groups):
            continue
        settings.use(settings.active().replace(kernel_warps=warps, kernel_stages=stages, kernel_groups=groups,
                                               kernel_registers=cap))  # what ATTNVIZ_KERNEL_* would hand the library
        try:
            got = run(bm, bn)
            ms = timed(lambda: run(bm, bn))
        except Exception as err:  # noqa: BLE001 - a choice the compiler refuses is a line, not the end of the sweep
            print(f"sweep tile={tile} warps={warps} stages={stages} groups={groups} registers={cap} failed "
                  f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}", flush=True)
            continue
        if reference is None:
            reference = got
        diff = max(float(((got[key] - reference[key]).abs() / reference[key].abs().clamp(min=1.0)).max())
                   for key in ("rowsum", "plogp", "diag", "key0", "colsum", "pooled"))
        print(f"sweep tile={tile} warps={warps} stages={stages} groups={groups} registers={cap} kernel_ms={ms:.2f} "
              f"flash_ms={flash_ms:.2f} ratio={ms / flash_ms:.2f} max_diff={diff:.1e}", flush=True)
        if diff <= 1e-4 and (best is None or ms < best[0]):
            best = (ms, tile, warps, stages, groups, cap)
    if best is not None:
        print(f"best tile={best[1]} warps={best[2]} stages={best[3]} groups={best[4]} registers={best[5]} "
              f"kernel_ms={best[0]:.2f} ratio={best[0] / flash_ms:.2f}", flush=True)


if __name__ == "__main__":
    main()
