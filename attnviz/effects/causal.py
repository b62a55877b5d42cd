"""The causal check of score attribution (docs/methods.md#the-causal-check): remove a source's write at the sink
token and watch the sink.

Score attribution (:mod:`attnviz.effects.explain`) decomposes the sink key's score into the residual stream's
sources and names, layer by layer, the source that leads it. That is a decomposition, not a cause. Here the
leading source's block output is replaced at the sink token (the ``patch`` intervention,
docs/methods.md#patch) and the text is run again: if the source makes the sink, the attention on the sink key
falls in the layers it leads. Each check reports the attention on each layer's sink key (its
:func:`attnviz.stats.metrics.alpha` at the mask's :func:`attnviz.stats.metrics.auto_key`, the mean over heads)
before and after, in every layer, and the text's perplexity before and after.

Without named sources every write is removed in turn: the causal scan (:func:`scan`, below), which names the
necessary writers and their chains; attribution's leaders are marked in it. Through which later block a necessary
writer acts is path patching's question (:mod:`attnviz.effects.paths`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from attnviz.capture import capture
from attnviz.core.engine import sites
from attnviz.core.loading.models import LoadedModel
from attnviz.core.spec.interventions import Patch
from attnviz.effects import budget as budget_mod
from attnviz.effects.evaluate import evaluate
from attnviz.effects.opening import Opening, SinkProfile, perplexities, require_sink, windows_of  # noqa: F401
from attnviz.errors import InputError
from attnviz.plan import Keep
from attnviz.recipe import Recipe
from attnviz.stats import metrics

_SOURCE = re.compile(r"^(attn|mlp)\.(\d+)$")


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
                "perplexity_before": rounded(self.before.perplexity, 4), "perplexity_after": rounded(self.after.perplexity, 4),
                "layers": [{"layer": l, "key": self.before.keys[l], "before": rounded(self.before.attention[l]),
                            "after": rounded(self.after.attention[l])} for l in above]}


def rounded(x: float, digits: int = 5):  # None where not defined (NaN: a layer whose sink key only its own query sees)
    return round(float(x), digits) if np.isfinite(x) else None


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


def check_sink(loaded: LoadedModel, text: str, recipe: Recipe) -> None:
    """Refuse, before any forward, a text too short to have a sink key in any layer under ``recipe``
    (:func:`attnviz.effects.opening.require_sink`)."""
    from attnviz.recipe import build
    from attnviz.tokens import tokenize

    built = build(loaded, recipe)
    ids, _ = tokenize(loaded, text, prepend=built.recipe.prepend)
    require_sink(built.architecture.layers, len(ids), windows_of(loaded), built.recipe.arch)


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


leaders_of = leaders  # the scan's own argument ``leaders`` shadows the function there


def check(loaded: LoadedModel, text: str, recipe, sources: list[str] | None = None, value: str = "zero",
          on_step: Callable[[int, int], None] | None = None) -> list[CausalCheck]:
    """The causal check of ``sources`` on ``text`` under ``recipe`` (an architecture string or a recipe; its own
    interventions stay, the patch joins them), one forward of each patched recipe at a time. Without ``sources``,
    every block: the causal scan (:func:`scan`, the same numbers, faster), each check marked
    with the layers attribution says it leads. ``on_step(done, total)`` counts the forwards."""
    if sources is None:
        return scan(loaded, text, recipe, value, on_step=on_step).checks
    recipe = Recipe.of(loaded, recipe)
    sources = sources_of(",".join(sources)) if not isinstance(sources, str) else sources_of(sources)
    _check_layers(loaded, sources)
    check_sink(loaded, text, recipe)
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
class CausalReport:
    """What ``attnviz explain --test`` prints: the recipe, the text's length and every check."""

    recipe: dict
    tokens: int
    checks: list[CausalCheck] = field(default_factory=list)

    def as_json(self) -> dict:
        return {"recipe": self.recipe, "tokens": self.tokens, "checks": [c.as_json() for c in self.checks]}


