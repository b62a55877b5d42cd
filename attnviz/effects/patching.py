"""Activation patching between two texts (docs/methods.md#activation-patching), under any recipe.

Run a clean and a corrupted text of the same number of tokens; then, for every layer and every position (for
``heads``: every layer and head, the head's output at every position at once), put the clean run's activation at
that site into the corrupted run and measure a metric at the last position. The effect of each patch is
(patched − corrupted) / (clean − corrupted) of the metric: 1 restores the clean run, 0 changes nothing.

Sites (the model anatomy's modules, :mod:`attnviz.core.anatomy`; forward hooks written here, removed after, no
modelling code patched):

- ``resid``: the residual stream entering layer l (the layer's input);
- ``attn`` / ``mlp``: the block's write, as the stream adds it (a post-norm's output where the family has one);
- ``heads``: one head's output before the output projection (the input of W_O, head h's slice).

Metrics at the last position: ``logit_diff`` = logit(answer) − logit(wrong); ``kl`` = the KL divergence of the
clean run's next-token distribution from the run's (its effect: 1 − KL(patched) / KL(corrupted)); ``sink`` = the
attention of the last query on each layer's sink key (docs/methods.md#auto-key), averaged over layers and heads.
The recipe's architecture and interventions apply to every run (masks, patches, a BOS control). Each layer's
patched runs share one batched forward (positions or heads as the batch).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from attnviz.core import anatomy as anatomy_mod
from attnviz.core import engine, models
from attnviz.core.forward import check_head, head_logits
from attnviz.core.modules import output_linear
from attnviz.core.probe import output_tensor
from attnviz.core.recorders import Recorder
from attnviz.errors import InputError

SITES = ("resid", "attn", "mlp", "heads")
METRICS = ("logit_diff", "kl", "sink")


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

    def figure(self):
        from attnviz.figures.why import patching_figure

        return patching_figure(self)


def one_token(loaded, text: str, what: str) -> int:
    """The id of ``text`` as one token of the model's vocabulary (as written: " Paris" with its space), or a
    refusal in one line."""
    if not isinstance(text, str) or not text:
        raise InputError(f"--{what} is empty: give the token, as it follows the text (e.g. ' Paris')")
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = [loaded.tokenizer.decode([i]) for i in ids]
        raise InputError(f"--{what} {text!r} is {len(ids)} tokens ({', '.join(map(repr, pieces))}), not one: "
                         "the metric reads one token's logit")
    return int(ids[0])


def _site_module(found, site: str, layer: int):
    L = found[layer]
    return {"resid": L.module, "attn": L.attn_write, "mlp": L.mlp_write, "heads": None}[site] or output_linear(L.attn)


def _pre_site(site: str) -> bool:
    """Whether the site is a module's input (a pre-hook) rather than its output."""
    return site in ("resid", "heads")


