"""``attnviz doctor``: whether attnviz is right, and how fast, on this machine and this model.

Run it first on a GPU (docs/gpu.md). Every correctness check is PASS, FAIL or SKIP (with why), and carries
what it compared, what it measured, its limit and why the limit is what it is; the command exits 0 only when
no correctness check failed. Speed is reported, never judged: a speed check is TIME, with its ratio and the
ratio attnviz is built to stay under, and a plain "slower than expected" when the ratio is above it. A slow
machine is not a broken install (a 2-core Xeon with AMX runs stock bfloat16 SDPA several times faster than
the statistics route, which has no AMX path), so no timing can make the command exit non-zero.
``--json`` prints the whole report, to paste into a bug report.

1. **Environment**: torch, transformers, Triton and attnviz versions; every device with its free
   memory; the device and dtype the model runs in.
2. **Equivalence** on a short text of the model's own tokenizer (Python's reference docs). Routes are
   compared where they must agree, **layer by layer with the same layer input** (docs/methods.md#devices):
   the input every decoder layer received in attnviz's route is fed to the same layer of the reference
   (stock transformers' eager ``output_attentions``, or the full maps), so only one layer's rounding
   separates them, never the drift of hidden states through every layer below. In half precision that
   drift is larger than any sensible limit (stock bfloat16 itself differs from stock float32 by ~0.04 in
   a probability over 30 layers), while one layer's rounding is a couple of steps of the dtype:
   - full maps of every layer (the block engine) and every layer's output;
   - the top layer alone, and the outputs of the layers under it, which run through SDPA;
   - end to end in float32 (the model cast for the check when it runs in half precision): the whole
     forward, no input fed, within 1e-4: what catches an error that only shows across layers;
   - every statistic of a statistics capture against its numpy definition on the full maps;
   - long mode: pooled maps against the max-pooled full maps;
   - on CUDA, the fused kernel's statistics and pooled maps against the same definitions, on a 192-token
     text so that its one-cell pooling and, in half precision, its full tiles run (a kernel that does not
     compile or launch is a FAIL that names the fallback attnviz then uses: the block engine).
3. **Speed** on a ``tokens``-long text (at most the model's own limit): a statistics capture against a
   plain SDPA forward of the same tokens. Each timed window repeats the call until the plain forward has
   run for at least a quarter of a second (a small model's forward on a GPU takes milliseconds), timed
   with CUDA events on a GPU; on CUDA also the fused kernel against the block engine. Each is a TIME line
   (ratio, expected ratio, and "slower than expected" above it), never a FAIL.

Tolerances (:func:`tolerance`): 1e-4 in float32 (docs/methods.md#devices); two steps of the dtype at 1 in
bfloat16 (0.0156) and float16 (0.00195): each route rounds a layer's probabilities once in the dtype (half
a step at 1) and may round its scores differently by a step. Relative errors of outputs use the same
number, relative to the output's norm.

The checks live by family, one module each, and run in the order of one list (:data:`FAMILIES`, ``checks.py``):
``report.py`` (:class:`Check`, :class:`Report`), ``machine.py`` (the device, the environment), ``compare.py`` (limits,
the text, differences), ``layers.py`` (layer inputs kept and fed, stock eager, casts: every hook through the
engine's named sites, :mod:`attnviz.core.engine.sites`), ``routes.py`` (each route against stock eager), ``fused.py`` (the
fused kernel), ``pages.py`` (what the deepest pages run), ``timing.py`` (speed). A check picks its route by argument
(:func:`attnviz.core.engine.routes.forcing`), never by editing the environment.
"""

from __future__ import annotations

from attnviz.doctor.checks import FAMILIES, Family, equivalence, run
from attnviz.doctor.compare import EQUIVALENCE_TOKENS, FP16_STEP, FP32_TOLERANCE, text_of, tolerance
from attnviz.doctor.fused import FUSED_NAMES, FUSED_POOL, FUSED_TOKENS, fused_kernel
from attnviz.doctor.layers import LayerIO, layer_io, stock
from attnviz.doctor.machine import environment, pick_device
from attnviz.doctor.pages import ATTRIBUTION_HALF, capabilities
from attnviz.doctor.report import Check, Report
from attnviz.doctor.routes import float32_end_to_end
from attnviz.doctor.timing import MAX_REPEATS, MIN_WINDOW_S, SPEED_EXPECTED, repeats_for, speed

__all__ = ["ATTRIBUTION_HALF", "Check", "EQUIVALENCE_TOKENS", "FAMILIES", "FP16_STEP", "FP32_TOLERANCE", "FUSED_NAMES",
           "FUSED_POOL", "FUSED_TOKENS", "Family", "LayerIO", "MAX_REPEATS", "MIN_WINDOW_S", "Report", "SPEED_EXPECTED",
           "capabilities", "environment", "equivalence", "float32_end_to_end", "fused_kernel", "layer_io",
           "pick_device", "repeats_for", "run", "speed", "stock", "text_of", "tolerance"]
