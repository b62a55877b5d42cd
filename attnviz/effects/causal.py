"""The causal check of score attribution (docs/methods.md#the-causal-check): remove a source's write at the sink
token and watch the sink.

Score attribution (:mod:`attnviz.effects.explain`) decomposes the sink key's score into the residual stream's
sources and names, layer by layer, the source that leads it. That is a decomposition, not a cause. Here the
leading source's block output is replaced at the sink token (the ``patch`` intervention,
docs/methods.md#patch) and the text is run again: if the source makes the sink, the attention on the sink key
falls in the layers it leads. Each check reports the attention on each layer's sink key (its
:func:`attnviz.stats.metrics.alpha` at the mask's :func:`attnviz.stats.metrics.auto_key`, the mean over heads)
before and after, in every layer, and the text's perplexity before and after.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from attnviz.capture import capture
from attnviz.core.models import LoadedModel
from attnviz.effects.evaluate import evaluate
from attnviz.errors import InputError
from attnviz.plan import Keep
from attnviz.recipe import Recipe
from attnviz.stats import metrics

_SOURCE = re.compile(r"^(attn|mlp)\.(\d+)$")


@dataclass
class SinkProfile:
    """The attention on each layer's sink key (mean over heads of alpha at the mask's auto key) and the text's
    perplexity, under one recipe."""

    keys: list[int]
    attention: list[float]
    perplexity: float
    tokens: int = 0


@dataclass
class CausalCheck:
    """One source patched at the sink token: where it led, and the sink before and after."""

    source: str  # "mlp.2", "attn.11"
    leads: list[int]  # the layers where attribution names it the leading source (may be empty: the user's pick)
    patch: str  # the intervention that removed it
    before: SinkProfile
    after: SinkProfile

    @property
    def layer(self) -> int:
        """The layer of the removed write; -1 for the embedding (the causal scan removes it too)."""
        return -1 if self.source == "embed" else int(_SOURCE.match(self.source).group(2))

    def drop(self, layers: list[int] | None = None) -> float:
        """The mean fall of the sink's attention over ``layers`` (default: the layers it leads, else every layer
        above it), as a share of the attention before: 1 means the sink is gone there."""
        chosen = layers or self.leads or list(range(self.layer + 1, len(self.before.attention)))
        before = np.mean([self.before.attention[l] for l in chosen])
        after = np.mean([self.after.attention[l] for l in chosen])
        return float((before - after) / before) if before > 0 else float("nan")

    def as_json(self) -> dict:
        above = range(self.layer + 1, len(self.before.attention))
        drop = self.drop()
        defined = np.isfinite(drop)
        return {"source": self.source, "leads": self.leads, "patch": self.patch,
                "sink_drop": round(drop, 4) if defined else None,
                **({} if defined else {"sink_drop_undefined": "no attention on the sink key before the patch in the "
                                                              "layers measured (a share of nothing)"}),
                "perplexity_before": round(self.before.perplexity, 4), "perplexity_after": round(self.after.perplexity, 4),
                "layers": [{"layer": l, "key": self.before.keys[l], "before": _rounded(self.before.attention[l]),
                            "after": _rounded(self.after.attention[l])} for l in above]}


def _rounded(x: float):
    """x to 5 places; None where it is not defined (NaN: a layer whose sink key only its own query sees)."""
    return round(float(x), 5) if np.isfinite(x) else None


def sources_of(text: str) -> list[str]:
    """The blocks a comma-separated list names ("attn.0, MLP.2": spaces and case tolerated), each checked; an
    empty list is refused (not read as "every leader")."""
    sources = [re.sub(r"\s+", "", part).lower() for part in str(text).split(",")]
    sources = [s for s in sources if s]
    if not sources:
        raise InputError(f"--sources names no block ({text!r}): give blocks such as mlp.2,attn.11, or leave it out "
                         "to test every leading block")
    for source in sources:
        patch_spec(source)
    return list(dict.fromkeys(sources))


def _check_layers(loaded: LoadedModel, sources: list[str]) -> None:
    """A source's layer must exist, and have a layer above it: the sink is measured in the layers its write reaches."""
    top = loaded.n_layers - 1
    for source in sources:
        layer = int(_SOURCE.match(source).group(2))
        if layer > top:
            raise InputError(f"{source}: layer {layer} does not exist (the model has layers 0..{top})")
        if layer == top:
            raise InputError(f"{source} writes into the top layer's output: no layer above it reads its write, so "
                             f"there is no sink to measure after it; choose a block in layers 0..{top - 1}")


