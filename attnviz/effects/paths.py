"""Path patching between blocks (docs/methods.md#path-patching; Wang et al. 2022): through which later block does a
write make the sink?

A **sender** is the embedding or a block's write (``embed``, ``attn.l``, ``mlp.l``) at the sink token of its layer (its
auto key), as the causal scan removes it. A **receiver** above it is a later block's input (``attn.m``, ``mlp.m``), the
keys or the queries of a later layer's heads (``keys.m``, ``queries.m``), or the model's head (``head``: the last
layer's output before the final norm). The path sender → receiver is cut by removing the sender's write from that
receiver's input alone: the receiver reads norm(stream − write) at the sink token (``zero``; ``mean``: − write + its
mean over the other positions), where norm is the pre-norm the receiver reads through; every other block reads the
stream as it was, and the receiver's changed output flows on. Measured as the scan measures a removal: the
attention on every later layer's sink key, its drop over the layers above the sender, the perplexity.

Removing a sender from every block input above it and from the head at once is the scan's removal of that sender
(:func:`removal`, ``tests/test_paths.py``). A receiver at layer m changes nothing below m: the paths into layer m
resume from its input, kept by the one unpatched forward (the engine's checkpoints), and share one batch, a row a
path. Everything is read and replaced at the engine's named sites (``resid_pre``, ``resid_mid``, ``attn_in``,
``mlp_in``, ``k_in``, ``q_in``, ``resid_post``) and resumed through the engine's one resumed forward.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from attnviz.core.engine import sites
from attnviz.core.loading import models
from attnviz.effects import budget as budget_mod
from attnviz.effects import causal
from attnviz.effects import receivers as receivers_mod
from attnviz.effects.causal import rounded
from attnviz.effects.opening import Opening, SinkProfile
from attnviz.errors import InputError

_SINGLE = re.compile(r"^(head|(attn|mlp|keys|queries)\.\d+)$")
_SENDER = re.compile(r"^(embed|(attn|mlp)\.(\d+))$")
_RECEIVER = re.compile(r"^(head|all|(attn|mlp|keys|queries)\.(\d+|\*|(\d+)-(\d+)))$")
PROJECTED = ("keys.", "queries.")
#: the groups every sender is also cut from by default: each kind of receiver above it at once, and everything
GROUPS = ("attn.*", "keys.*", "queries.*", "mlp.*", "all")


def layer_of(block: str, n_layers: int) -> int:
    """The layer a block belongs to (the embedding: 0; the head: the top layer, whose output it reads)."""
    return 0 if block == "embed" else n_layers - 1 if block == "head" else int(block.split(".")[1])


def names(text, what: str, n_layers: int) -> list[str]:
    """The senders or receivers a comma-separated list (or a list) names, each checked, in one line. A receiver may be
    a group cut at once: ``keys.12-29``, ``mlp.*`` (every one of that kind above the sender), ``all`` (every block's
    input above the sender and the head: the scan's removal), or several joined by ``+`` (``mlp.1+attn.2``);
    ``groups`` names the :data:`GROUPS`."""
    pattern = _SENDER if what == "sender" else _RECEIVER
    if what == "receiver" and isinstance(text, str) and text.strip().lower() == "groups":
        return list(GROUPS)
    if isinstance(text, str):
        parts = text.split(",")
    elif isinstance(text, (list, tuple)) and all(isinstance(part, str) for part in text):
        parts = list(text)
    else:
        raise InputError(f"the {what}s are a comma-separated string or a list of strings such as "
                         f"{'mlp.0,attn.3' if what == 'sender' else 'attn.3,keys.5,head'}, not {text!r}")
    given = [re.sub(r"\s+", "", part).lower() for part in parts]
    given = [n for n in given if n]
    if not given:
        raise InputError(f"no {what} named: give blocks such as mlp.0,attn.3")
    for name in given:
        for part in name.split("+") if what == "receiver" else [name]:
            if what == "receiver" and receivers_mod.is_head(part):
                part = receivers_mod.shared(part)  # its layer checked as the layer's own keys' or queries'
            match = pattern.match(part)
            if match is None:
                allowed = ("embed, attn.L or mlp.L" if what == "sender" else
                           "attn.L, mlp.L, keys.L, queries.L (or L-M, or *), head, all, joined by +; "
                           "one head: keys.L.hK, queries.L.hQ, values.L.hK (or .h*)")
                raise InputError(f"unknown {what} '{part}': expected {allowed}")
            for layer in (match.group(3), *(match.groups()[3:] if what == "receiver" else ())):
                if layer is not None and layer.isdigit() and int(layer) >= n_layers:
                    raise InputError(f"{part}: layer {layer} does not exist (the model has layers 0..{n_layers - 1})")
            if what == "receiver" and match.group(4) is not None and int(match.group(4)) > int(match.group(5)):
                raise InputError(f"{part}: a range runs upwards (write {match.group(2)}.{match.group(5)}-"
                                 f"{match.group(4)})")
            if what == "sender" and match.group(3) is not None and int(match.group(3)) == n_layers - 1:
                raise InputError(f"{name} writes into the top layer: no layer above it reads its write, so there is "
                                 f"no sink to measure after it; choose a block in layers 0..{n_layers - 2}")
    return list(dict.fromkeys(given))


def members(receiver: str, sender: str, n_layers: int, parallel: bool = False) -> list[str]:
    """The single receivers a receiver (or a group) cuts for ``sender``, each above it (a receiver that is not is
    refused in one line)."""
    above = receivers_of(sender, n_layers, parallel)
    out = []
    for part in receiver.split("+"):
        if receivers_mod.is_head(part):
            if receivers_mod.shared(part) not in above:
                raise InputError(f"{part} is not above {sender}: a receiver reads the stream after its sender writes "
                                 f"it (above {sender}: {above[0]} to head)")
            out.append(part)
            continue
        if part == "all":
            out += [r for r in above if not r.startswith(PROJECTED)]
            continue
        name, _, which = part.partition(".")
        if which == "*":
            out += [r for r in above if r.startswith(name + ".")]
            continue
        first, _, last = which.partition("-")
        group = [part] if part == "head" or not last else [f"{name}.{m}" for m in range(int(first), int(last) + 1)]
        below = [r for r in group if r not in above]
        if below:
            raise InputError(f"{below[0]} is not above {sender}: a receiver reads the stream after its sender writes "
                             f"it (above {sender}: {above[0]} to head)")
        out += group
    return list(dict.fromkeys(out))


def receivers_of(sender: str, n_layers: int, parallel: bool = False) -> list[str]:
    """Every receiver above ``sender`` in forward order: its own layer's MLP (after an attention, unless the blocks
    read the layer's input in parallel), then each later layer's attention, keys, queries and MLP, then the head."""
    start = layer_of(sender, n_layers) + (0 if sender == "embed" else 1)
    out = [f"mlp.{start - 1}"] if sender.startswith("attn.") and not parallel else []
    for m in range(start, n_layers):
        out += [f"attn.{m}", f"keys.{m}", f"queries.{m}", f"mlp.{m}"]
    return out + ["head"]


@dataclass
class Paths:
    """Every path's sink profile, ``after[(sender, receiver)]``, beside the unpatched ``before``."""

    recipe: dict
    tokens: int
    value: str
    before: SinkProfile
    senders: list[str]
    after: dict[tuple[str, str], SinkProfile] = field(default_factory=dict)
    cut: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # the single receivers each path cuts
    skipped: str = ""  # the receivers this family does not have (fused projections), said once
    note: str = ""  # why there is no path at all (the scan found no necessary writer), or ""

    def drop(self, sender: str, receiver: str) -> float:
        """The mean fall of the sink's attention over the layers above the sender, as a share of before (the scan's
        scale: 1 means gone, 0 unchanged)."""
        n = len(self.before.attention)
        self._cut(sender, receiver)
        return self._fall(sender, receiver, range(layer_of(sender, n) + (0 if sender == "embed" else 1), n))

    def reached(self, sender: str, receiver: str) -> float:
        """The same fall over the layers the cut can move: from :meth:`reach_from` up. A path into layer 28's keys is
        judged on layers 28 and up, not diluted over every layer above its sender. A cut read after the top layer's
        attention (the head, the top MLP) moves no layer's sink: refused in one line (:meth:`reaches` says which
        paths have a reached drop)."""
        return self._fall(sender, receiver, range(self.reach_from(sender, receiver), len(self.before.attention)))

    def reaches(self, sender: str, receiver: str) -> bool:
        """Whether the path's cut can move some layer's sink: a receiver it cuts is read before the top layer's
        attention (the head and the top MLP are read after it)."""
        return self._lowest(sender, receiver) < len(self.before.attention)

    def reach_from(self, sender: str, receiver: str) -> int:
        """The lowest layer whose sink the cut can move: its lowest receiver's own layer (the next one for an MLP),
        and above the sender; refused in one line for a cut that moves none (:meth:`reaches`), naming the receivers
        of ``sender`` that do."""
        if not self.reaches(sender, receiver):
            some = [r for s, r in self.after if s == sender and self.reaches(s, r)]
            cut = self.cut[sender, receiver]
            raise InputError(f"{sender} → {receiver}: {' and '.join(cut)} {'is' if len(cut) == 1 else 'are'} "
                             "read after the top layer's attention, so the cut moves no layer's sink (only the "
                             "perplexity: its drop and reached drop are undefined); "
                             + (f"the receivers of {sender} with a reached drop: {', '.join(some)}" if some else
                                f"no receiver of {sender} measured here has one")
                             + " (docs/methods.md#path-patching)")
        n = len(self.before.attention)
        return max(self._lowest(sender, receiver), layer_of(sender, n) + (0 if sender == "embed" else 1))

    def _lowest(self, sender: str, receiver: str) -> int:
        """The lowest layer a receiver the path cuts is read in before that layer's attention; the number of layers
        for the head and the top MLP, read after the top layer's attention."""
        n = len(self.before.attention)
        return min(n if r == "head" else layer_of(r, n) + (1 if r.startswith("mlp.") else 0)
                   for r in self._cut(sender, receiver))

    def _cut(self, sender: str, receiver: str) -> list[str]:
        """The single receivers the path cuts; a path not measured refused in one line naming those that were."""
        if (sender, receiver) not in self.cut:
            if sender not in self.senders:
                raise InputError(f"no path from {sender!r} was measured: the senders are "
                                 f"{', '.join(self.senders) or 'none'}")
            raise InputError(f"no path {sender} → {receiver!r} was measured: {sender}'s receivers are "
                             f"{', '.join(r for s, r in self.after if s == sender)}")
        return self.cut[sender, receiver]

    def _fall(self, sender: str, receiver: str, layers) -> float:
        layers = list(layers)
        if not layers:
            return float("nan")
        before = np.mean([self.before.attention[l] for l in layers])  # as the scan's drop: NaN where a layer is
        after = np.mean([self.after[sender, receiver].attention[l] for l in layers])  # (no sink key there)
        return float((before - after) / before) if before > 0 else float("nan")

    def receivers(self, sender: str, single: bool | None = None) -> list[str]:
        """``sender``'s receivers (``single``: only single ones; False: only groups; None: both)."""
        return [r for s, r in self.after if s == sender and (single is None or bool(_SINGLE.match(r)) == single
                                                             and not receivers_mod.is_head(r))]

    def heads(self, sender: str) -> list[str]:
        """``sender``'s head receivers (:mod:`attnviz.effects.receivers`): neither single blocks nor groups."""
        return [r for s, r in self.after if s == sender and receivers_mod.is_head(r)]

    def strongest(self, sender: str, k: int = 3, single: bool | None = True) -> list[tuple[str, float]]:
        """The ``k`` receivers through which removing ``sender`` takes the most of the sink away in the layers the
        cut can move (:meth:`reached`), with that fall."""
        falls = [(r, self.reached(sender, r)) for r in self.receivers(sender, single) if self.reaches(sender, r)]
        return sorted((f for f in falls if np.isfinite(f[1])), key=lambda f: -f[1])[:k]

    def as_json(self) -> dict:
        return {"recipe": self.recipe, "tokens": self.tokens, "value": self.value, "senders": self.senders,
                **({"note": self.note} if self.note else {}),
                "perplexity_before": rounded(self.before.perplexity, 4),
                "sink_before": [{"layer": l, "key": k, "attention": rounded(a),
                                 **({} if np.isfinite(a) else {"attention_undefined": _UNSEEN})}
                                for l, (k, a) in enumerate(zip(self.before.keys, self.before.attention))],
                "paths": [self._path(s, rc, p) for (s, rc), p in self.after.items()],
                **({"attention_after_undefined": _UNSEEN} if any(not np.isfinite(a) for p in self.after.values()
                                                                 for a in p.attention) else {}),
                **({"skipped": self.skipped} if self.skipped else {})}

    def _path(self, s: str, rc: str, p: SinkProfile) -> dict:
        """One path's document: every null (a drop, the layer the reach starts from) with its reason beside it."""
        reaches = self.reaches(s, rc)
        start = self.reach_from(s, rc) if reaches else None
        drop, reached = self.drop(s, rc), self.reached(s, rc) if reaches else float("nan")
        out = {"sender": s, "receiver": rc, "sink_drop": rounded(drop),
               **({} if np.isfinite(drop) else {"sink_drop_undefined": _NOTHING}),
               "sink_drop_reached": rounded(reached), "reached_from": start}
        if not reaches:
            read = " and ".join(self.cut[s, rc])
            out["sink_drop_reached_undefined"] = (f"{read} {'is' if len(self.cut[s, rc]) == 1 else 'are'} read after "
                                                  "the top layer's attention: the cut moves no layer's sink, only "
                                                  "the perplexity")
        elif not np.isfinite(reached):
            out["sink_drop_reached_undefined"] = _NOTHING
        return {**out, **({"cuts": self.cut[s, rc]} if self.cut[s, rc] != [rc] else {}),
                "perplexity_after": rounded(p.perplexity, 4), "attention_after": [rounded(a) for a in p.attention]}


#: the reasons beside a null in :meth:`Paths.as_json` (the causal check's own, docs/methods.md#path-patching)
_NOTHING = "no attention on the sink key before the cut in the layers measured (a share of nothing)"
_UNSEEN = "null where a layer's sink key is seen by its own query alone (no later query attends to it)"


@torch.no_grad()
def paths(loaded, text: str, recipe="fwd", senders=None, receivers=None, value: str = "zero",
          on_step: Callable[[int, int], None] | None = None, budget: int | None = None,
          on_plan: Callable | None = None) -> Paths:
    """Path patching of ``text`` under ``recipe`` (see the module docstring). ``senders``: blocks ("mlp.0,attn.3" or a
    list; None: the causal scan's necessary writers); ``receivers``: the receivers to cut, each alone or a group at
    once (:func:`names`; None: every single one above each sender, :func:`receivers_of`, and the :data:`GROUPS`);
    ``value``: zero or mean. ``on_step(done, total)`` counts the forwards.

    Sized before it runs (:mod:`attnviz.effects.budget`): the batches run in parts that fit ``budget`` bytes beyond
    the weights (None: the memory budget's), or it is refused before any forward where one row does not fit.
    ``on_plan(plan)`` is given the plan (:class:`~attnviz.effects.budget.AnalysisPlan`) before the first forward,
    and again once the scan has named the senders."""
    return _run(loaded, text, recipe, senders, receivers, value, on_step, budget, on_plan)


@torch.no_grad()
def removal(loaded, text: str, sender: str, receivers, recipe="fwd", value: str = "zero") -> SinkProfile:
    """The sink profile with ``sender`` removed from every one of ``receivers`` at once, in one forward: the scan's
    removal of it where the receivers are every block input above it and the head (``"all"``)."""
    joined = "+".join(names(receivers, "receiver", loaded.n_layers))
    return next(iter(_run(loaded, text, recipe, [sender], [joined], value, None, None, None).after.values()))


def _projections(model) -> str:
    """Why this family's keys and queries are not receivers of their own (a fused projection), or ""."""
    try:
        sites.check(model, sites.Site("k_in", 0))
        sites.check(model, sites.Site("q_in", 0))
    except InputError as err:
        return str(err)
    return ""


def _plan(model, found, chosen: list[str], asked: list[str] | None, L: int, lenient: bool = False,
          optional: bool = False):
    """Each sender's paths {receiver: the single receivers it cuts}, and why keys and queries are left out where the
    family has no projection of its own for them (refused where they were named, unless ``optional``: the default
    receivers, the keyword ``groups``). ``lenient``: the senders are the scan's, not the caller's: a receiver not
    above one of them is left out for it instead of refused."""
    parallel = any(layer.parallel for layer in found.layers)
    skipped = _projections(model)
    if skipped and not optional and asked is not None and any(p.startswith(PROJECTED) for r in asked
                                                              for p in r.split("+")):
        raise InputError(skipped)
    plan = {}
    for s in chosen:
        wanted = asked if asked is not None else receivers_of(s, L, parallel) + list(GROUPS)
        if skipped:
            wanted = [r for r in wanted if not any(p.startswith(PROJECTED) for p in r.split("+"))]
        plan[s] = {}
        for r in wanted:
            try:
                cut = members(r, s, L, parallel)
            except InputError:
                if not lenient:
                    raise
                continue
            if cut:
                plan[s][r] = cut
    return plan, skipped


#: n × d a row of the cut's own: the streams it reads (a layer's input and its middle) and the input it replaces
CUT_COPIES = 3
NARROWER = ", fewer senders or receivers"


def _batches(plan_of: dict, chosen: list[str], L: int) -> dict[int, list]:
    """One batch per lowest receiver layer, a row a path."""
    by_layer: dict[int, list] = {}
    for s in chosen:
        for r, cut in plan_of[s].items():
            by_layer.setdefault(min(layer_of(c, L) for c in cut), []).append((s, r, cut))
    return by_layer


def _run(loaded, text, recipe, senders, receivers, value, on_step, budget=None, on_plan=None) -> Paths:
    models.require(loaded, "path patching")
    value = str(value).strip().lower()
    if value not in ("zero", "mean"):
        raise InputError(f"path patching removes a write by zero or mean, not {value!r}")
    L = loaded.n_layers
    chosen = None if senders is None else names(senders, "sender", L)
    asked = None if receivers is None else receivers_mod.expand(names(receivers, "receiver", L), loaded.model)
    optional = asked is None or (isinstance(receivers, str) and receivers.strip().lower() == "groups")
    opened = Opening(loaded, text, recipe, "path patching", sink=True, resumable=True)
    model, found = loaded.model, opened.found
    # refused before any forward: a receiver not above a sender the caller named, keys or queries of a family that
    # has no projection of their own
    named, _ = _plan(model, found, chosen or [], asked, L, optional=optional)
    # sized before any forward: the named paths' batches, or the scan's (its senders are not known before it runs;
    # every path's row is the same size, so the scan's plan refuses what one path's row could not run)
    sized = opened.plan([(m, len(b)) for m, b in sorted(_batches(named, chosen, L).items())] if chosen is not None
                        else causal.scan_batches(L), extra=CUT_COPIES, budget=budget,
                        note="" if chosen is not None else "then the paths of the senders the scan finds").check(NARROWER)
    if on_plan:
        on_plan(sized)
    done, lenient = 0, chosen is None
    if chosen is None:  # the scan's necessary writers, from the same opening: L forwards, counted in the progress
        def scanned(step, total):
            if on_step:
                on_step(step, total + L)  # the paths' batches: at most one a layer
        chosen = causal.scan(loaded, text, opened.recipe, value, leaders=False, on_step=scanned,
                             opening=opened, budget=sized.budget).necessary
        done = L
    plan, skipped = _plan(model, found, chosen, asked, L, lenient, optional)
    before = opened.sink()
    by_layer = _batches(plan, chosen, L)
    sized = budget_mod.with_batches(sized, [(m, len(b)) for m, b in sorted(by_layer.items())])
    if on_plan and lenient:
        on_plan(replace(sized, openings=0))  # what is left: the paths of the senders the scan found
    result = Paths(opened.recipe.to_dict(), opened.n, value, before, chosen, skipped=skipped)
    if not chosen:  # only the scan's senders can be none: a named list is never empty
        result.note = (f"the causal scan finds no necessary writer (no removal takes {causal.NECESSARY:.0%} of the "
                       "sink's attention away): no sender to trace; name senders to trace them anyway")
    total = done + len(sized.split)
    for m, whole in sorted(by_layer.items()):
        for batch in budget_mod.parts(whole, sized):  # a batch larger than the budget's rows, in parts
            cutter = receivers_mod.Cut(found, [(cut, *opened.removed(s, value)) for s, _, cut in batch], model)
            for (s, r, cut), after in zip(batch, opened.profiles(m, len(batch), cutter.pairs())):
                result.after[s, r], result.cut[s, r] = after, cut
            del cutter
            done += 1
            if on_step:
                on_step(done, total)
    order = {s: list(plan[s]) for s in chosen}
    result.after = dict(sorted(result.after.items(), key=lambda kv: (chosen.index(kv[0][0]),
                                                                     order[kv[0][0]].index(kv[0][1]))))
    return result
