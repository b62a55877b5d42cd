"""Head classes on repeated random tokens and dormant heads (docs/methods.md#induction-previous-token-and-duplicate-heads,
docs/methods.md#dormant-heads).

On ``samples`` seeded sequences BOS, r_1..r_L, r_1..r_L of distinct random tokens of the model's ordinary vocabulary
(Olsson et al. 2022, *In-context Learning and Induction Heads*), per (layer, head):

- induction score: the mean attention from a second-copy query i (its token first seen at j = i - L) to j + 1;
- previous-token score: the mean attention from every query i >= 2 to i - 1;
- duplicate-token score: the mean attention from a second-copy query i to j;
- each with its random-target baseline: the expected attention of the same queries to a key drawn uniformly from the
  keys the query sees, its target excluded (computed exactly, not sampled);
- a class where the score reaches ``tau`` (0.4 on every score: at L = 32 at least 6 times any baseline can be).

And the dormant head (Guo et al. 2024, arXiv 2410.13835): on the queries that need no attention its attention sits on
the sink key (the mean on key 0 above ``eps``) and its output there is small: the mean ||W_O^h sum_k p_qk v_k|| of
those queries under ``share`` (0.5) of the median of the same over the queries that need attention. On the repeated
tokens the first copy's queries need none (their next token is a fresh draw) and the second copy's need it (a copy).

Every map is the engine's (one batched forward under the recipe, a whole-layer reduction, every layer recorded).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from attnviz.core import engine
from attnviz.core.loading.models import LoadedModel
from attnviz.errors import InputError
from attnviz.stats import metrics

LENGTH = 32  # L, the repeated segment's tokens
SAMPLES = 4
TAU = 0.4  # every score's class threshold
SHARE = 0.5  # a dormant head's quiet output under this share of its active queries' median
SCORES = ("induction", "prev_token", "duplicate")


def ordinary_ids(loaded: LoadedModel) -> np.ndarray:
    """The ids a random sequence draws from: the embedding's rows (and the tokenizer's size, where it has one) less
    the tokenizer's special and added tokens."""
    tok = loaded.tokenizer
    rows = loaded.model.get_input_embeddings().num_embeddings
    size = min(rows, len(tok)) if hasattr(tok, "__len__") else rows
    special = set(getattr(tok, "all_special_ids", None) or [])
    special |= set((getattr(tok, "added_tokens_decoder", None) or {}).keys())
    return np.array([i for i in range(size) if i not in special])


def bos_of(loaded: LoadedModel) -> int | None:
    """The tokenizer's BOS id, or None (then key 0 is one more random token)."""
    return getattr(loaded.tokenizer, "bos_token_id", None)


def repeated_tokens(vocabulary, length: int = LENGTH, samples: int = SAMPLES, seed: int = 0,
                    bos: int | None = None) -> torch.Tensor:
    """(samples, 2L + 1): BOS (or a random token), r_1..r_L, r_1..r_L, the L tokens distinct, seeded."""
    vocabulary = np.asarray(vocabulary)
    if not isinstance(length, int) or length < 2:
        raise InputError(f"the repeated segment is a whole number of at least 2 tokens, not {length!r}")
    if length + 1 > len(vocabulary):
        raise InputError(f"the vocabulary has {len(vocabulary)} ordinary tokens: too few for L = {length} distinct "
                         "ones and a first token")
    if not isinstance(samples, int) or samples < 1:
        raise InputError(f"the sequences are a whole number of at least 1, not {samples!r}")
    rng = np.random.default_rng(seed)
    out = np.empty((samples, 2 * length + 1), dtype=np.int64)
    for row in range(samples):
        drawn = vocabulary[rng.permutation(len(vocabulary))[:length + 1]]
        out[row, 0] = drawn[length] if bos is None else bos
        out[row, 1:length + 1] = out[row, length + 1:] = drawn[:length]
    return torch.from_numpy(out)


