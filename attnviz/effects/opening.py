"""One opening for every analysis over the sites (docs/layout.md#where-new-code-goes): a text under a recipe, opened
once, and the one batched resume of its rows with site edits.

An :class:`Opening` is made once per text and recipe. Made, it holds the recipe built and checked (the capability's
``only``, a causal mask where a perplexity is asked, a family that resumes from a layer's input where asked), the
tokens (checked against the model's limit) and every layer's sink key in the model's own windows. :meth:`Opening.sink`
runs the unpatched forward once and keeps what it made: every layer's input (the checkpoints a resumed forward starts
from), the logits and the perplexity, the sink profile, and each block's write at its layer's sink token (with its
mean over the other positions): the causal scan and path patching read the same opening, so path patching with the
scan's senders makes one unpatched forward. :meth:`Opening.resume` is the one "these rows, these site edits, from
layer l" (the engine's named sites and its one resumed forward); :meth:`Opening.profiles` reads a sink profile a row
from it. Activation patching and score attribution open their texts here too and run their own forward
(:meth:`Opening.forward`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnviz.core import engine
from attnviz.core.engine import sites
from attnviz.core.loading import models
from attnviz.core.model import anatomy as anatomy_mod
from attnviz.core.record.sink_recorders import SinkColumn
from attnviz.core.spec import allowsets
from attnviz.core.spec.arch import Architecture
from attnviz.effects import budget as budget_mod
from attnviz.errors import InputError
from attnviz.recipe import Recipe, build
from attnviz.stats import metrics
from attnviz.tokens import tokenize


@dataclass
class SinkProfile:
    """The attention on each layer's sink key (mean over heads of alpha at the mask's auto key) and the text's
    perplexity, under one recipe."""

    keys: list[int]
    attention: list[float]
    perplexity: float
    tokens: int = 0


def perplexities(logits: torch.Tensor, targets: torch.Tensor) -> list[float]:
    """Each batch row's perplexity of ``targets`` (the text's tokens after the first) from its logits (B, n, V)."""
    batch, vocab = logits.shape[0], logits.shape[-1]
    nll = torch.nn.functional.cross_entropy(  # fused: no (B, n, V) log-probabilities written
        logits[:, :-1].reshape(-1, vocab), targets.to(logits.device).repeat(batch), reduction="none")
    return [float(np.exp(row.double().mean().item())) for row in nll.view(batch, -1).cpu()]


def chunk_positions(vocab: int, nbytes: int | None = None) -> int:
    """Positions a step of :func:`perplexities_of` reads: their logits, in the model's dtype and fp32, and the
    cross-entropy's log-probabilities beside them, within ``nbytes`` (None: :data:`attnviz.effects.budget.LOGITS_BYTES`)."""
    return max(1, (budget_mod.LOGITS_BYTES if nbytes is None else nbytes) // (vocab * 12))


def perplexities_of(model, hidden: torch.Tensor, targets: torch.Tensor) -> list[float]:
    """Each batch row's perplexity of ``targets`` from the last layer's output ``hidden`` (B, n, d), before the final
    norm: the model's head (:mod:`attnviz.core.model.head`) applied a row and a few positions at a time
    (:func:`chunk_positions`), so that no row's (n, V) logits are ever whole. The head reads each position alone, so
    the numbers are :func:`perplexities` of the whole logits."""
    from attnviz.core.engine.forward import head_logits

    batch, n = hidden.shape[:2]
    step = chunk_positions(model.get_output_embeddings().weight.shape[0])
    targets = targets.to(hidden.device)
    out = []
    for row in range(batch):
        sums = [torch.nn.functional.cross_entropy(  # each step's logits freed before the next is made
            head_logits(model, hidden[row:row + 1, a:min(a + step, n - 1)], last_only=False)[0].float(),
            targets[a:a + step], reduction="sum") for a in range(0, n - 1, step)]
        total = float(torch.stack(sums).double().sum()) if sums else 0.0  # one host sync a row
        out.append(float(np.exp(total / max(n - 1, 1))))
    return out


def windows_of(loaded) -> list:
    """Each layer's own sliding window (None where it has none, or where the anatomy cannot map the family)."""
    try:
        return [layer.window for layer in anatomy_mod.of(loaded.model).layers]
    except InputError:
        return [None] * loaded.n_layers


def require_sink(masks, n: int, windows, arch: str) -> None:
    """Refuse, before any forward, a text too short to have a sink key in any layer (a key that every later query
    may see, docs/methods.md#auto-key): NoSink-FWD(m) hides the first m keys, so a text of m + 1 tokens has none,
    and every number after would be NaN."""
    for mask, window in zip(masks, windows):
        allow = allowsets.allowed(mask, n, window, metrics.auto_key_limit(n)).numpy()
        key = metrics.auto_key(allow)
        if allow[key + 1:, key].size and allow[key + 1:, key].all():
            return
    raise InputError(f"the text's {n} tokens are too short to have a sink key under {arch} (a key among its first "
                     "half that every later query may see): give a longer text")


class Opening:
    """One text under one recipe, opened for ``what`` (the capability's name, in every refusal). ``sink``: the
    analysis measures the sink and the perplexity (a causal mask, a sink key somewhere, a layer above another);
    ``resumable``: it resumes from a layer's input (refused where the family cannot)."""

    def __init__(self, loaded, text: str, recipe="fwd", what: str = "this analysis", sink: bool = False,
                 resumable: bool = False, _from: "Opening | None" = None):
        self.loaded, self.model, self.what = loaded, loaded.model, what
        if not isinstance(text, str):
            raise InputError(f"{what} reads a text (a string), not {type(text).__name__}")
        if _from is None:
            models.require(loaded, what)
            if not isinstance(recipe, (str, Recipe, Architecture)):
                raise InputError(f"{what} runs under a recipe (an architecture string such as 'fwd', or a Recipe), "
                                 f"not {type(recipe).__name__}")
            self.recipe = Recipe.of(loaded, recipe)
            self.built = build(loaded, self.recipe).only(what, "intervene", "prepend", "kind")
            if sink:
                # refused, not measured without it: docs/methods.md#path-patching says why
                self.built.architecture.require_causal(f"run {what}, which measures the text's perplexity,")
            if sink or resumable:
                self.found = anatomy_mod.of(self.model)
                if resumable and not self.found.resumable:
                    raise InputError(f"{what} resumes each patched forward from a layer's input: "
                                     f"{self.found.why_not_resumable}")
        else:
            self.recipe, self.built = _from.recipe, _from.built
        self.ids, self.tokens = tokenize(loaded, text, prepend=self.recipe.prepend)
        self.built.check_text(len(self.ids))
        self.run = None  # the forward that kept every layer's input, once run
        self._sink = None
        if sink:
            if self.L < 2:
                raise InputError(f"{what} needs a layer above the blocks it removes: this model has one layer")
            windows = [layer.window for layer in self.found.layers]
            require_sink(self.built.architecture.layers, self.n, windows, self.built.recipe.arch)
            self.sink_keys = engine.sink_keys(self.built.architecture.layers, self.n, windows)

    def plan(self, batches, extra: int = 0, held_layers: float = 1.0, openings: int = 1, head: bool = True,
             budget=None, before=0, note: str = ""):
        """The plan of this analysis on this text (:func:`attnviz.effects.budget.make`): ``batches`` (the layer each
        resumes from, its rows), under the recipe's distinct allow-sets, within ``budget`` bytes (None: the memory
        budget's)."""
        windows = windows_of(self.loaded)
        allow_sets = len({(repr(mask), window) for mask, window in zip(self.built.architecture.layers, windows)})
        return budget_mod.make(self.what, self.loaded, self.n, batches, held_layers=held_layers, extra=extra,
                               openings=openings, head=head, allow_sets=allow_sets, given_budget=budget,
                               before=before, note=note)

    def text(self, text: str) -> "Opening":
        """Another text under the same recipe, built once (activation patching's clean and corrupted texts)."""
        return Opening(self.loaded, text, what=self.what, _from=self)

    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def L(self) -> int:
        return self.loaded.n_layers

    @property
    def computes(self):
        return self.built.computes

    def batch(self, rows: int = 1) -> torch.Tensor:
        return torch.tensor([self.ids] * rows)

    def forward(self, record, feed=None, pairs=(), rows: int = 1):
        """``(logits, hidden_states or None, run)``: the recipe's whole forward of ``rows`` copies of the text, with
        ``pairs`` at their sites; a run that kept every layer's input is kept for :meth:`resume`."""
        with sites.hooks(self.model, pairs):
            out = self.built.forward(self.loaded, self.batch(rows), record, feed)
        out[2].release()  # no analysis reads a run's allow-sets: let them go now, not when the collector runs
        if len(getattr(out[2], "checkpoints", None) or ()) == self.L:
            self.run = out[2]
        return out

    def check_head(self, last_logits: torch.Tensor) -> None:
        """The logits a resumed forward reads are the model's own (checked once per model)."""
        engine.checked_head(self.model, self.batch(), self.run.checkpoints[self.L - 1], last_logits, self.computes,
                            self.what)

    def resume(self, layer: int, rows: int, pairs=(), recorders=(), computes=None) -> engine.Resumed:
        """The one batched resume: ``rows`` copies of the text from ``layer``'s kept input, under ``computes``
        (default the recipe's), with ``pairs`` at their sites and ``recorders`` recording every layer."""
        record = engine.Record.every_layer(recorders=tuple(recorders)) if recorders else engine.Record.nothing()
        with sites.hooks(self.model, pairs):
            resumed = engine.resume(self.model, self.run.checkpoints[layer], layer, self.batch(rows),
                                    computes or self.computes, record)
        resumed.run.release()  # as in forward: a loop of batches would otherwise hold every batch's allow-sets
        return resumed

    def profiles(self, layer: int, rows: int, pairs=(), computes=None, perplexity: bool = True) -> list[SinkProfile]:
        """Each row's sink profile after :meth:`resume` from ``layer`` (the layers below as the unpatched forward's);
        its perplexity NaN with ``perplexity=False`` (not computed)."""
        before = self.sink()
        column = SinkColumn()
        resumed = self.resume(layer, rows, pairs, (column,), computes)
        ppl = perplexities_of(self.model, resumed.hidden, self.targets) if perplexity else [float("nan")] * rows
        del resumed
        return [SinkProfile(self.sink_keys, [before.attention[l] if l < layer else float(column.attention(l)[i])
                                             for l in range(self.L)], ppl[i], self.n) for i in range(rows)]

    @property
    def targets(self) -> torch.Tensor:
        return torch.tensor(self.ids[1:])

    def sink(self) -> SinkProfile:
        """The unpatched forward's sink profile, made once: it keeps every layer's input, the logits (:attr:`logits`),
        and each block's write at its layer's sink token with its mean over the other positions (:attr:`writes`)."""
        if self._sink is not None:
            return self._sink
        self.writes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # in the order the forward makes them
        blocks = [("embed", sites.Site("embed", 0))] + [
            (f"{block}.{l}", sites.Site(f"{block}_out", l)) for l in range(self.L) for block in ("attn", "mlp")]
        column, last = SinkColumn(), {}
        # the last position's logits only: the perplexity reads the top layer's output a few positions at a time
        logits, _, _ = self.forward(engine.Record.every_layer(recorders=(column,), checkpoints=frozenset(range(self.L))),
                                    engine.Feed(last_logits_only=True),
                                    pairs=[(site, self._keep(name, site.layer)) for name, site in blocks]
                                    + [(sites.Site("resid_post", self.L - 1), sites.save(last, "out"))])
        self.check_head(logits.reshape(logits.shape[0], -1, logits.shape[-1])[:, -1].float())
        self._sink = SinkProfile(self.sink_keys, [float(column.attention(l)[0]) for l in range(self.L)],
                                 perplexities_of(self.model, last.pop("out"), self.targets)[0], self.n)
        return self._sink

    def _keep(self, name: str, layer: int):
        token = self.sink_keys[layer]

        def fn(value):
            write = value[0].float()
            self.writes[name] = (write[token].clone(), torch.cat([write[:token], write[token + 1:]]).mean(0))
        return fn

    def removed(self, block: str, value: str) -> tuple[int, torch.Tensor]:
        """(the sink token, what removing ``block``'s write there subtracts: the write, or less its mean over the
        other positions for ``mean``)."""
        self.sink()
        layer = 0 if block == "embed" else int(block.split(".")[1])
        at, mean = self.writes[block]
        return self.sink_keys[layer], at - mean if value == "mean" else at - 0.0
