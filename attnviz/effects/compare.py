"""Comparing two captures of the same text: attention difference, sink mass, effect on the output."""

from __future__ import annotations

import numpy as np

from attnviz.capture import Capture
from attnviz.errors import AttnvizError
from attnviz.stats import metrics


def check_same_text(a: Capture, b: Capture) -> None:
    if a.token_ids != b.token_ids:
        raise AttnvizError("the two captures are of different texts; compare captures of the same text")


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
    """Per layer, its strongest sink (:meth:`attnviz.capture.Capture.sinks`: key, token, kind, heads, share), or
    None where no key is a sink of any head: where the sink went under the capture's architecture."""
    return [next(iter(cap.sinks(layer, eps)), None) for layer in cap.layers]


def describe_sinks(cap: Capture, eps: float = metrics.SINK_EPS) -> str:
    """One sentence per distinct sink key: "the first '.' (key 10) in layers 1, 6–17", strongest key first; or that
    no key is a sink."""
    from attnviz.core import syntax

    by_key: dict[int, list[int]] = {}
    tokens: dict[int, str] = {}
    for layer, sink in zip(cap.layers, where_sinks_are(cap, eps)):
        if sink is not None:
            by_key.setdefault(sink["key"], []).append(layer)
            tokens[sink["key"]] = sink["token"]
    if not by_key:
        return f"no key takes alpha above {eps:g} in any head of any layer"
    parts = []
    for key, layers in sorted(by_key.items(), key=lambda kv: -len(kv[1])):
        token = tokens[key]
        name = ("the first token" if key == 0 else
                f"the first {token.strip()!r}" if token.strip() and cap.tokens.index(token) == key else
                f"{token.strip()!r}" if token.strip() else f"key {key}")
        parts.append(f"{name} (key {key}) in layer{'s' if len(layers) > 1 else ''} "
                     f"{syntax.ranges(layers).replace('-', '–').replace(',', ', ')}")
    return "; ".join(parts)
