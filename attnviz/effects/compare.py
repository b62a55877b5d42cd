"""Comparing two captures of the same text: attention difference, sink mass, effect on the output."""

from __future__ import annotations

import numpy as np

from attnviz.capture import Capture
from attnviz.errors import AttnvizError
from attnviz.stats import metrics


def top_tokens(cap: Capture, k: int = 5) -> list[tuple[int, float]]:
    """The k most likely next tokens as (token id, probability)."""
    order = np.argsort(cap.next_logprobs)[::-1][:k]
    return [(int(i), float(np.exp(cap.next_logprobs[i]))) for i in order]


def kl_divergence(a: Capture, b: Capture) -> float:
    """KL(P_a || P_b) of the next-token distributions, in nats."""
    pa = np.exp(a.next_logprobs.astype(np.float64))
    return float(np.sum(pa * (a.next_logprobs.astype(np.float64) - b.next_logprobs.astype(np.float64))))


def hidden_cosine(a: Capture, b: Capture) -> np.ndarray:
    """Per layer (embeddings first), the mean over tokens of the cosine similarity of hidden states."""
    if a.hidden is None or b.hidden is None:
        raise AttnvizError("hidden states were not kept; capture with Keep(hidden_states=True)")
    ha, hb = a.hidden.astype(np.float32), b.hidden.astype(np.float32)
    num = (ha * hb).sum(-1)
    den = np.linalg.norm(ha, axis=-1) * np.linalg.norm(hb, axis=-1)
    return (num / np.maximum(den, 1e-12)).mean(-1)


def sink_mass(cap: Capture, layer: int, keys: int = 1) -> np.ndarray:
    """Per head, the column-mean attention mass on the first ``keys`` keys."""
    return cap.stat(layer, "column_mean")[:, :keys].sum(-1)


def sink_keys(cap: Capture) -> np.ndarray:
    """(layers, heads) sink key of every head."""
    return np.stack([cap.stat(l, "column_mean").argmax(-1) for l in cap.layers])


def shift_rates(before: Capture, after: Capture, m: int) -> np.ndarray:
    """Per layer, the fraction of heads whose sink key moves from 0 to m."""
    return np.array([metrics.shift_rate(kb, ka, m) for kb, ka in zip(sink_keys(before), sink_keys(after))])


def where_sinks_are(cap: Capture, eps: float = metrics.SINK_EPS) -> list[dict | None]:
    """Per layer, its strongest sink (:meth:`attnviz.capture.Capture.sinks`: key, token, category, heads, share), or
    None where no key is a sink of any head: where the sink went under the capture's architecture."""
    return [next(iter(cap.sinks(layer, eps)), None) for layer in cap.layers]


def _sink_name(cap: Capture, key: int, token: str) -> str:
    """A sink key in words: "the first token", "the first '.'" (of several), "'old'" or "key 7" (a blank token)."""
    if key == 0:
        return "the first token"
    if key == metrics.LEARNED_KEY:  # the model's own learned sink (docs/methods.md#the-learned-sink-as-a-key)
        return "the learned sink"
    if not token.strip():
        return f"key {key}"
    first = cap.tokens.index(token) == key and cap.tokens.count(token) > 1
    return f"the first {token.strip()!r}" if first else repr(token.strip())


def describe_sinks(cap: Capture, eps: float = metrics.SINK_EPS, every: bool = False) -> str:
    """One sentence per distinct sink key: "the first '.' (key 10) in layers 1, 6–17", the key with the most layers
    first; or that no key is a sink. Each layer's strongest sink only (:func:`where_sinks_are`), or with ``every``
    each layer's every sink key (:meth:`attnviz.capture.Capture.sinks`, what
    :func:`attnviz.figures.sinks.sink_map` rings)."""
    from attnviz.core.spec import syntax

    by_key: dict[int, list[int]] = {}
    tokens: dict[int, str] = {}
    for layer in cap.layers:
        found = cap.sinks(layer, eps)
        for sink in found if every else found[:1]:
            by_key.setdefault(sink["key"], []).append(layer)
            tokens[sink["key"]] = sink["token"]
    if not by_key:
        return f"no key takes alpha above {eps:g} in any head of any layer"
    parts = []
    for key, layers in sorted(by_key.items(), key=lambda kv: -len(kv[1])):
        parts.append(f"{_sink_name(cap, key, tokens[key])} (key {key}) in layer{'s' if len(layers) > 1 else ''} "
                     f"{syntax.ranges(layers).replace('-', '–').replace(',', ', ')}")
    return "; ".join(parts)


def main_sink(cap: Capture, eps: float = metrics.SINK_EPS) -> str:
    """Where a capture's sink is, in one phrase: the key that is the strongest sink (:func:`where_sinks_are`) in the
    most layers, in how many, in how many another key is, and in how many no key is a sink: "the first token (key 0) in
    28 of 30 layers, no sink in 2"."""
    found = where_sinks_are(cap, eps)
    counts: dict[int, int] = {}
    for sink in found:
        if sink is not None:
            counts[sink["key"]] = counts.get(sink["key"], 0) + 1
    none = sum(sink is None for sink in found)
    if not counts:
        return f"no sink in any layer (no key takes alpha above {eps:g} in any head)"
    key = max(counts, key=lambda k: (counts[k], -k))
    token = next(s["token"] for s in found if s is not None and s["key"] == key)
    other = len(found) - counts[key] - none
    return (f"{_sink_name(cap, key, token)} (key {key}) in {counts[key]} of {len(found)} layers"
            + (f", another key in {other}" if other else "") + (f", no sink in {none}" if none else ""))
