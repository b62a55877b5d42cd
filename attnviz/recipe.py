"""A :class:`Recipe`: everything that decides what a forward computes, as one frozen value.

Model, architecture, intervention, BOS control (prepend), residual variant and dtype travel together:
every library entry point takes a recipe (in place of an architecture string), every front end builds
one, and a :class:`~attnviz.capture.Capture` carries the recipe it was made with. Its :attr:`~Recipe.key`
is the cache key, the stem of file names and the viewer's payload identity; :meth:`~Recipe.describe`
is the provenance line that exports, reports and the viewer print; :meth:`~Recipe.to_dict` /
:meth:`~Recipe.from_dict` round-trip through npz metadata, Parquet rows and PDF/PNG metadata.

The choice "residual variant, else the engine" is made here, once (:func:`forward`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from attnviz.errors import InputError

if TYPE_CHECKING:
    import torch

    from attnviz.core.spec.arch import Architecture
    from attnviz.core.spec.interventions import Interventions
    from attnviz.core.loading.models import LoadedModel


@dataclass(frozen=True)
class Recipe:
    """What a forward computes. Strings are canonical once made by :meth:`of` (architecture and
    intervention parsed and written back, the residual variant the one that will run)."""

    model: str
    arch: str = "fwd"
    intervene: str = ""  # docs/methods.md#interventions, "" for none
    prepend: str | None = None  # docs/methods.md#bos-control: "bos", a token, or None
    residual: str | None = None  # docs/methods.md#residual-variants
    dtype: str | None = None  # the model's dtype, where known: it changes the numbers
    kind: str = ""  # docs/methods.md#attention-kinds: "" for the model's own (a softmax, gpt-oss's learned sink ...)

    @classmethod
    def of(cls, loaded: "LoadedModel", arch="fwd", intervene=None, prepend: str | None = None,
           residual: str | None = None, kind=None) -> "Recipe":
        """The canonical recipe of these settings on a loaded model (bad strings refused here). Nothing is
        made on the model's device: a residual variant is named, not built (:func:`build` builds it)."""
        return _canonical(loaded, arch, intervene, prepend, residual, kind)[0]

    @property
    def key(self) -> str:
        """A stable 16-hex-digit identity: equal recipes, equal keys, in every process."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        """One line of provenance: ``SmolLM2-135M · mask0-bidir(k=8) · sinkscale(key=0, beta=0.3)@20-29 · BOS``."""
        parts = [self.model.split(" ")[0], self.arch]
        if self.kind:
            parts.append(self.kind)
        if self.intervene:
            parts.append(self.intervene)
        if self.prepend:
            parts.append("BOS" if self.prepend == "bos" else f"prepend {self.prepend!r}")
        if self.residual:
            parts.append(f"residual {self.residual}")
        if self.dtype:
            parts.append(self.dtype)
        return " · ".join(parts)

    def to_dict(self) -> dict:
        """Plain values only (JSON, Parquet, PDF metadata); :meth:`from_dict` reads it back. The model's own kind
        is left out, so a recipe keeps the key it had before recipes carried a kind."""
        data = asdict(self)
        if not data["kind"]:
            del data["kind"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Recipe":
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise InputError(f"not a recipe: unknown field(s) {sorted(unknown)}")
        if "model" not in data:
            raise InputError("not a recipe: no model")
        return cls(**{k: ("" if k == "intervene" and v is None else v) for k, v in data.items()})

    @classmethod
    def from_meta(cls, meta: dict, arch: str) -> "Recipe":
        """The recipe of a capture saved before captures carried one (its metadata has the same facts)."""
        return cls(str(meta.get("model", "")), arch, meta.get("intervene") or "", meta.get("prepend"),
                   meta.get("residual"), meta.get("dtype"), meta.get("kind") or "")


@dataclass(frozen=True)
class Built:
    """A recipe made real on a loaded model: the per-layer masks, the interventions and the variant."""

    recipe: Recipe
    architecture: "Architecture"
    interventions: "Interventions"
    variant: object | None  # attnviz.core.engine.residual.Variant
    kind: object = None  # attnviz.core.spec.kinds.Kind, None for the model's own
    own_kind: object = None  # the model's own kind (attnviz.core.spec.kinds.own), what runs where ``kind`` is None

    def only(self, purpose: str, *applies: str) -> "Built":
        """Refuse a recipe part that ``purpose`` does not apply (``applies``: "intervene", "prepend",
        "residual", "kind"), so no front end reports a number made without part of its recipe."""
        parts = {"intervene": self.recipe.intervene, "prepend": self.recipe.prepend, "residual": self.recipe.residual,
                 "kind": self.recipe.kind}
        extra = [name for name, value in parts.items() if value and name not in applies]
        if extra:
            what = {"intervene": f"the intervention {self.recipe.intervene}", "prepend": "a BOS control",
                    "residual": f"the residual variant {self.recipe.residual}",
                    "kind": f"the attention kind {self.recipe.kind}"}
            raise InputError(f"{purpose} does not apply {what[extra[0]]}: leave it out of the recipe")
        return self

    @property
    def computes(self):
        """The engine's half of this recipe (:class:`attnviz.core.engine.Computes`): masks and interventions."""
        from attnviz.core.engine import Computes

        return Computes(tuple(self.architecture.layers), self.interventions, self.kind)

    def softmax_only(self, purpose: str) -> "Built":
        """Refuse, for ``purpose``, which is defined on the softmax's weights (with a model's own learned sink), any
        other kind: the recipe's, or the model's own (docs/methods.md#attention-kinds); each kind declares whether its
        map is a softmax's (``softmax_map``)."""
        kind = self.kind or self.own_kind
        if not kind.softmax_map:
            raise InputError(f"{purpose} is defined on the softmax's weights (and a model's own learned sink), "
                             f"not on {kind.spec}'s (docs/methods.md#attention-kinds)")
        return self

    def check_text(self, n_tokens: int) -> "Built":
        """This recipe for a text of ``n_tokens`` tokens (its BOS control's included): an intervention whose
        positions or keys lie past its end is refused in one line."""
        for item in self.interventions.items:
            missing = item.outside(n_tokens)
            if missing:
                raise InputError(f"{item.spec}: {missing} is outside the text's {n_tokens} tokens "
                                 f"(positions 0..{n_tokens - 1})")
        return self

    def forward(self, loaded: "LoadedModel", input_ids: "torch.Tensor", record=None, feed=None):
        """``(logits, hidden_states or None, run)`` of this recipe (see :func:`forward`); ``record`` (an
        :class:`attnviz.core.engine.Record`) says what to record, none of it by default."""
        return forward(loaded, self.variant, input_ids, self.computes, record, feed)


