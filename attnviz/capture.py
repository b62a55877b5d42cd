"""``capture(loaded, text, recipe, keep)`` → a :class:`~attnviz.captured.Capture`: the one object metrics, figures
and pages read (what it holds, and its file: :mod:`attnviz.captured`). :func:`prepare` decides everything before a
capture runs and raises every refusal; its ``run()`` is the capture.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from attnviz import recipe as recipe_mod
from attnviz.core.spec import arch as arch_mod
from attnviz.core.model import devices
from attnviz.core.record import recorders
from attnviz.core.record.packed import Packed, PackedMaps
from attnviz.core import engine
from attnviz.core.spec import syntax
from attnviz.core.loading import models
from attnviz.core.loading.models import LoadedModel
from attnviz.errors import InputError
from attnviz import plan as plan_mod
from attnviz.core.sizing.sizes import Masks, Shape
from attnviz.plan import Budget, Keep, Plan
from attnviz.tokens import prefix_ids, tokenize  # noqa: F401 - text → tokens, the flow's first step
from attnviz.recipe import Recipe

from attnviz.captured import Activations, Capture, QKV  # noqa: F401 - the capture's type, read here by its callers


def parse_layers(layers, n_layers: int) -> list[int]:
    """The recorded layers, in the one layer-list syntax (:func:`attnviz.core.spec.syntax.layers`): ``None``/"all"
    → every layer; "0,5,-1", "20-29" or a list → those layers (negative counts from the top)."""
    return syntax.layers(layers, n_layers)


def versions() -> dict[str, str]:
    """The versions a capture's metadata records (attnviz, torch, transformers, numpy, Python)."""
    import transformers

    from attnviz import __version__

    return {"attnviz": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": np.__version__, "python": platform.python_version()}


def capture(loaded: LoadedModel, text: str, recipe: "str | arch_mod.Architecture | Recipe" = "fwd",
            keep: Keep | None = None, max_tokens: int | None = None, on_layer=None) -> Capture:
    """Run ``text`` through the model under ``recipe`` and keep what ``keep`` asks (full maps of every
    layer by default).

    ``recipe`` is a :class:`~attnviz.recipe.Recipe` (architecture, intervention, BOS control and residual
    variant together: ``Recipe.of(loaded, arch, intervene=..., prepend=..., residual=...)``) or an
    architecture string; the capture carries its recipe. ``keep`` (:class:`attnviz.plan.Keep`) says what to
    keep: layers, full maps or statistics, pooled maps, extras, checkpoints, storage dtype; the plan sizes it
    (:func:`prepare` refuses, before running, what the device cannot hold).
    ``on_layer(i)`` is called after each layer (progress); ``max_tokens`` caps the text below the model's own
    limit. A residual variant's layer loop has no hidden-state outputs, so hidden states and activations are
    refused with it, and it keeps no checkpoints. The same as ``prepare(...).run(on_layer)`` (:func:`prepare`).
    """
    return prepare(loaded, text, recipe, keep, max_tokens=max_tokens).run(on_layer)


@dataclass(frozen=True)
class Prepared:
    """A capture made ready to run (:func:`prepare`): the text's tokens, the recipe made real, the model's shape and
    recorded layers, and what the capture keeps and will hold (``plan``: the plan's answer under a budget, or the
    keep as asked), already checked against the device. :meth:`run` runs it (as often as asked: each run records
    afresh); ``key`` names what it makes (a cache key), ``label`` what runs (a progress bar's)."""

    loaded: LoadedModel = field(repr=False)
    text: str
    built: recipe_mod.Built
    ids: tuple[int, ...]
    tokens: tuple[str, ...]
    shape: Shape = field(repr=False)
    layers: tuple[int, ...]
    plan: Plan

    @property
    def keep(self) -> Keep:
        return self.plan.keep

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    @property
    def key(self) -> tuple:
        """(recipe key, text, keep) without the checkpoints (they only speed a region up)."""
        return self.built.recipe.key, self.text, replace(self.keep, checkpoints=0)

    @property
    def label(self) -> str:
        """What runs, for a progress bar: "Capturing fwd with ablate(...) (long text: statistics and pooled maps)"."""
        recipe = self.built.recipe
        return (f"Capturing {recipe.arch}" + (f" with {recipe.intervene}" if recipe.intervene else "")
                + ("" if self.keep.full_maps else " (long text: statistics and pooled maps)"))

    def run_reporting(self, progress) -> Capture:
        """:meth:`run`, reporting ``progress(done, total)`` after each layer (the form a progress bar takes)."""
        total = self.loaded.n_layers
        return self.run(lambda layer: progress(layer + 1, total))

    def run(self, on_layer=None) -> Capture:
        """The capture: one forward under the recipe, recorded as planned (fresh recorders each run);
        ``on_layer(i)`` after each layer."""
        loaded, keep, built = self.loaded, self.keep, self.built
        record = keep.record(self.shape, list(self.tokens), list(self.layers), on_layer,
                             kept=None if built.variant is None else ())
        variant, architecture, acts = built.variant, built.architecture, built.interventions
        prepend = built.recipe.prepend
        layers = sorted(record.layers)
        states = keep.hidden_states or keep.activations
        t0 = time.perf_counter()
        with devices.out_of_memory_explained(f"a capture of {len(self.ids)} tokens, {len(layers)} layers recorded "
                                             f"({keep.describe()})"):
            logits, layer_states, run = built.forward(
                loaded, torch.tensor([self.ids]), record,
                engine.Feed(hidden_states=states, last_logits_only=variant is None))
        forward_s = time.perf_counter() - t0
        logits = logits[0, -1].float()
        return Capture(
            text=self.text, tokens=list(self.tokens), token_ids=list(self.ids), arch=architecture.spec,
            layer_masks=architecture.layer_names, layers=layers, kv_groups=loaded.kv_groups,
            allowed=run.host_allowed(layers), head_allowed=run.head_allowed(layers),
            probs=PackedMaps({l: p if isinstance(p, Packed) else recorders.on_host(p[0])
                              for l, p in run.probs.items()}),
            stats={l: run.reduced[l] for l in run.reduced},
            next_logprobs=torch.log_softmax(logits, -1).cpu().numpy(),
            hidden=(torch.stack([h[0] for h in layer_states]).to(torch.float16).cpu().numpy()
                    if keep.hidden_states else None),
            scores={l: recorders.on_host(run.scores[l][0]) for l in run.scores},
            value_norm={l: run.value_norms[l][0].cpu().numpy() for l in run.value_norms},
            learned_sink={l: share[0] for l, share in run.results("learned_sink").items()},
            activations=Activations.from_hidden(layer_states) if keep.activations else None,
            qkv={l: QKV(q[0].numpy(), k[0].numpy(), v[0].numpy(), float(scale))
                 for l, (q, k, v, scale) in run.qkv.items()},
            checkpoints=dict(run.checkpoints), recipe=built.recipe,
            timing={"forward_s": forward_s, "total_s": time.perf_counter() - t0},
            meta={"model": loaded.model_id, "model_file": loaded.model_file, "dtype": built.recipe.dtype,
                  "storage_dtype": str(keep.storage_dtype).replace("torch.", ""), "device": str(loaded.model.device),
                  "n_layers": loaded.n_layers, "n_heads": loaded.n_heads, "n_kv_heads": loaded.n_kv_heads,
                  **({"residual": variant.name} if variant is not None else {}),
                  **({"intervene": acts.spec} if acts else {}), **({"prepend": prepend} if prepend else {}),
                  # a fused launch that failed in this run: those layers took the block engine (the same numbers)
                  **({"fused_fallback": [f"{' '.join(map(str, where))}: {why}"
                                         for where, why in getattr(run, "fused_failed", {}).items()]}
                     if getattr(run, "fused_failed", None) else {}),
                  "versions": versions()},
        )


def prepare(loaded: LoadedModel, text: str, recipe: "str | arch_mod.Architecture | Recipe" = "fwd",
            keep: Keep | None = None, budget: Budget | None = None, max_tokens: int | None = None) -> Prepared:
    """Everything a capture decides before it runs, in one call, in the flow's order: the text's tokens (under the
    recipe's BOS control, :func:`attnviz.tokens.tokenize`), the recipe made real (:func:`attnviz.recipe.build`),
    what the plan reads once (the model's :class:`~attnviz.core.sizing.sizes.Shape`, the recorded layers, what the recipe's
    masks make a capture hold), then the plan under ``budget``, checked against the device
    (:func:`attnviz.plan.decide`: what a long text keeps instead of full maps, or a refusal that says what would fit;
    without a budget, ``keep`` as asked). Every refusal is raised here, before anything runs; the app asks this once
    and runs the answer in its job queue (:meth:`Prepared.run`). ``max_tokens`` (or ``budget.max_tokens``) caps the
    text's tokens below the model's own limit."""
    models.require(loaded, "capture")
    if not isinstance(text, str):
        raise InputError(f"capture takes the text as a str, not a {type(text).__name__}")
    keep = Keep() if keep is None else keep
    if not isinstance(keep, Keep):
        raise InputError(f"capture's keep is an attnviz.Keep (what to keep), not a {type(keep).__name__}")
    prepend = recipe.prepend if isinstance(recipe, Recipe) else None  # the BOS control is the recipe's own
    ids, tokens = tokenize(loaded, text, max_tokens if budget is None else budget.max_tokens, prepend)
    built = recipe_mod.build(loaded, recipe).check_text(len(ids))
    variant = built.variant
    if variant is not None and (keep.hidden_states or keep.activations):
        raise InputError(f"hidden states are not recorded under the residual variant {variant.name}")
    if keep.value_norms:  # refused here where the output projection cannot be read, not in the middle of the run
        modules = engine.attention_modules(loaded.model)  # none for an encoder-decoder: the run refuses it
        if modules:
            engine.output_projection(modules[0])
    shape = Shape.of(loaded)
    recorded = keep.recorded(shape.n_layers)
    masks = Masks.of(shape, built)
    planned = plan_mod.decide(shape, len(ids), keep, masks, recorded, budget, built.recipe.residual)
    return Prepared(loaded, text, built, tuple(ids), tuple(tokens), shape, tuple(recorded), planned)
