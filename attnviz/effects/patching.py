"""Activation patching between two texts (docs/methods.md#activation-patching), under any recipe.

Run a clean and a corrupted text of the same number of tokens; then, for every layer and every position (for
``heads``: every layer and head, the head's output at every position at once), put the clean run's activation at
that site into the corrupted run and measure a metric at the last position. The effect of each patch is
(patched − corrupted) / (clean − corrupted) of the metric: 1 restores the clean run, 0 changes nothing.

Sites (the engine's named sites, :mod:`attnviz.core.engine.sites`, docs/methods.md#sites; no modelling code patched):

- ``resid``: the residual stream entering layer l (the layer's input);
- ``attn`` / ``mlp``: the block's write, as the stream adds it (a post-norm's output where the family has one);
- ``heads``: one head's output before the output projection (the input of W_O, head h's slice).

A metric is a function of a run's logits at the last position (and, where it asks, the sink's attention by layer)
that gives one number a batch row; three are named: ``logit_diff`` = logit(answer) − logit(wrong); ``kl`` = the KL
divergence of the clean run's next-token distribution from the run's (its effect: 1 − KL(patched) / KL(corrupted));
``sink`` = the attention of the last query on each layer's sink key (docs/methods.md#auto-key), averaged over layers
and heads.
The recipe's architecture and interventions apply to every run (masks, patches, a BOS control). Each layer's
patched runs share one batched forward (positions or heads as the batch).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from attnviz.core.model import anatomy as anatomy_mod
from attnviz.core import engine
from attnviz.core.engine import sites
from attnviz.core.loading import models
from attnviz.core.record.sink_recorders import SinkCell
from attnviz.effects import budget as budget_mod
from attnviz.effects.opening import Opening
from attnviz.errors import InputError

SITES = ("resid", "attn", "mlp", "heads")
METRICS = ("logit_diff", "kl", "sink")
#: The app's default example: the same number of tokens, the clean run prefers ``answer`` and the corrupted run
#: ``wrong`` (on the default model, SmolLM2-135M: logit(answer) − logit(wrong) is 4.81 clean, −9.06 corrupted).
EXAMPLE = {"clean": "The Eiffel Tower is located in the city of",
           "corrupted": "The Colosseum is located in the city of", "answer": " Paris", "wrong": " Rome"}


@dataclass
class Patching:
    """One grid of activation patches: ``effect`` (layers, positions) or (layers, heads)."""

    site: str
    metric: str
    clean: float
    corrupted: float
    layers: list[int]
    positions: list[int]  # the patched positions (every position for ``heads``: the head's output at all at once)
    effect: np.ndarray
    tokens: tuple[list[str], list[str]]  # the clean and the corrupted text's tokens
    heads: list[int] = field(default_factory=list)  # ``heads`` only
    answer: str | None = None
    wrong: str | None = None
    recipe: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        r = lambda x: None if not np.isfinite(x) else round(float(x), 6)  # noqa: E731
        return {"site": self.site, "metric": self.metric, "clean": r(self.clean), "corrupted": r(self.corrupted),
                "layers": self.layers, "positions": self.positions,
                **({"heads": self.heads} if self.site == "heads" else {}),
                "effect": [[r(x) for x in row] for row in self.effect],
                "tokens": {"clean": self.tokens[0], "corrupted": self.tokens[1]},
                **({"answer": self.answer, "wrong": self.wrong} if self.metric == "logit_diff" else {}),
                "recipe": self.recipe}


def one_token(loaded, text: str, what: str) -> int:
    """The id of ``text`` as one token of the model's vocabulary (as written: " Paris" with its space), or a
    refusal in one line."""
    if not isinstance(text, str):
        raise InputError(f"the {what} token is {text!r}, not a string: give the token as text, as it follows the "
                         "text (e.g. ' Paris')")
    if not text:
        raise InputError(f"the {what} token is empty: give the token, as it follows the text (e.g. ' Paris')")
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = [loaded.tokenizer.decode([i]) for i in ids]
        raise InputError(f"the {what} token {text!r} is {len(ids)} tokens ({', '.join(map(repr, pieces))}), not "
                         "one: the metric reads one token's logit")
    return int(ids[0])


# each site as the named sites call it (docs/methods.md#sites), and where a patch of one batch row puts the clean value
_SITE = {"resid": "resid_pre", "attn": "attn_out", "mlp": "mlp_out", "heads": "head_z"}


def _setter(site: str, clean: torch.Tensor, rows: list[int]):
    """Row b of the batch gets the clean activation at position ``rows[b]`` (``heads``: of head ``rows[b]``, at every
    position)."""
    if site == "heads":
        return sites.put(clean, range(len(rows)), heads=rows)
    return sites.put(clean, range(len(rows)), positions=rows)


def _metric(metric, loaded, answer, wrong) -> tuple[str, Callable, bool]:
    """(its name, ``fn(logits, attention, clean_logp)`` → (B,), whether it reads the sink's attention)."""
    if callable(metric):
        takes = len([p for p in inspect.signature(metric).parameters.values()
                     if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
        if takes not in (1, 2):
            raise InputError("a metric is a function of the run's logits (B, V) at the last position, or of them and "
                             "its sink attention by layer: metric(logits) or metric(logits, attention)")
        name = getattr(metric, "__name__", "custom")
        called = "the metric" if name.startswith("<") or name == "custom" else f"the metric {name}"

        def fn(logits, attention, _):
            try:
                values = metric(logits, attention) if takes == 2 else metric(logits)
            except Exception as err:  # the caller's own function: its failure is bad input, in one line
                raise InputError(f"{called} failed on a run's logits {tuple(logits.shape)}: {type(err).__name__}: "
                                 f"{err}") from err
            return checked(called, values, logits.shape[0])
        return name, fn, takes == 2
    metric = str(metric).strip().lower()
    if metric not in METRICS:
        raise InputError(f"unknown metric '{metric}': expected one of {', '.join(METRICS)}, or a function of the logits")
    if metric != "logit_diff" and (answer is not None or wrong is not None):
        raise InputError(f"the {metric} metric reads no answer or wrong token: give answer and wrong with the "
                         "logit_diff metric only")
    name, fn, reads = _builtin(metric, loaded, answer, wrong)
    # a named metric's result is checked as a caller's is (a half-precision overflow, a layer with no sink key)
    return name, (lambda logits, attention, clean: checked(f"the {name} metric", fn(logits, attention, clean),
                                                           logits.shape[0])), reads


def _builtin(metric: str, loaded, answer, wrong) -> tuple[str, Callable, bool]:
    if metric == "logit_diff":
        if answer is None or wrong is None:
            raise InputError("the logit difference needs an answer and a wrong token (one token each)")
        a, w = one_token(loaded, answer, "answer"), one_token(loaded, wrong, "wrong")
        if a == w:
            raise InputError(f"the answer and the wrong token are the same token ({answer!r})")
        return metric, (lambda logits, attention, _: logits[:, a] - logits[:, w]), False
    if metric == "kl":
        def kl(logits, attention, clean_logp):
            logp = torch.log_softmax(logits, -1)
            return (clean_logp.exp() * (clean_logp - logp)).sum(-1)
        return metric, kl, False
    return metric, (lambda logits, attention, _: _mean_over_layers(attention)), True


def checked(called: str, values, rows: int) -> torch.Tensor:
    """A metric's result as the grid reads it, or a refusal in one line naming ``called``: a torch tensor of shape
    (rows,), one finite real number a batch row."""
    if isinstance(values, torch.Tensor):
        what = f"a {values.dtype} tensor of shape {tuple(values.shape)}"
        ok = tuple(values.shape) == (rows,) and not values.dtype.is_complex and values.dtype != torch.bool
        if ok and not torch.isfinite(values.float()).all():
            raise InputError(f"{called} returned {_short(values.detach().cpu().tolist())}: a metric gives one "
                             "finite number a batch row")
    else:
        what = (f"a {type(values).__module__}.{type(values).__name__} of shape {tuple(values.shape)}"
                if hasattr(values, "shape") else f"{_short(values)} ({type(values).__name__})")
        ok = False
    if not ok:
        raise InputError(f"{called} returned {what}: a metric returns a torch tensor of shape ({rows},), one finite "
                         "number a batch row")
    return values


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _mean_over_layers(attention: dict[int, torch.Tensor]) -> torch.Tensor:
    return torch.stack(list(attention.values())).mean(0)


def patching(loaded, clean: str, corrupted: str, answer: str | None = None, wrong: str | None = None,
             site: str = "resid", metric="logit_diff", recipe="fwd", on_layer=None, budget: int | None = None,
             on_plan: Callable | None = None) -> Patching:
    """The activation-patching grid of ``site`` (see the module docstring) from ``clean`` into ``corrupted`` under
    ``recipe`` (an architecture string or a :class:`~attnviz.recipe.Recipe`). ``metric``: a named one, or a function
    of the run's last-position logits (B, V) returning (B,), ``metric(logits)``, or of them and the sink's attention,
    ``metric(logits, attention)`` (by layer, (B,) the last query's attention on that layer's sink key, the mean over
    heads). ``answer`` and ``wrong`` (one token each) are read by ``logit_diff`` only. ``on_layer(done, total)``
    reports progress, one batched forward a layer (its parts, where the budget splits it, each counted).

    Sized before it runs (:mod:`attnviz.effects.budget`): a layer's rows (one a position, or a head) run in parts
    that fit ``budget`` bytes beyond the weights (None: the memory budget's), the plan given to ``on_plan``; refused
    before any forward where one row does not fit."""
    models.require(loaded, "activation patching")
    site = str(site).strip().lower()
    if site not in SITES:
        raise InputError(f"unknown site '{site}': expected one of {', '.join(SITES)}")
    name, measure, reads_sink = _metric(metric, loaded, answer, wrong)
    opened_c = Opening(loaded, clean, recipe, "activation patching")
    opened = opened_c.text(corrupted)
    if opened_c.n != opened.n:
        raise InputError(f"the clean text has {opened_c.n} tokens and the corrupted text {opened.n}: activation "
                         "patching puts each position's activation into the same position, so they must have the "
                         "same number of tokens")
    n, layers, model = opened.n, list(range(loaded.n_layers)), loaded.model
    # a patch at layer l changes nothing below l: its runs resume from the corrupted run's input of layer l (the
    # engine's checkpoints and resume), where the family can resume, and share one batch
    resumes = anatomy_mod.of(model).resumable and opened.built.variant is None
    rows = list(range(loaded.n_heads)) if site == "heads" else list(range(n))
    # held throughout: the clean run's activation at every layer and the corrupted run's every layer input
    sized = opened.plan([(layer if resumes else 0, len(rows)) for layer in layers], extra=1,
                        held_layers=2 if resumes else 1, openings=2, head=False,
                        budget=budget).check(", or the heads site (a row a head, not a position)" if site != "heads"
                                             else "")
    if on_plan:
        on_plan(sized)
    below: dict[int, torch.Tensor] = {}  # the corrupted run's sink values by layer (layers a resumed run skips)

    def run(text: Opening, pairs=(), batch=1, start=0, keep_inputs=False):
        sink = SinkCell() if reads_sink else None
        with torch.no_grad():
            if start > 0:
                logits = text.resume(start, batch, pairs, (sink,) if sink else ()).logits(model).float()
            else:
                inputs = frozenset(layers) if keep_inputs else frozenset()
                record = (engine.Record.every_layer(recorders=(sink,), checkpoints=inputs) if sink
                          else engine.Record.nothing(checkpoints=inputs))
                logits = text.forward(record, engine.Feed(last_logits_only=True), pairs, batch)[0][:, -1].float()
        attention = {**{l: v.expand(batch) for l, v in below.items() if l < start}, **sink.layers()} if sink else None
        return logits, attention

    kept: dict[int, torch.Tensor] = {}
    logits_c, sink_c = run(opened_c, [(sites.Site(_SITE[site], l), sites.save(kept, l)) for l in layers])
    logits_x, sink_x = run(opened, keep_inputs=resumes)
    if sink_x is not None:
        below.update(sink_x)
    if resumes:  # the logits a resumed forward reads are the model's own (once per model)
        opened.check_head(logits_x)
    clean_logp = torch.log_softmax(logits_c, -1)
    # the metric read once on both unpatched runs as one batch of two rows: a result that is not one finite number
    # a row (a custom metric's) is refused here, before any patched forward
    both = {l: torch.cat([sink_c[l], sink_x[l]]) for l in sink_c} if sink_c is not None else None
    value_c, value_x = (float(v) for v in measure(torch.cat([logits_c, logits_x]), both, clean_logp))
    if not abs(value_c - value_x) > 1e-6 * max(1.0, abs(value_c)):
        raise InputError(f"the clean and the corrupted text give the same {name} ({value_c:.4g}): there is "
                         "nothing for a patch to restore")
    effect = np.zeros((len(layers), len(rows)))
    done, total = 0, len(sized.split)
    for layer in layers:
        at = 0
        for part in budget_mod.parts(rows, sized):  # a layer's rows, in parts where the budget splits them
            setter = [(sites.Site(_SITE[site], layer), _setter(site, kept[layer], part))]
            logits, attention = run(opened, setter, batch=len(part), start=layer if resumes else 0)
            values = measure(logits, attention, clean_logp)
            effect[layer, at:at + len(part)] = ((values.float() - value_x) / (value_c - value_x)).cpu().numpy()
            at += len(part)
            done += 1
            if on_layer:
                on_layer(done, total)
    return Patching(site, name, value_c, value_x, layers, list(range(n)), effect, (opened_c.tokens, opened.tokens),
                    rows if site == "heads" else [], answer, wrong, opened.recipe.to_dict())
