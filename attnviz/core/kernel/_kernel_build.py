"""The fused statistics kernel compiled ahead of time for an NVIDIA GPU, on any machine: what
:func:`attnviz.core.kernel.kernels.compiled_resources` runs in a child process (Triton's interpreter off)."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

from attnviz.core.kernel import kernels

# the integer arguments a long-context launch passes as multiples of 16 (32,768 tokens, head dim 128,
# a 512-cell pooled map): Triton's launcher specialises such arguments and 16-byte aligned pointers
# (torch's allocations are), so the variant compiled here is the one a GPU runs
ALIGNED = {"n_q", "n_kv", "dim", "stride_qh", "stride_qn", "stride_kh", "stride_kn", "factor", "pooled_rows",
           "pooled_cols"}


def tile_loops(sass: str) -> list[dict]:
    """Every loop of a disassembled kernel (a branch back to a label above it), in address order: its
    ``instructions`` and the count of each opcode (``ops``, without modifiers)."""
    labels, body = {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(body)
        op = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if op:
            body.append(op.group(1).strip())
    loops = []
    for end, text in enumerate(body):
        back = re.search(r"BRA `?\(?(\.L_x_\d+)", text)
        if back and labels.get(back.group(1), end + 1) <= end:
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0]
                                      for i in body[labels[back.group(1)]:end + 1])
            loops.append({"instructions": sum(ops.values()), "ops": dict(ops)})
    return [loop for loop in loops if loop["instructions"] > 1]  # not the trap's self-loop


def resources(capability: int = 90, dtype: str = "bf16", head_dim: int = 128, pool: bool = True,
              value: bool = False, scores: bool = False, causal: bool = True, granularity: int = 16,
              num_warps: int | None = None, lse: bool = True, whole: bool = True, aligned: bool = True,
              tile: tuple[int, int] | None = None, num_stages: int | None = None,
              split: int | None = None, maxnreg: int | None = None) -> dict:
    """One variant of :func:`attnviz.core.kernel.kernels.compiled_resources`, in this process; ``num_warps`` None:
    what :func:`attnviz.core.kernel.kernels.num_warps` launches on a GPU of that capability. ``aligned`` False: the variant
    a text whose length is not a multiple of 16 launches (only the pointers and the head dimension's strides are).
    ``tile`` (BM, BN) and ``num_stages``: a launch choice of :data:`attnviz.core.kernel.kernels.TUNED` (default: the
    kernel's 64 x 64 and Triton's default stages); ``split`` the row groups (None: what
    :func:`attnviz.core.kernel.kernels.row_groups` launches); ``maxnreg`` a cap on a thread's registers (the launch's
    ``registers``)."""
    if num_warps is None:
        num_warps = kernels.warps_for(capability, dtype == "fp32")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = kernels.kernel()
    bm, bn = tile or (kernels.BLOCK_M, kernels.BLOCK_N)
    if split is None:
        split = kernels.row_groups(capability, dtype == "fp32", bm, num_warps)
    constants = kernels.constants(bm, bn, head_dim, dtype == "fp32", granularity, pool,
                                   value, scores, causal, lse, whole, split)
    pointers = {"q_ptr": dtype, "k_ptr": dtype, "allow_ptr": "i32", "ranges_ptr": "i32"}
    signature = {name: "constexpr" if name in constants else
                 "*" + pointers.get(name, "fp32") if name.endswith("_ptr") else
                 "fp32" if name == "scale" else "i32" for name in kernel.arg_names}
    aligned_ints = ALIGNED if aligned else {"dim", "stride_qh", "stride_qn", "stride_kh", "stride_kn"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if name not in constants and (name.endswith("_ptr") or name in aligned_ints)}
    options = {"num_warps": num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
               **({} if maxnreg is None else {"maxnreg": maxnreg})}
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", capability, 32),
                              options=options)
    return read(compiled, capability, num_warps)


def read(compiled, capability: int, num_warps: int) -> dict:
    """What ptxas allocates for a Triton kernel ``compiled`` for an NVIDIA GPU of ``capability`` at ``num_warps``
    (registers, spills, shared memory, programs an SM holds) and its tile loops' instructions and barriers: the
    statistics kernel's (:func:`resources`) or another package's (the routes kernel's,
    :func:`attnviz.flow.contributions.kernel_resources`, named by its caller: this package imports nothing above it)."""
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas

    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        log = subprocess.run([get_ptxas(capability).path, f"-arch={arch}", "-v", ptx, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([knobs.nvidia.nvdisasm.path, "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    stores, loads = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups())
    loops = tile_loops(sass)
    shared = compiled.metadata.shared
    return {"num_warps": num_warps, "registers": registers, "spill_stores": stores, "spill_loads": loads,
            "shared": shared, "programs_per_sm": kernels.programs_per_sm(capability, registers, shared, num_warps),
            "tile_instructions": [loop["instructions"] for loop in loops],
            "tile_barriers": [loop["ops"].get("BAR", 0) for loop in loops]}