def targets(length: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each score's (queries, target keys) on a sequence of 2L + 1 tokens, BOS at 0."""
    second = np.arange(length + 1, 2 * length + 1)
    every = np.arange(2, 2 * length + 1)
    return {"induction": (second, second - length + 1), "prev_token": (every, every - 1),
            "duplicate": (second, second - length)}


def scores(probs: np.ndarray, allow: np.ndarray, length: int) -> dict[str, np.ndarray]:
    """Per score, (H,) its value and ``<name>_baseline``, from maps (B, H, n, n) and allow-sets broadcast to them,
    averaged over the B sequences (docs/methods.md#induction-previous-token-and-duplicate-heads)."""
    probs = np.asarray(probs, dtype=np.float64)
    allow = np.broadcast_to(np.asarray(allow, dtype=bool), probs.shape)
    out = {}
    for name, (q, t) in targets(length).items():
        hit = probs[..., q, t]  # (B, H, queries)
        seen = allow[..., q, :]
        target_seen = allow[..., q, t]
        rest = (probs[..., q, :] * seen).sum(-1) - np.where(target_seen, hit, 0.0)
        others = seen.sum(-1) - target_seen
        with np.errstate(invalid="ignore", divide="ignore"):
            base = np.where(others > 0, rest / others, np.nan)
        out[name] = hit.mean(-1).mean(0)
        out[f"{name}_baseline"] = np.nanmean(base, axis=-1).mean(0)
    return out


def query_outputs(probs: np.ndarray, values: np.ndarray, w_o: np.ndarray) -> np.ndarray:
    """(B, H, n) ||W_O^h sum_k p_qk v_k|| per query (values (B, H_kv, n, d), W_O (hidden, H * d))."""
    heads = probs.shape[1]
    values = np.asarray(values, dtype=np.float64)
    v = np.repeat(values, heads // values.shape[1], axis=1)
    out = np.einsum("bhqk,bhkd->bhqd", np.asarray(probs, dtype=np.float64), v)
    per_head = np.asarray(w_o, dtype=np.float64).reshape(w_o.shape[0], heads, v.shape[-1])
    return np.linalg.norm(np.einsum("bhqd,ohd->bhqo", out, per_head), axis=-1)


def dormancy(probs: np.ndarray, outputs: np.ndarray, quiet: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(H,) the mean attention on key 0 of the quiet queries, and (H,) the mean output norm of the quiet queries over
    the median of the active ones' (NaN without either), from maps (B, H, n, n), outputs (B, H, n) and masks (B, n).
    Query 0 never counts: it has one key."""
    quiet, active = np.array(quiet, dtype=bool), np.array(active, dtype=bool)
    quiet[:, 0] = active[:, 0] = False
    heads = probs.shape[1]
    on_key0 = np.moveaxis(np.asarray(probs)[..., 0], 1, -1)[quiet]  # (queries, H)
    out = np.moveaxis(np.asarray(outputs), 1, -1)  # (B, n, H)
    if not quiet.any() or not active.any():
        return (on_key0.mean(0) if quiet.any() else np.full(heads, np.nan)), np.full(heads, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        return on_key0.mean(0), out[quiet].mean(0) / np.median(out[active], axis=0)


def _maps(layer, probs, allow):
    """The engine's whole-layer reduction: the layer's maps and allow-sets on the host, as they are."""
    return probs.float().cpu().numpy(), allow.expand_as(probs).cpu().numpy()


def maps_and_outputs(loaded: LoadedModel, ids: torch.Tensor, recipe="fwd"):
    """One batched forward of ``ids`` (B, n) under ``recipe``, every layer recorded: per layer (maps (B, H, n, n),
    allow-sets, per-query head outputs (B, H, n))."""
    from attnviz.recipe import build

    built = build(loaded, recipe).only("head classes on repeated tokens", "intervene", "kind")
    _, _, run = built.forward(loaded, ids, engine.Record.every_layer(reducer=_maps, qkv=True))
    modules = engine.attention_modules(loaded.model)
    found = []
    for layer in range(loaded.n_layers):
        probs, allow = run.reduced[layer]
        w_o = engine.output_projection(modules[layer]).detach().float().cpu().numpy()
        found.append((probs, allow, query_outputs(probs, run.qkv[layer][2].float().numpy(), w_o)))
    run.release()
    return found


@dataclass(frozen=True)
class HeadScores:
    """Every head's scores on the repeated tokens, (L, H) each, and the thresholds of its classes."""

    model: str
    arch: str
    length: int
    samples: int
    seed: int
    values: dict  # name -> (layers, heads): the SCORES, their baselines, quiet_key0, dormant_ratio
    tau: float = TAU
    eps: float = metrics.SINK_EPS
    share: float = SHARE

    def __getitem__(self, name: str) -> np.ndarray:
        return self.values[name]

    def holds(self, name: str) -> np.ndarray:
        """(L, H) bool: the class ``name`` (a score's, or ``dormant``) holds."""
        if name == "dormant":
            ratio = np.nan_to_num(self.values["dormant_ratio"], nan=np.inf)
            return (np.nan_to_num(self.values["quiet_key0"], nan=0.0) > self.eps) & (ratio < self.share)
        return np.nan_to_num(self.values[name], nan=-1.0) >= self.tau

    def with_thresholds(self, tau=None, eps=None, share=None) -> "HeadScores":
        return replace(self, tau=self.tau if tau is None else tau, eps=self.eps if eps is None else eps,
                       share=self.share if share is None else share)

    def heads_of(self, name: str) -> list[tuple[int, int, float]]:
        """(layer, head, score) of every head of class ``name``, the highest score first."""
        found = [(int(l), int(h), float(self.values[name][l, h])) for l, h in zip(*np.nonzero(self.holds(name)))]
        return sorted(found, key=lambda x: -x[2])

    def as_json(self) -> dict:
        def num(x):
            return None if not np.isfinite(x) else round(float(x), 6)

        names = [*SCORES, *(f"{s}_baseline" for s in SCORES), "quiet_key0", "dormant_ratio"]
        return {"model": self.model, "arch": self.arch, "length": self.length, "samples": self.samples,
                "seed": self.seed, "tau": self.tau, "eps": self.eps, "share": self.share,
                "layers": [{"layer": layer, "heads": [
                    {"head": h, **{n: num(self.values[n][layer, h]) for n in names},
                     **{f"{c}_head" if c != "dormant" else c: bool(self.holds(c)[layer, h])
                        for c in (*SCORES, "dormant")}}
                    for h in range(self.values["induction"].shape[1])]}
                    for layer in range(self.values["induction"].shape[0])]}


def repeated(loaded: LoadedModel, recipe="fwd", length: int = LENGTH, samples: int = SAMPLES, seed: int = 0,
             tau: float = TAU, eps: float = metrics.SINK_EPS, share: float = SHARE, vocabulary=None,
             bos: int | None = None) -> HeadScores:
    """Every head's induction, previous-token and duplicate-token scores with their baselines, and its dormancy, on
    ``samples`` sequences BOS, r_1..r_L, r_1..r_L (``vocabulary``: the ids to draw from, default
    :func:`ordinary_ids`; ``bos``: default the tokenizer's)."""
    from attnviz.recipe import build

    eps = metrics.check_eps(eps)
    if not (tau >= 0 and share >= 0):
        raise InputError(f"tau and share are at least 0, not {tau}, {share}")
    if 2 * length + 1 > loaded.max_tokens:
        raise InputError(f"2L + 1 = {2 * length + 1} tokens is longer than {loaded.model_id}'s context "
                         f"({loaded.max_tokens}): give a shorter L")
    vocabulary = ordinary_ids(loaded) if vocabulary is None else vocabulary
    ids = repeated_tokens(vocabulary, length, samples, seed, bos_of(loaded) if bos is None else bos)
    quiet = np.zeros(ids.shape, dtype=bool)
    quiet[:, 1:length + 1] = True  # the first copy: the next token is a fresh draw
    active = np.zeros(ids.shape, dtype=bool)
    active[:, length + 1:2 * length] = True  # the second copy's queries whose next token is a copy
    values: dict[str, list] = {}
    for probs, allow, outputs in maps_and_outputs(loaded, ids, recipe):
        found = scores(probs, allow, length)
        found["quiet_key0"], found["dormant_ratio"] = dormancy(probs, outputs, quiet, active)
        for name, value in found.items():
            values.setdefault(name, []).append(value)
    arch = build(loaded, recipe).architecture.spec
    return HeadScores(loaded.model_id, arch, length, samples, seed, {k: np.array(v) for k, v in values.items()},
                      tau, eps, share)
