"""Which capability works on which decoder family, asked of the code itself (docs/support.md is this table).

Each capability's column is ✓ or the one line it refuses that family with: the model anatomy
(:mod:`attnviz.core.model.anatomy`) for ``patch``, the causal check and resuming a forward; the check of a layer's
queries and keys (:mod:`attnviz.effects.schemes`) for score attribution; seed 003's conditions
(:func:`attnviz.core.engine.residual.why_not`) for residual variants. Maps and every architecture run on any decoder
whose attention goes through transformers' attention interface (loading refuses the others).
"""

from __future__ import annotations

from attnviz.errors import AttnvizError

CAPABILITIES = ("maps, any mask", "patch", "score attribution, diagnosis, query-key view", "causal check",
                "resume from a layer (regions)", "residual variants", "bfloat16: attribution, patch, routes")
HALF = CAPABILITIES[-1]
TEXT = "A short text to read the layers by."


def row(loaded) -> dict[str, str]:
    """Each capability's verdict on ``loaded``: "✓" or the reason it is refused."""
    from attnviz.core.model import anatomy
    from attnviz.core.engine import residual
    from attnviz.effects.explain import KeptForward

    out = {CAPABILITIES[0]: "✓"}
    try:
        found = anatomy.of(loaded.model)
    except AttnvizError as err:
        reason = _short(err)
        return {**out, **{c: reason for c in CAPABILITIES[1:]}}  # bfloat16 too: nothing is mapped
    out["patch"] = "✓"
    try:
        run = KeptForward(loaded, TEXT, "fwd")
        for layer in range(loaded.n_layers):
            run.layer_parts(layer)
        attribution = "✓"
    except AttnvizError as err:
        attribution = _short(err)
    out[CAPABILITIES[2]] = attribution
    out["causal check"] = attribution  # it patches the sources attribution names
    out[CAPABILITIES[4]] = "✓" if found.resumable else _short(found.why_not_resumable)
    out["residual variants"] = residual.why_not(found) or "✓"
    out[HALF] = half(loaded) if attribution == "✓" else f"attribution as in float32; {half(loaded, False)}"
    return out


def in_dtype(loaded, dtype):
    """A copy of ``loaded`` in ``dtype``, its anatomy found again in that dtype."""
    import copy

    from attnviz.core.loading.models import LoadedModel

    model = copy.deepcopy(loaded.model)
    model.__dict__.pop("_attnviz_anatomy", None)
    return LoadedModel(model.to(dtype), loaded.tokenizer, f"{loaded.model_id} ({dtype})", None, 0.0)


def half(loaded, attribution: bool = True) -> str:
    """Whether score attribution (where ``attribution``), ``patch`` and routes run on ``loaded`` cast to bfloat16 on
    the CPU: "✓" or the first refusal (docs/methods.md#devices; ``tests/test_conformance.py`` compares their numbers
    with float32's)."""
    import torch

    from attnviz.capture import capture
    from attnviz.effects.explain import KeptForward
    from attnviz.flow.trace import trace
    from attnviz.plan import Keep
    from attnviz.recipe import Recipe

    bf16 = in_dtype(loaded, torch.bfloat16)
    try:
        if attribution:
            run = KeptForward(bf16, TEXT, "fwd")
            for layer in range(bf16.n_layers):
                run.layer_parts(layer)
        capture(bf16, TEXT, Recipe.of(bf16, "fwd", intervene="patch(block=mlp, tokens=sink)@0"),
                Keep(statistics=("alpha",)))
        trace(bf16, TEXT)
    except AttnvizError as err:
        return _short(err)
    return "✓" if attribution else "patch and routes ✓"


def _short(reason) -> str:
    return str(reason).replace("score attribution: ", "").replace("|", "/").strip()


def table(models: dict[str, object]) -> str:
    """The markdown table of :func:`row` for ``models`` (family → loaded model), in their order."""
    lines = ["| family | " + " | ".join(CAPABILITIES) + " |", "|---|" + "---|" * len(CAPABILITIES)]
    for family, loaded in models.items():
        verdicts = row(loaded)
        lines.append(f"| {family} | " + " | ".join(verdicts[c] for c in CAPABILITIES) + " |")
    return "\n".join(lines) + "\n"