# --- the causal scan of every block (docs/methods.md#the-causal-scan) ----------------------------------------
#
# Each layer's attention and MLP write, and the embedding, removed at the sink token one at a time: what happens to
# the sink and to the perplexity. Only removing each write says which are necessary; the chain (the later writes at
# the sink token whose size changes with it) is a correlation inside one removal, not a path (path patching).
# Each check is the causal check's own (``tests/test_scan.py``): the engine's ``patch`` of one batch row each, a
# layer's blocks (and the embedding) in one batch resumed from layer l's kept input; the sink's attention read by a
# recorder of its column alone, the perplexity from the same logits. The top layer's blocks are not scanned.

NECESSARY = 0.5  # a write is necessary when removing it takes at least half the sink's attention away
CHANGED = 0.5  # a later write "changes with it" when its norm at the sink token moves by at least half


@dataclass
class Scan:
    """Every block's causal check, the leaders attribution names, the necessary writers and their chains."""

    recipe: dict
    tokens: int
    checks: list[CausalCheck]
    necessary: list[str] = field(default_factory=list)
    chains: dict[str, list[dict]] = field(default_factory=dict)
    not_scanned: str = ""

    def as_json(self) -> dict:
        return {"recipe": self.recipe, "tokens": self.tokens, "scan": "every block",
                "checks": [{**c.as_json(), "leader": bool(c.leads)} for c in self.checks],
                "necessary": self.necessary, "necessary_threshold": NECESSARY,
                "chains": self.chains, "not_scanned": self.not_scanned}

    def matrix(self) -> tuple[list[str], np.ndarray]:
        """(blocks, (blocks, layers)): the sink's attention after each block's removal, relative to before (1: as
        before, 0: gone), NaN in layers the removal cannot reach (its own and those below)."""
        names = [c.source for c in self.checks]
        out = np.full((len(names), len(self.checks[0].before.attention)), np.nan)
        for row, check in enumerate(self.checks):
            first = 0 if check.source == "embed" else check.layer + 1
            for layer in range(first, out.shape[1]):
                before = check.before.attention[layer]
                if np.isfinite(before) and before > 0:
                    out[row, layer] = check.after.attention[layer] / before
        return names, out

def _order(block: str) -> tuple[int, int]:
    """A write's place in the forward: the embedding first, then each layer's attention before its MLP."""
    if block == "embed":
        return (-1, 0)
    name, layer = block.split(".")
    return (int(layer), 0 if name == "attn" else 1)


def blocks_of(n_layers: int) -> list[str]:
    """The scanned blocks in forward order: the embedding, then each layer's attention and MLP below the top."""
    return ["embed"] + [f"{block}.{l}" for l in range(n_layers - 1) for block in ("attn", "mlp")]


def scan_batches(n_layers: int) -> list[tuple[int, int]]:
    """The scan's batches: from each layer below the top, its blocks' removals (and the embedding's, in the first)."""
    return [(layer, 3 if layer == 0 else 2) for layer in range(n_layers - 1)]


def attribution_bytes(loaded, n: int) -> int:
    """What the score attribution of every layer keeps while it names the leaders: every layer's input and every
    block's write, fp32 (:class:`attnviz.effects.attribution.KeptForward`)."""
    return (3 * loaded.n_layers + 1) * n * int(loaded.config.hidden_size) * 4