def build(loaded: "LoadedModel", arch="fwd", intervene=None, prepend: str | None = None,
          residual: str | None = None, kind=None) -> Built:
    """Settings, or a :class:`Recipe` passed as ``arch``, made real on ``loaded``. A recipe's own
    intervention, BOS control and variant are used; naming them again as well is refused."""
    from attnviz.core.engine import residual as residual_mod

    from attnviz.core.spec import kinds

    recipe, architecture, acts, residual = _canonical(loaded, arch, intervene, prepend, residual, kind)
    return Built(recipe, architecture, acts, residual_mod.resolve(loaded, residual),
                 kinds.parse(recipe.kind) if recipe.kind else None, kinds.own(loaded.model))


def _canonical(loaded: "LoadedModel", arch, intervene, prepend, residual, kind=None):
    """(canonical recipe, architecture, interventions, residual name as given) of these settings on ``loaded``,
    parsed and checked; nothing made on the device."""
    from attnviz.core.spec import arch as arch_mod
    from attnviz.core.spec import interventions as interventions_mod
    from attnviz.core.engine import residual as residual_mod

    if isinstance(kind, str) and not kind.strip():  # a recipe's own "" is its model's kind; a caller's "" names none
        from attnviz.core.spec import kinds

        raise InputError(f"kind={kind!r} names no attention kind: leave it out (None) for the model's own, or name "
                         f"one of {', '.join(kinds.names())} (docs/methods.md#attention-kinds)")
    if isinstance(arch, Recipe):
        given = [name for name, value in (("intervene", intervene), ("prepend", prepend), ("residual", residual),
                                          ("kind", kind)) if value not in (None, "")]
        if given:
            raise InputError(f"the recipe already says {', '.join(given)}: change the recipe instead "
                             f"(dataclasses.replace(recipe, {given[0]}=...))")
        recipe = arch
        if recipe.model and recipe.model not in (loaded.model_id, "default"):
            raise InputError(f"the recipe is for {recipe.model}, but the loaded model is {loaded.model_id}")
        arch, intervene, prepend, residual, kind = (recipe.arch, recipe.intervene, recipe.prepend, recipe.residual,
                                                    recipe.kind)
    architecture = arch_mod.resolve(arch, loaded.n_layers)
    from attnviz.core.spec import kinds

    chosen = None if kind in (None, "") else kinds.parse(kind)
    if getattr(chosen, "init", None) is not None:  # sink(init=c) starts a lab run; a forward has nothing to start
        raise InputError(f"{chosen.spec} is where the lab starts a learned sink's logits (attnviz train --kind); a "
                         "model runs the logits it has: write sink")
    own = kinds.own(loaded.model)
    kinds.check(chosen or own, loaded.model, any(m.stable is not None for m in architecture.layers))
    kind_spec = "" if chosen in (None, own) else chosen.spec  # the model's own kind is written "": one key
    acts = interventions_mod.resolve(intervene, loaded.n_layers, loaded.n_heads)
    saved = getattr(loaded, "residual", None)  # a fine-tuned directory's own variant
    if residual:
        residual_mod.check_family(loaded.model)
        name = residual_mod.method(residual).name
    else:
        name = saved.name if saved is not None else None
    if name and any(a.name == "patch" for a in acts.items):
        # a variant runs each block twice (the first pass, then recomputed from the embeddings): which write a
        # patch replaces is not defined there (docs/methods.md#patch), so it is refused rather than applied twice
        raise InputError(f"patch is not defined under the residual variant {name}, which recomputes every block's "
                         "write from the embeddings: leave out the patch or the residual variant")
    dtype = str(next(loaded.model.parameters()).dtype).replace("torch.", "")
    recipe = Recipe(loaded.model_id, architecture.spec, acts.spec, prepend or None, name, dtype, kind_spec)
    return recipe, architecture, acts, residual


def forward(loaded: "LoadedModel", variant, input_ids: "torch.Tensor", computes, record=None, feed=None):
    """The one place that picks the forward: a residual variant's own layer loop (docs/methods.md#residual-variants),
    else the engine's. ``record`` and ``feed`` are :class:`attnviz.core.engine.Record` (default: record nothing)
    and :class:`~attnviz.core.engine.Feed`. Returns ``(logits, hidden_states or None, run)``. A variant's loop
    records no hidden states (refused when asked); ``feed.grad`` keeps the graph (fine-tuning), otherwise no
    gradients are kept."""
    import contextlib

    import torch

    from attnviz.core import engine
    from attnviz.core.engine import residual as residual_mod

    record = engine.NOTHING if record is None else record
    feed = engine.Feed() if feed is None else feed
    if variant is None:
        output, run = engine.forward(loaded.model, input_ids, computes, record, feed)
        return output.logits, (output.hidden_states if feed.hidden_states else None), run
    if feed.hidden_states:
        raise InputError(f"hidden states are not recorded under the residual variant {variant.name}")
    with contextlib.nullcontext() if feed.grad else torch.no_grad():
        logits, run = residual_mod.forward(loaded.model, variant, input_ids, computes, record)
    return logits, None, run
