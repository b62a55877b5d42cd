"""The fused statistics kernel (:mod:`attnviz.core.kernel.kernels`) at the geometry a long text launches, against the
statistics' definitions and the max-pooled full maps, each layer fed the same input; a kernel that does not compile
or run here is a FAIL that names the fallback (the block engine)."""

from __future__ import annotations

import torch

from attnviz.core.kernel import kernels
from attnviz.core.loading.models import LoadedModel
from attnviz.core.engine.routes import forcing
from attnviz.doctor.compare import FP16_STEP, pooled_error, statistics_error, text_of
from attnviz.doctor.layers import layer_io
from attnviz.doctor.report import Check

FUSED_TOKENS = 192  # three of the kernel's 64-row blocks: the last two have full tiles below the diagonal
FUSED_POOL = 3  # cells a side: a factor of 64 at 192 tokens, so each of the kernel's 64 x 64 tiles pools to one cell
FUSED_NAMES = ("statistics, fused kernel vs their definitions on the full maps",
               "pooled maps, fused kernel vs max-pooled full maps")


def fused_kernel(loaded: LoadedModel, limit: float, why: str, force: bool = False) -> list[Check]:
    """On CUDA (or with ``force``, in Triton's interpreter), the fused statistics kernel at the geometry a long
    text launches: a 192-token text, so most rows see full tiles below the diagonal (in half precision: a float32
    kernel masks every tile), and a 3-cell map, so each 64 x 64 tile pools to one cell; every statistic against
    its definition on the full maps and every pooled cell against the maximum of its full-map cells, each layer
    fed the same input (a model shorter than 192 tokens: as long as it takes). A kernel that does not
    compile or run is a FAIL (attnviz falls back to the block engine)."""
    from attnviz.capture import capture
    from attnviz.plan import Keep

    model = loaded.model
    if not ((force or str(model.device).startswith("cuda")) and kernels.available()):
        return [Check(name, "SKIP", detail="needs CUDA and Triton (on a CPU the tests run it through Triton's "
                                           "interpreter)") for name in FUSED_NAMES]
    n = min(FUSED_TOKENS, loaded.max_tokens)
    text, same = text_of(loaded, n), "fed the same layer input"
    with layer_io(model) as ours:
        cap = capture(loaded, text, "fwd", Keep(storage_dtype=torch.float32))
    try:  # each capture tries the kernel afresh (a failed launch is off for its own run only): whether it runs here
        with forcing(fused=True), layer_io(model, feed=ours.inputs):  # is the finding
            fused = capture(loaded, text, "fwd", Keep(statistics=True, pool=FUSED_POOL, storage_dtype=torch.float32))
        problem = "; ".join(fused.meta.get("fused_fallback", ())) or None
    except Exception as err:  # noqa: BLE001 - a kernel that fails here is the finding
        fused, problem = None, f"{type(err).__name__}: {err}"
    if fused is None or problem is not None:
        problem = problem or "no result"
        return [Check(name, "FAIL", detail=f"the fused kernel failed ({problem.splitlines()[0][:200]}); attnviz "
                                           "falls back to the block engine, which computes the same statistics, "
                                           "slower") for name in FUSED_NAMES]
    worst, where = statistics_error(fused, cap, cap.layers)
    checks = [Check.against(FUSED_NAMES[0], worst, limit, detail=where, why=why,
                            compared=f"every statistic of the fused Triton kernel and its numpy definition on the "
                                     f"full maps of a {n}-token text, {same}")]
    worst, where = pooled_error(fused, cap, FUSED_POOL)
    checks.append(Check.against(FUSED_NAMES[1], worst, max(limit, FP16_STEP), detail=where,
                                why=why + "; and one float16 step (2^-10): pooled maps are kept in float16",
                                compared=f"each pooled cell of the fused kernel and the maximum of its full-map "
                                         f"cells, {same}"))
    return checks