def _check_sink(loaded: LoadedModel, text: str, recipe: Recipe) -> None:
    """Refuse, before any forward, a text too short to have a sink key in any layer under ``recipe`` (a key that
    every later query may see, docs/methods.md#auto-key): NoSink-FWD(m) hides the first m keys, so a text of m + 1
    tokens has none, and every number after would be NaN."""
    from attnviz.core import allowsets, anatomy
    from attnviz.recipe import build
    from attnviz.tokens import tokenize

    built = build(loaded, recipe)
    ids, _ = tokenize(loaded, text, prepend=built.recipe.prepend)
    n = len(ids)
    try:
        windows = [layer.window for layer in anatomy.of(loaded.model).layers]
    except InputError:
        windows = [None] * loaded.n_layers
    for mask, window in zip(built.architecture.layers, windows):
        columns = metrics.auto_key_limit(n)
        allow = allowsets.allowed(mask, n, window, columns).numpy()
        later = allow[metrics.auto_key(allow) + 1:, metrics.auto_key(allow)]
        if later.size and later.all():
            return
    raise InputError(f"the text's {n} tokens are too short to have a sink key under {built.recipe.arch} (a key "
                     "among its first half that every later query may see): give a longer text")


def patchable(source: str) -> bool:
    """Whether ``source`` is a block's write ("attn.L", "mlp.L"), which ``patch`` can remove."""
    return _SOURCE.match(source) is not None


def patch_spec(source: str, value: str = "zero") -> str:
    """The ``patch`` intervention that removes ``source`` ("mlp.L" or "attn.L") at each layer's sink token."""
    match = _SOURCE.match(re.sub(r"\s+", "", str(source)).lower())
    if match is None:
        raise InputError(f"only a block's output can be patched (attn.L or mlp.L); '{source}' is not one: the "
                         "embeddings and biases are not a block's write")
    return f"patch(block={match.group(1)}, tokens=sink, value={value})@{match.group(2)}"


def profile(loaded: LoadedModel, text: str, recipe: Recipe, on_layer=None) -> SinkProfile:
    """The sink's attention in every layer and the perplexity of ``text`` under ``recipe``: one statistics capture
    (alpha only, no map is kept) and one evaluation over the whole text."""
    cap = capture(loaded, text, recipe, Keep(statistics=("alpha",)), on_layer=on_layer)
    keys, attention = [], []
    for layer in range(loaded.n_layers):
        key = metrics.auto_key(cap.allowed[layer])
        keys.append(key)
        values = cap.stat(layer, "alpha")[:, key]
        defined = values[np.isfinite(values)]  # NaN where only the key's own query sees it (a window past it)
        attention.append(float(defined.mean()) if defined.size else float("nan"))
    # the tokens as the capture saw them (a BOS control's prefix included), scored as written
    ppl = evaluate(loaded, cap.token_ids, replace(recipe, prepend=None), window=cap.n_tokens).perplexity
    return SinkProfile(keys, attention, float(ppl), cap.n_tokens)


def leaders(run, on_layer: Callable[[int, int], None] | None = None) -> dict[str, list[int]]:
    """Each source that leads the sink key's score in some layer (:func:`attnviz.effects.explain.diagnose`), with
    the layers it leads, in the order they first lead."""
    from attnviz.effects.explain import diagnose

    out: dict[str, list[int]] = {}
    for layer in range(run.loaded.n_layers):
        name, _ = diagnose(run, layer).leading()
        out.setdefault(name, []).append(layer)
        if on_layer:
            on_layer(layer + 1, run.loaded.n_layers)
    return out


def check(loaded: LoadedModel, text: str, recipe, sources: list[str] | None = None, value: str = "zero",
          on_step: Callable[[int, int], None] | None = None) -> list[CausalCheck]:
    """The causal check of ``sources`` on ``text`` under ``recipe`` (an architecture string or a recipe; its own
    interventions stay, the patch joins them), one forward of each patched recipe at a time. Without ``sources``,
    every block: the causal scan (:func:`attnviz.effects.scan.scan`, the same numbers, faster), each check marked
    with the layers attribution says it leads. ``on_step(done, total)`` counts the forwards."""
    if sources is None:
        from attnviz.effects.scan import scan

        return scan(loaded, text, recipe, value, on_step=on_step).checks
    recipe = Recipe.of(loaded, recipe)
    sources = sources_of(",".join(sources)) if not isinstance(sources, str) else sources_of(sources)
    _check_layers(loaded, sources)
    _check_sink(loaded, text, recipe)
    led: dict[str, list[int]] = {}
    specs = [patch_spec(s, value) for s in sources]  # every source checked before the first forward
    total, done = 1 + len(sources), [0]

    def step():
        done[0] += 1
        if on_step:
            on_step(done[0], total)

    before = profile(loaded, text, recipe)
    step()
    checks = []
    for source, spec in zip(sources, specs):
        both = "; ".join(part for part in (recipe.intervene, spec) if part)
        after = profile(loaded, text, Recipe.of(loaded, replace(recipe, intervene=both)))
        step()
        checks.append(CausalCheck(source, led.get(source, []), spec, before, after))
    return checks


@dataclass
class Report:
    """What ``attnviz explain --test`` prints: the recipe, the text's length and every check."""

    recipe: dict
    tokens: int
    checks: list[CausalCheck] = field(default_factory=list)

    def as_json(self) -> dict:
        return {"recipe": self.recipe, "tokens": self.tokens, "checks": [c.as_json() for c in self.checks]}