@torch.no_grad()
def scan(loaded, text: str, recipe="fwd", value: str = "zero", leaders: bool = True,
         on_step: Callable[[int, int], None] | None = None, opening: Opening | None = None,
         budget: int | None = None, on_plan: Callable | None = None, perplexity: bool = True) -> Scan:
    """The causal scan of every block of ``text`` under ``recipe`` (see the comment above); ``leaders`` marks the
    blocks score attribution names (one attribution of every layer, skipped with False); ``perplexity=False`` leaves
    each removal's perplexity out (NaN; JSON null): the sink alone, without reading every position's logits over the
    vocabulary once a removal (on Gemma 3's 262k tokens about half the scan). ``on_step(done, total)``
    counts the batched forwards. ``opening``: the text already opened for it (:class:`Opening`, whose unpatched
    forward is then run once for both: path patching with the scan's senders). Sized before it runs within
    ``budget`` bytes beyond the weights (None: the memory budget's; :mod:`attnviz.effects.budget`), its plan given to
    ``on_plan``; refused before any forward where one row does not fit."""
    from attnviz.effects.attribution import KeptForward

    if value not in ("zero", "mean"):
        raise InputError(f"the scan replaces a write by zero or mean, not {value!r}")
    opened = opening or Opening(loaded, text, recipe, "the causal scan", sink=True, resumable=True)
    L, sink_keys = opened.L, opened.sink_keys
    sized = opened.plan(scan_batches(L), extra=1, budget=budget,
                        before=(lambda m: attribution_bytes(loaded, m)) if leaders else 0).check("")
    if on_plan and opening is None:
        on_plan(sized)
    led = leaders_of(KeptForward(loaded, text, opened.recipe)) if leaders else {}
    total = sized.forwards  # the unpatched forward, then one batch per layer below the top (in parts, where split)
    norms: dict[tuple[int, str], torch.Tensor] = {}  # each write's norm at its layer's sink token, per batch row

    def norm_at(layer: int, block: str):
        def fn(write):
            norms[(layer, block)] = write[:, sink_keys[layer]].float().norm(dim=-1)
        return fn

    def removal(source: str, row: int) -> Patch:
        """The engine's ``patch`` of one block's write at its layer's sink token, in one batch row."""
        block, layer = ("embed", 0) if source == "embed" else (source.split(".")[0], int(source.split(".")[1]))
        return Patch(block=block, tokens=str(sink_keys[layer]), value=value, rows=(row,), layers=(layer,))

    readers = [(sites.Site(f"{block}_out", layer), norm_at(layer, block)) for layer in range(L)
               for block in ("attn", "mlp")]
    before = opened.sink()
    base_norms = {name: float(at.norm()) for name, (at, _) in opened.writes.items() if name != "embed"}
    done = 1
    if on_step:
        on_step(done, total)
    checks, after_norms = [], {}
    for layer in range(L - 1):
        for rows in budget_mod.parts((["embed"] if layer == 0 else []) + [f"attn.{layer}", f"mlp.{layer}"], sized):
            computes = replace(opened.computes, interventions=opened.computes.interventions.plus(
                *(removal(source, i) for i, source in enumerate(rows))))
            norms.clear()
            after = opened.profiles(layer, len(rows), readers, computes, perplexity)
            for i, source in enumerate(rows):
                spec = (f"the embedding at the sink token replaced by {value}" if source == "embed"
                        else patch_spec(source, value))
                checks.append(CausalCheck(source, led.get(source, []), spec, before, after[i]))
                # the writes this batch ran: its own layer's and those above, all a chain may name
                after_norms[source] = {f"{k[1]}.{k[0]}": float(v[i]) for k, v in norms.items()}
            done += 1
            if on_step:
                on_step(done, total)
    drops = {c.source: c.drop(list(range(c.layer + 1, L))) for c in checks}  # every layer the removal can reach
    necessary = [source for source, drop in drops.items() if np.isfinite(drop) and drop >= NECESSARY]
    chains = {source: _chain(source, base_norms, after_norms[source]) for source in necessary}
    return Scan(opened.recipe.to_dict(), opened.n, checks, necessary, chains, "the top layer's blocks: no layer above "
                "reads their writes")


def _chain(source: str, before: dict[str, float], after: dict[str, float]) -> list[dict]:
    """The later writes at the sink token whose norm moves by at least :data:`CHANGED` when ``source`` is removed."""
    later = []
    for block, norm_before in before.items():
        if _order(block) <= _order(source):
            continue
        norm_after = after[block]
        change = (norm_after - norm_before) / norm_before if norm_before > 0 else 0.0
        if abs(change) >= CHANGED:
            later.append({"block": block, "norm_before": round(norm_before, 4), "norm_after": round(norm_after, 4),
                          "change": round(change, 4)})
    return later
