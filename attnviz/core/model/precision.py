"""How close two numbers must be, by the dtype the model ran in (docs/methods.md#devices).

One place for every limit a check of attnviz's arithmetic uses, so that rounding in half precision is never
reported as an architecture (a layer that "does not add up") and float32 keeps its tight limit:

- :func:`tolerance`: one layer's numbers computed by two routes fed the same input (the doctor's limit): 1e-4 in
  float32, two steps of the dtype at 1 in bfloat16 (0.0156) and float16 (0.00195);
- :func:`decomposition_tolerance`: a decomposition computed in float32 from a run's own activations against what
  the run itself computed (score attribution's queries and keys against the module's, routes' heads against the
  attention's output): 1e-4 in float32; four steps in half precision (bfloat16 0.031, float16 0.0039), since
  the run rounded each of its own products once or twice where the float32 decomposition did not (measured on the
  default model in bfloat16: 0.003 relative for the queries and keys, 0.011 per row for the heads' outputs);
- :func:`stream_rounding`: what the residual stream's own rounding adds to a difference taken from it (a write
  read back as ``out - in`` of a stream of massive activations is rounded by the stream's size, not the write's).

A wrong decomposition misses by far more than any of these: a missing rotation by 0.3 to 0.6, a latent
attention's norm by more than 0.05 in float32.
"""

from __future__ import annotations

import torch

FP32_TOLERANCE = 1e-4


def name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def half(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a half-precision float (bfloat16, float16)."""
    return dtype in (torch.bfloat16, torch.float16)


def step(dtype: torch.dtype) -> float:
    """One step of ``dtype`` at 1 (its machine epsilon)."""
    return float(torch.finfo(dtype).eps)


def tolerance(dtype: torch.dtype) -> tuple[float, str]:
    """The limit for one layer's numbers computed in ``dtype`` by two routes fed the same layer input, and why."""
    if not half(dtype):
        return FP32_TOLERANCE, "float32: 1e-4 (docs/methods.md#devices)"
    limit = 2 * step(dtype)
    n = name(dtype)
    return limit, (f"two {n} steps at 1 ({limit:.3g}): both routes get the same layer input, so only one "
                   f"layer's rounding in {n} separates them (a probability is held to half a step, and the "
                   "scores under it may round a step apart)")


def decomposition_tolerance(dtype: torch.dtype) -> float:
    """The relative limit for a float32 decomposition of a run in ``dtype`` against the run's own numbers."""
    return FP32_TOLERANCE if not half(dtype) else 4 * step(dtype)


def stream_rounding(dtype: torch.dtype, size) -> "float | torch.Tensor":
    """What rounding a stream of ``size`` (a norm or a per-row maximum) to ``dtype`` can move a difference taken
    from it by: two steps of the stream's size (0 in float32, where the stream's rounding is below any limit)."""
    return 0.0 * size if not half(dtype) else 2 * step(dtype) * size