class _Site:
    """Hooks at one site of every layer: ``keep`` records each layer's activation (B=1); ``put`` replaces, in row b of
    a batch, one position's (or one head's) activation with the kept clean one. The hooks act in the thread that
    made them only: the shared server's other sessions run the same model."""

    def __init__(self, loaded, site: str, layers: list[int]):
        self.found = anatomy_mod.of(loaded.model)
        self.site, self.layers = site, layers
        self.kept: dict[int, torch.Tensor] = {}
        self.heads = loaded.n_heads
        self.owner = threading.get_ident()

    def _hook(self, layer: int, change):
        if _pre_site(self.site):
            def pre(module, args, kwargs):
                if threading.get_ident() != self.owner:
                    return None
                value = args[0] if args else kwargs["hidden_states"]
                new = change(value)
                if new is None:
                    return None
                return ((new, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": new})
            return _site_module(self.found, self.site, layer).register_forward_pre_hook(pre, with_kwargs=True)

        def post(module, args, out):
            if threading.get_ident() != self.owner:
                return None
            new = change(output_tensor(out))
            if new is None:
                return None
            return (new, *out[1:]) if isinstance(out, tuple) else new
        return _site_module(self.found, self.site, layer).register_forward_hook(post)

    def keep(self) -> list:
        def keeper(layer):
            def change(value):
                self.kept[layer] = value.detach().clone()
                return None
            return change
        return [self._hook(l, keeper(l)) for l in self.layers]

    def put(self, layer: int, rows: list[int]) -> list:
        """Row b of the batch gets the clean activation at position ``rows[b]`` (``heads``: of head ``rows[b]``, at
        every position)."""
        clean = self.kept[layer]

        def change(value):
            value = value.clone()
            for b, r in enumerate(rows):
                if self.site == "heads":
                    d = value.shape[-1] // self.heads
                    value[b, :, r * d:(r + 1) * d] = clean[0, :, r * d:(r + 1) * d].to(value.dtype)
                else:
                    value[b, r] = clean[0, r].to(value.dtype)
            return value
        return [self._hook(layer, change)]


def _last_logits(built, loaded, ids: torch.Tensor, record=None) -> tuple[torch.Tensor, object]:
    logits, _, run = built.forward(loaded, ids, record or engine.Record(frozenset()),
                                   engine.Feed(last_logits_only=True))
    return logits[:, -1].float(), run


class _SinkRow(Recorder):
    """A recorder of the last query's attention on each layer's sink key (the ``sink`` metric): per layer, (B,) the
    mean over heads."""

    kind = "reduced"

    def __init__(self):
        self.values: dict[int, list] = {}
        self.n = 0

    def start(self, run, layer, inputs):
        self.n = inputs.key.shape[2]

    def block(self, run, layer, q0, k0, probs, allow):
        last, key = self.n - 1, run.sink_key(layer)
        if q0 <= last < q0 + probs.shape[-2] and k0 <= key < k0 + probs.shape[-1]:
            self.values.setdefault(layer, []).append(probs[:, :, last - q0, key - k0].float().mean(1))

    def layers(self) -> dict[int, torch.Tensor]:
        """Per recorded layer, (B,) the last query's attention on its sink key, the mean over heads."""
        return {layer: sum(v) for layer, v in self.values.items()}  # one block holds the last row

    def mean(self, below: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """The mean over every layer: the recorded ones, and ``below`` (a corrupted run's values of the layers a
        resumed run did not run again, the same for every row)."""
        per_layer = {**(below or {}), **self.layers()}
        batch = max(v.numel() for v in per_layer.values())
        return torch.stack([v.expand(batch) for v in per_layer.values()]).mean(0)


def _measure(metric: str, logits: torch.Tensor, answer: int | None, wrong: int | None,
             clean_logp: torch.Tensor | None, sink: torch.Tensor | None) -> torch.Tensor:
    """(B,) the metric of each row's last-position logits (B, V)."""
    if metric == "logit_diff":
        return logits[:, answer] - logits[:, wrong]
    if metric == "kl":
        logp = torch.log_softmax(logits, -1)
        return (clean_logp.exp() * (clean_logp - logp)).sum(-1)
    return sink


def patching(loaded, clean: str, corrupted: str, answer: str | None = None, wrong: str | None = None,
             site: str = "resid", metric: str = "logit_diff", recipe="fwd", on_layer=None) -> Patching:
    """The activation-patching grid of ``site`` (see the module docstring) from ``clean`` into ``corrupted`` under
    ``recipe`` (an architecture string or a :class:`~attnviz.recipe.Recipe`). ``answer`` and ``wrong`` (one token
    each) are needed by ``logit_diff``. ``on_layer(done, total)`` reports progress, one batched forward a layer."""
    from attnviz.recipe import Recipe, build
    from attnviz.tokens import tokenize

    models.require(loaded, "activation patching")
    site, metric = str(site).strip().lower(), str(metric).strip().lower()
    if site not in SITES:
        raise InputError(f"unknown site '{site}': expected one of {', '.join(SITES)}")
    if metric not in METRICS:
        raise InputError(f"unknown metric '{metric}': expected one of {', '.join(METRICS)}")
    answer_id = wrong_id = None
    if metric == "logit_diff":
        if answer is None or wrong is None:
            raise InputError("the logit difference needs --answer and --wrong (one token each)")
        answer_id, wrong_id = one_token(loaded, answer, "answer"), one_token(loaded, wrong, "wrong")
        if answer_id == wrong_id:
            raise InputError(f"--answer and --wrong are the same token ({answer!r})")
    recipe = Recipe.of(loaded, recipe)
    built = build(loaded, recipe).only("activation patching", "intervene", "prepend")
    ids_c, tok_c = tokenize(loaded, clean, prepend=recipe.prepend)
    ids_x, tok_x = tokenize(loaded, corrupted, prepend=recipe.prepend)
    if len(ids_c) != len(ids_x):
        raise InputError(f"the clean text has {len(ids_c)} tokens and the corrupted text {len(ids_x)}: activation "
                         "patching puts each position's activation into the same position, so they must have the "
                         "same number of tokens")
    built.check_text(len(ids_c))
    n, layers = len(ids_c), list(range(loaded.n_layers))
    sites = _Site(loaded, site, layers)
    found = anatomy_mod.of(loaded.model)
    # a patch at layer l changes nothing below l: its runs resume from the corrupted run's input of layer l
    # (the engine's resume), where the family can resume, and share one batch
    inputs = _Site(loaded, "resid", layers) if not found.resumable and built.variant is None else None

    below: dict[int, torch.Tensor] = {}  # the corrupted run's sink values by layer (the ``sink`` metric)

    def run(ids, handles=(), batch=1, start=0, keep_sink=False):
        sink = _SinkRow() if metric == "sink" else None
        record = engine.Record(None, recorders=(sink,)) if sink else engine.Record(frozenset())
        try:
            with torch.no_grad():
                if start > 0:
                    out = {}
                    hidden = inputs.kept[start][0].expand(batch, -1, -1)
                    engine.resume(loaded.model, hidden, start, torch.tensor([ids] * batch), built.computes,
                                  record, out=out)
                    logits = head_logits(loaded.model, out["hidden"]).float()
                else:
                    logits, _ = _last_logits(built, loaded, torch.tensor([ids] * batch), record)
        finally:
            for h in handles:
                h.remove()
        if sink is not None and keep_sink:
            below.update(sink.layers())
        return logits, (sink.mean({l: v for l, v in below.items() if l < start}) if sink else None)

    logits_c, sink_c = run(ids_c, sites.keep())
    logits_x, sink_x = run(ids_x, inputs.keep() if inputs is not None else (), keep_sink=True)
    if inputs is not None:  # the logits a resumed forward reads are the model's own
        top = {}
        with torch.no_grad():
            engine.resume(loaded.model, inputs.kept[n_top := loaded.n_layers - 1][0], n_top, torch.tensor([ids_x]),
                          built.computes, out=top)
        check_head(loaded.model, top["hidden"], logits_x, "activation patching")
    clean_logp = torch.log_softmax(logits_c, -1) if metric == "kl" else None
    value_c = float(_measure(metric, logits_c, answer_id, wrong_id, clean_logp, sink_c)[0])
    value_x = float(_measure(metric, logits_x, answer_id, wrong_id, clean_logp, sink_x)[0])
    if not abs(value_c - value_x) > 1e-6 * max(1.0, abs(value_c)):
        raise InputError(f"the clean and the corrupted text give the same {metric} ({value_c:.4g}): there is "
                         "nothing for a patch to restore")
    rows = list(range(loaded.n_heads)) if site == "heads" else list(range(n))
    effect = np.zeros((len(layers), len(rows)))
    for layer in layers:
        start = layer if inputs is not None else 0
        logits, sink = run(ids_x, sites.put(layer, rows), batch=len(rows), start=start)
        values = _measure(metric, logits, answer_id, wrong_id, clean_logp, sink)
        effect[layer] = ((values - value_x) / (value_c - value_x)).cpu().numpy()
        if on_layer:
            on_layer(layer + 1, len(layers))
    return Patching(site, metric, value_c, value_x, layers, list(range(n)), effect, (tok_c, tok_x),
                    rows if site == "heads" else [], answer, wrong, recipe.to_dict())
