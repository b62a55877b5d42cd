"""The :class:`Capture` every metric, figure and page reads (made by :func:`attnviz.capture.capture`): the tokens, the
architecture and each layer's mask name, the recorded probabilities (fp16 by default, softmax done in fp32) or their
statistics and pooled maps, the allow-set of every recorded layer, the next-token distribution, optional hidden
states, timing and metadata. It saves to a single ``.npz`` (arrays plus a JSON metadata string; no pickle) and loads
back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from attnviz.errors import AttnvizError, InputError
from attnviz.recipe import Recipe
from attnviz.stats import metrics
from attnviz.core.record.packed import PackedMaps
from attnviz.core.record.reduce import summarise

FORMAT = "attnviz-capture/1"
TOP_ACTIVATIONS = 8


@dataclass
class QKV:
    """One layer's queries (H, n, d), keys and values (H_kv, n, d) after RoPE, and the score scaling."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scaling: float


@dataclass
class Activations:
    """Residual-stream magnitudes (Sun et al. 2024, "Massive activations"): per layer boundary
    (embeddings first, then each layer's output) the L2 norm of every token's hidden state, and
    the largest absolute activations with the token and dimension where each sits."""

    norms: np.ndarray  # (L + 1, n) float32
    top_values: np.ndarray  # (L + 1, K) float32, descending
    top_tokens: np.ndarray  # (L + 1, K) int
    top_dims: np.ndarray  # (L + 1, K) int

    @classmethod
    def from_hidden(cls, hidden_states, k: int = TOP_ACTIVATIONS) -> "Activations":
        stacked = torch.stack([h[0].float() for h in hidden_states])  # (L + 1, n, d)
        flat = stacked.abs().flatten(1)
        top = flat.topk(min(k, flat.shape[1]), dim=1)
        d = stacked.shape[-1]
        return cls(stacked.norm(dim=-1).cpu().numpy(), top.values.cpu().numpy(),
                   (top.indices // d).cpu().numpy(), (top.indices % d).cpu().numpy())


@dataclass
class Capture:
    text: str
    tokens: list[str]
    token_ids: list[int]
    arch: str
    layer_masks: list[str]
    layers: list[int]
    kv_groups: list[int]
    allowed: dict[int, np.ndarray]  # (n_q, n_kv) per layer: the cells some head may see
    # layer -> (H, n_q, n_kv) full maps, held packed (docs/methods.md#full-maps-held-packed): a read gives the array
    probs: PackedMaps = field(default_factory=PackedMaps)
    stats: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    next_logprobs: np.ndarray | None = None
    hidden: np.ndarray | None = None
    scores: dict[int, np.ndarray] = field(default_factory=dict)  # pre-softmax QK^T/sqrt(d), (H, n, n)
    value_norm: dict[int, np.ndarray] = field(default_factory=dict)  # ||W_O^h v_j^h||, (H, n)
    activations: Activations | None = None
    qkv: dict[int, QKV] = field(default_factory=dict)  # kept in memory only (not saved: they are large)
    query_tokens: list[str] | None = None  # row labels where queries are not the keys (cross-attention)
    recipe: Recipe | None = None  # what made it (attnviz.recipe); None only for hand-made captures
    timing: dict[str, float] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    # layer -> that layer's input hidden states (n, d) on the host, in the model's dtype: a region of a
    # long capture resumes its forward from the nearest one below it (regions.of_capture). Not saved.
    checkpoints: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    # layer -> (H, n_q, n_kv): each head's own allow-set, for layers whose heads have masks of their own
    # (a headwindow intervention, a compressed cache); ``allowed`` holds the cells some head may see
    head_allowed: dict[int, np.ndarray] = field(default_factory=dict)
    # layer -> (H, n_q) float32: each row's share taken by the model's learned sink (gpt-oss), from its logits;
    # empty for a model without one (docs/methods.md#the-learned-sink-as-a-key)
    learned_sink: dict[int, np.ndarray] = field(default_factory=dict)
    _summaries: dict[int, dict[str, np.ndarray]] = field(default_factory=dict, repr=False, compare=False)
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.probs, PackedMaps):
            self.probs = PackedMaps(self.probs)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def row_tokens(self) -> list[str]:
        """The tokens down the rows of every map: the queries (the keys themselves in self-attention)."""
        return self.tokens if self.query_tokens is None else self.query_tokens

    @property
    def n_heads(self) -> int:
        return len(self.kv_groups)

    @property
    def reduced(self) -> bool:
        return not self.probs and bool(self.stats)

    def layer_probs(self, layer: int) -> np.ndarray:
        """(H, n, n) probabilities of a recorded layer, as a float32 array holding the values in the capture's storage
        dtype: float16-rounded by default (``Keep(storage_dtype=torch.float16)``; the softmax itself runs in
        float32), bfloat16-rounded under ``torch.bfloat16``; capture with ``Keep(storage_dtype=torch.float32)`` to
        keep the float32 softmax's own values (twice the memory) (docs/library.md)."""
        if layer not in self.probs:
            why = "this capture kept only statistics" if self.reduced else f"layer {layer} was not recorded"
            raise AttnvizError(f"no attention map for layer {layer}: {why} (recorded: {self.layers})")
        return self.probs[layer].astype(np.float32)

    def pool_factor(self, layer: int) -> int:
        """1 for full maps; f for a long capture's max-pooled maps (one cell per f × f tokens)."""
        if layer in self.probs or "pool_factor" not in self.stats.get(layer, {}):
            return 1
        return int(self.stats[layer]["pool_factor"])

    def layer_allowed(self, layer: int) -> np.ndarray:
        """(n_q, n_kv), or (H, n_q, n_kv) where the layer's heads have masks of their own: what every
        statistic of the layer is read through (each head through its own mask)."""
        return self.head_allowed.get(layer, self.allowed[layer])

    def layer_view(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """((H, m, m') values, allowed) of a layer: the full maps, or a long capture's max-pooled ones
        (``Keep(statistics=True, pool=...)``), whichever this capture kept. ``allowed`` is (m, m'), or
        (H, m, m') for full maps of a layer whose heads have masks of their own (:func:`head_cells` picks one)."""
        return self._pooled_or(layer, "pooled", lambda: (self.layer_probs(layer), self.layer_allowed(layer)))

    def value_view(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`layer_view` for the value-weighted maps ||A[i, j] W_O^h v_j^h||: full, or a long
        capture's max-pooled ones (``Keep(statistics=True, pool=..., value_norms=True)``)."""
        return self._pooled_or(layer, "pooled_value", lambda: (self.value_weighted(layer), self.allowed[layer]))

    def scores_view(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`layer_view` for the pre-softmax scores: full, or a long capture's max-pooled
        ones over the allowed cells (``Keep(statistics=True, pool=..., scores=True)``)."""
        return self._pooled_or(layer, "pooled_scores", lambda: (self.layer_scores(layer), self.allowed[layer]))

    def _pooled_or(self, layer: int, name: str, full):
        """The stored pooled maps ``name`` of a layer that kept no full ones, else ``full()`` (which
        raises the reason when there is nothing to show)."""
        pooled = None if layer in self.probs else self.stats.get(layer, {}).get(name)
        if pooled is None:
            return full()
        pooled = pooled.astype(np.float32)
        return pooled, ~np.isnan(pooled[0])

    def _recorded(self, store: dict, layer: int, what: str, flag: str) -> np.ndarray:
        if layer not in store:
            raise AttnvizError(f"no {what} for layer {layer}: capture with Keep({flag}=True) "
                               f"(recorded layers: {self.layers})")
        return store[layer].astype(np.float32)

    def layer_scores(self, layer: int) -> np.ndarray:
        """(H, n, n) pre-softmax scores QK^T/sqrt(d) (after a model's softcap); masked cells included."""
        return self._recorded(self.scores, layer, "pre-softmax scores", "scores")

    def layer_value_norms(self, layer: int) -> np.ndarray:
        """(H, n) ||W_O^h v_j^h||: how much key j can move the output through head h."""
        return self._recorded(self.value_norm, layer, "value norms", "value_norms")

    def layer_qkv(self, layer: int) -> QKV:
        if layer not in self.qkv:
            raise AttnvizError(f"no queries/keys/values for layer {layer}: capture with Keep(qkv=True)")
        return self.qkv[layer]

    def value_weighted(self, layer: int) -> np.ndarray:
        """(H, n, n) ||A[i, j] W_O^h v_j^h|| (Kobayashi et al. 2020), next to A[i, j] itself."""
        return metrics.value_weighted(self.layer_probs(layer), self.layer_value_norms(layer))

    def stat(self, layer: int, name: str) -> np.ndarray:
        """A per-layer statistic (:data:`metrics.STATISTICS`), from stored stats or full maps."""
        if layer in self.stats:
            if name not in self.stats[layer]:
                raise AttnvizError(f"this capture kept the statistics {sorted(self.stats[layer])}, not {name}: "
                                   "capture with Keep(statistics=True) for all of them")
            return self.stats[layer][name]
        if layer not in self._summaries:  # computed once per layer: pages ask for several statistics
            self._summaries[layer] = summarise(self.layer_probs(layer), self.layer_allowed(layer), self.tokens)
        return self._summaries[layer][name]

    def check_layer(self, layer) -> int:
        """``layer`` as a recorded layer's index; anything else (a layer not recorded, a string, a bool) is refused
        in one line naming the recorded layers."""
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or int(layer) not in self.layers:
            raise InputError(f"no recorded layer {layer!r}: this capture recorded layers {_spans(self.layers)}")
        return int(layer)

    def learned_alpha(self, layer: int) -> np.ndarray | None:
        """(H,) alpha of the model's learned sink in ``layer`` (:func:`attnviz.stats.metrics.learned_sink`); None
        where the model has none (a layer not recorded is refused)."""
        layer = self.check_layer(layer)
        share = self.learned_sink.get(layer)
        return None if share is None else metrics.learned_sink(share)

    def sinks(self, layer: int, eps: float = metrics.SINK_EPS, residual_norms=None) -> list[dict]:
        """Every key of ``layer`` that acts as a sink (:func:`attnviz.stats.metrics.sinks`), with the residual norm
        entering the layer (``residual_norms`` (n,), else where activations were kept) and the value norm where
        value norms were; the model's learned sink among them (key -1, category "learned") where it is one. A layer not
        recorded, or an ``eps`` outside 0..1, is refused."""
        layer, eps = self.check_layer(layer), metrics.check_eps(eps)
        norms = residual_norms if residual_norms is not None else (
            self.activations.norms[layer] if self.activations is not None else None)
        values = self.value_norm.get(layer) if self.value_norm else None
        return metrics.sinks(self.stat(layer, "alpha"), self.tokens, eps, norms,
                             None if values is None else values.astype(np.float32), self.learned_alpha(layer))

    def memo(self, key, compute):
        """``compute()`` once per capture and key: figures reuse heavy per-capture numbers across reruns."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def as_json(self) -> dict:
        """What `attnviz capture` prints of it beside the file it wrote (docs/cli.md)."""
        return {"model": self.meta["model"], "arch": self.arch,
                **({"intervene": self.meta["intervene"]} if self.meta.get("intervene") else {}),
                "n_tokens": self.n_tokens, "layers": self.layers,
                **({"recipe": self.recipe.to_dict()} if self.recipe else {}),
                "forward_s": round(self.timing["forward_s"], 4)}

    # --- persistence -------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_suffix(path.suffix + ".npz") if path.suffix else path.with_suffix(".npz")
        arrays: dict[str, np.ndarray] = {"token_ids": np.asarray(self.token_ids, dtype=np.int64)}
        for layer in self.layers:
            arrays[f"allowed_{layer}"] = self.allowed[layer]
            if layer in self.head_allowed:
                arrays[f"headallowed_{layer}"] = self.head_allowed[layer]
            if layer in self.probs:
                arrays[f"probs_{layer}"] = self.probs[layer]
            for name, value in self.stats.get(layer, {}).items():
                arrays[f"stat_{name}_{layer}"] = value
        if self.next_logprobs is not None:
            arrays["next_logprobs"] = self.next_logprobs
        if self.hidden is not None:
            arrays["hidden"] = self.hidden
        for layer, value in self.scores.items():
            arrays[f"scores_{layer}"] = value
        for layer, value in self.value_norm.items():
            arrays[f"valuenorm_{layer}"] = value
        for layer, value in self.learned_sink.items():
            arrays[f"learnedsink_{layer}"] = value
        if self.activations is not None:
            for name, value in vars(self.activations).items():
                arrays[f"act_{name}"] = value
        header = {
            "format": FORMAT, "text": self.text, "tokens": self.tokens, "arch": self.arch,
            **({"recipe": self.recipe.to_dict()} if self.recipe is not None else {}),
            "layer_masks": self.layer_masks, "layers": self.layers, "kv_groups": self.kv_groups,
            "timing": self.timing, "meta": self.meta,
            **({"query_tokens": self.query_tokens} if self.query_tokens is not None else {}),
        }
        arrays["header"] = np.array(json.dumps(header))
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, **arrays)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Capture":
        try:
            data = np.load(Path(path), allow_pickle=False)
            header = json.loads(str(data["header"]))
        except (OSError, KeyError, ValueError) as err:
            raise AttnvizError(f"'{path}' is not an attnviz capture file ({err})") from None
        if header.get("format") != FORMAT:
            raise AttnvizError(f"'{path}' has format {header.get('format')!r}, expected {FORMAT}")
        layers = [int(x) for x in header["layers"]]
        stats: dict[int, dict[str, np.ndarray]] = {}
        for key in data.files:
            if key.startswith("stat_"):
                name, layer = key[5:].rsplit("_", 1)
                stats.setdefault(int(layer), {})[name] = data[key]
        return cls(
            text=header["text"], tokens=header["tokens"], token_ids=data["token_ids"].tolist(),
            arch=header["arch"], layer_masks=header["layer_masks"], layers=layers,
            kv_groups=header["kv_groups"], allowed={l: data[f"allowed_{l}"] for l in layers},
            head_allowed={l: data[f"headallowed_{l}"] for l in layers if f"headallowed_{l}" in data.files},
            probs={l: data[f"probs_{l}"] for l in layers if f"probs_{l}" in data.files}, stats=stats,
            next_logprobs=data["next_logprobs"] if "next_logprobs" in data.files else None,
            hidden=data["hidden"] if "hidden" in data.files else None,
            scores={l: data[f"scores_{l}"] for l in layers if f"scores_{l}" in data.files},
            value_norm={l: data[f"valuenorm_{l}"] for l in layers if f"valuenorm_{l}" in data.files},
            learned_sink={l: data[f"learnedsink_{l}"] for l in layers if f"learnedsink_{l}" in data.files},
            activations=(Activations(**{f.name: data[f"act_{f.name}"] for f in fields(Activations)})
                         if "act_norms" in data.files else None),
            timing=header["timing"], meta=header["meta"], query_tokens=header.get("query_tokens"),
            recipe=(Recipe.from_dict(header["recipe"]) if "recipe" in header
                    else Recipe.from_meta(header["meta"], header["arch"]) if header["meta"].get("model") else None),
        )


def _spans(layers: list[int]) -> str:
    """Recorded layers in short: "0-29", or "0, 5, 29"."""
    if layers and list(layers) == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
        return f"{layers[0]}-{layers[-1]}"
    return ", ".join(map(str, layers))
