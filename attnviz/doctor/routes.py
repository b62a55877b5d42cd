"""Each route against stock eager attention or the statistics' definitions, layer by layer with the same layer input
(docs/methods.md#devices): the block engine's full maps and layer outputs, the top layer recorded alone over layers
that run through SDPA, the block engine's statistics and pooled maps; and the whole forward in float32. Each check
takes its route by argument (:func:`attnviz.core.engine.routes.forcing`), never through the environment."""

from __future__ import annotations

import torch

from attnviz.core.engine.routes import forcing
from attnviz.core.loading.models import LoadedModel
from attnviz.doctor.compare import (FP16_STEP, FP32_TOLERANCE, dtype_name, max_diff, pooled_error, relative,
                                    statistics_error)
from attnviz.doctor.layers import LayerIO, in_float32, layer_io, stock
from attnviz.doctor.report import Check

SAME = "fed the same layer input"


def block_engine(loaded: LoadedModel, text: str, limit: float, why: str) -> tuple[list[Check], object, LayerIO]:
    """Full maps of every layer (the block engine) and every layer's output against stock eager's, each layer fed
    the input it had in attnviz's route; with the capture and those inputs, which the statistics are checked on."""
    from attnviz.capture import capture
    from attnviz.plan import Keep

    name = dtype_name(loaded.model.dtype)
    with layer_io(loaded.model) as ours:
        cap = capture(loaded, text, "fwd", Keep(storage_dtype=torch.float32))
    maps, theirs = stock(loaded, cap.token_ids, feed=ours.inputs)
    worst = max(max_diff(cap.layer_probs(l), maps[l], cap.allowed[l]) for l in cap.layers)
    checks = [Check.against(f"maps of every layer vs stock eager ({name}, block engine)", worst, limit, why=why,
                            compared=f"attnviz's full maps and stock eager output_attentions, each layer {SAME}")]
    worst = relative(ours.outputs, theirs.outputs, cap.layers)
    checks.append(Check.against(f"layer outputs vs stock eager ({name}, block engine, relative)", worst, limit,
                                why=why, compared=f"every decoder layer's output, attnviz's route and stock eager, "
                                                  f"{SAME}; relative to the output's norm"))
    return checks, cap, ours


def top_layer(loaded: LoadedModel, text: str, limit: float, why: str) -> list[Check]:
    """The top layer recorded alone against stock eager, and the outputs of the layers under it, which attnviz runs
    through SDPA."""
    from attnviz.capture import capture
    from attnviz.plan import Keep

    top = loaded.n_layers - 1
    with layer_io(loaded.model) as ours:
        only = capture(loaded, text, "fwd", Keep(layers=[top], storage_dtype=torch.float32))
    maps, theirs = stock(loaded, only.token_ids, feed=ours.inputs)
    worst = max_diff(only.layer_probs(top), maps[top], only.allowed[top])
    checks = [Check.against("top layer after SDPA layers vs stock eager", worst, limit, why=why,
                            compared=f"the top layer recorded alone, the layers under it unrecorded; its map and "
                                     f"stock eager's, {SAME}")]
    if top > 0:
        worst = relative(ours.outputs, theirs.outputs, range(top))
        checks.append(Check.against("unrecorded (SDPA) layers' outputs vs stock eager (relative)", worst, limit,
                                    why=why, compared=f"the output of every layer under the top one, which attnviz "
                                                      f"runs through SDPA, and stock eager's, {SAME}"))
    return checks


def block_statistics(loaded: LoadedModel, text: str, cap, ours: LayerIO, limit: float, why: str) -> list[Check]:
    """A statistics capture forced onto the block engine, every statistic against its definition on the full maps
    ``cap`` and every pooled cell against the maximum of its full-map cells; each layer fed its input in ``ours``."""
    from attnviz.capture import capture
    from attnviz.plan import Keep

    dtype = loaded.model.dtype
    with forcing(fused=False), layer_io(loaded.model, feed=ours.inputs):
        blocks = capture(loaded, text, "fwd", Keep(statistics=True, pool=8, storage_dtype=torch.float32))
    worst, where = statistics_error(blocks, cap, cap.layers)
    checks = [Check.against("statistics, block engine vs their definitions on the full maps", worst, limit,
                            detail=where, why=why,
                            compared=f"every statistic of a statistics capture (block engine) and its numpy "
                                     f"definition on the full maps, {SAME}")]
    # pooled maps are kept in float16 (docs/methods.md#devices)
    worst, _ = pooled_error(blocks, cap, 8, floor=1e-4, relative=dtype == torch.float32)
    if dtype == torch.float32:
        checks.append(Check.against("long mode: pooled maps vs max-pooled full maps (relative)", worst, FP16_STEP,
                                    why="one float16 step (2^-10), relative: pooled maps are kept in float16",
                                    compared=f"each pooled cell above 1e-4 and the maximum of its full-map cells, {SAME}"))
    else:
        checks.append(Check.against("long mode: pooled maps vs max-pooled full maps", worst, max(limit, FP16_STEP),
                                    why=why + "; absolute, since a step of a logit moves a small probability by a "
                                              "large fraction of itself",
                                    compared=f"each pooled cell above 1e-4 and the maximum of its full-map cells, {SAME}"))
    return checks


def float32_end_to_end(loaded: LoadedModel, text: str) -> Check:
    """The whole forward in float32, no layer input fed: attnviz's full maps of every layer against stock
    eager's, within 1e-4. A half-precision model is cast for it and back (bf16 → fp32 → bf16 is exact)."""
    from attnviz.capture import capture
    from attnviz.plan import Keep

    model = loaded.model
    dtype = model.dtype
    name = "maps of every layer vs stock eager (float32, end to end)"
    compared = "attnviz's full maps and stock eager output_attentions, each route running the whole forward"
    if getattr(model, "hf_device_map", None) and dtype != torch.float32:
        return Check(name, "SKIP", detail="a model spread by a device map is not cast to float32 here")
    with in_float32(model):
        cap = capture(loaded, text, "fwd", Keep(storage_dtype=torch.float32))
        maps, _ = stock(loaded, cap.token_ids)
    worst = max(max_diff(cap.layer_probs(l), maps[l], cap.allowed[l]) for l in cap.layers)
    return Check.against(name, worst, FP32_TOLERANCE, compared=compared,
                         why="float32: 1e-4 (docs/methods.md#devices), the whole forward: in float32 nothing drifts "
                             "that far, so an error that only shows across layers fails here"
                             + ("" if dtype == torch.float32 else f"; the {dtype_name(dtype)} model cast for it"))
