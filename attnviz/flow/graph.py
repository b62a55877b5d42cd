"""The contribution graph of one token (docs/methods.md#routes), and where the attention flow comes from.

From the chosen token's stream at the top, walking down one block at a time, an edge is kept when its contribution
(:mod:`attnviz.flow.contributions`) is at least the threshold τ, and only into nodes already kept. Nodes are a
token's stream after a layer's attention ("attn") and after its MLP ("mlp"; layer -1 is the first layer's input).
Edges: ``attn`` (a source token through one head, or the heads summed), ``mlp`` (the MLP of the same token),
``residual`` (the stream going past a block); ``block`` says which block an edge crosses. Kept edges keep their
contributions, or, with ``renormalise``, the edges kept into each node are divided by their sum (the LLM Transparency
Tool's renormalising threshold).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from attnviz.errors import InputError
from attnviz.flow.trace import FLOOR, Flow, token_index

THRESHOLD = 0.04  # Ferrando & Voita's default


@dataclass(frozen=True)
class Edge:
    layer: int
    via: str  # what carries it: "attn" (a head, or the heads summed) | "mlp" | "residual" (the stream past a block)
    block: str  # the block it crosses: "attn" | "mlp"
    head: int | None
    source: int  # token the edge comes from
    target: int  # token it goes to
    weight: float
    parallel: bool = False  # an MLP edge of a parallel block: the MLP reads the layer's input

    @property
    def levels(self) -> tuple[tuple[int, str], tuple[int, str]]:
        """((layer, point) of its source node, (layer, point) of its target node)."""
        if self.block == "attn":
            return (self.layer - 1, "mlp"), (self.layer, "attn")
        if self.parallel and self.via == "mlp":
            return (self.layer - 1, "mlp"), (self.layer, "mlp")
        return (self.layer, "attn"), (self.layer, "mlp")

    def as_json(self) -> dict:
        return {"layer": self.layer, "via": self.via, "block": self.block, "head": self.head, "from": self.source,
                "to": self.target, "weight": round(float(self.weight), 6)}


@dataclass
class Graph:
    flow: Flow
    token: int
    threshold: float
    heads: str  # "split" (one edge per head) or "sum"
    edges: list[Edge]
    renormalise: bool = False  # each node's kept edges divided by their sum

    def nodes(self) -> set[tuple[int, str, int]]:
        """Every kept node as (layer, point, token)."""
        out = {(self.flow.n_layers - 1, "mlp", self.token)}
        for edge in self.edges:
            (la, pa), (lb, pb) = edge.levels
            out |= {(la, pa, edge.source), (lb, pb, edge.target)}
        return out

    def sink_share(self) -> list[float | None]:
        """Per layer: of the kept attention edges' weight, the share whose source is the layer's sink key (None where
        no attention edge is kept)."""
        kept = np.zeros(self.flow.n_layers)
        sink = np.zeros(self.flow.n_layers)
        for edge in self.edges:
            if edge.via == "attn":
                kept[edge.layer] += edge.weight
                sink[edge.layer] += edge.weight if edge.source == self.flow.sink_keys[edge.layer] else 0.0
        return [float(s / k) if k > 0 else None for s, k in zip(sink, kept)]

    def as_json(self) -> dict:
        flow = self.flow
        return {"tokens": flow.tokens, "token": self.token, "threshold": self.threshold, "heads": self.heads,
                "renormalise": self.renormalise, "edges": [edge.as_json() for edge in self.edges], "sink_share": self.sink_share(),
                "sink_share_all": sink_share_all(flow, self.threshold), "sink_keys": flow.sink_keys,
                "recipe": flow.recipe.to_dict(), "model": flow.meta.get("model")}


def check(threshold: float, heads: str = "split", floor: float = FLOOR) -> None:
    """Refuse a threshold or a heads choice a graph cannot take (below ``floor``, what a trace keeps), before any
    model runs."""
    if not floor <= threshold <= 1:
        raise InputError(f"threshold {threshold}: it must lie between {floor} and 1 (what a trace keeps)")
    if heads not in ("split", "sum"):
        raise InputError(f"heads {heads!r}: 'split' (one edge per head) or 'sum'")


def _check(flow: Flow, token: int, threshold: float, heads: str) -> int:
    index = token_index(token, flow.n_tokens)
    check(threshold, heads, flow.floor)
    return index


def graph(flow: Flow, token: int = -1, threshold: float = THRESHOLD, heads: str = "split",
          renormalise: bool = False) -> Graph:
    """The contribution graph of ``token`` (negative counts from the end) at ``threshold``.

    ``renormalise``: the edges kept into each node (its attention edges, per head or the heads summed as ``heads``
    says, and its residual edge; or its MLP and residual edges) are divided by their sum, so that they add up to 1.
    The kept edges are the same either way (docs/methods.md#routes says why the default keeps them as they are)."""
    token = _check(flow, token, threshold, heads)
    edges: list[Edge] = []
    above = {token}  # tokens kept at the level being walked into
    for l in range(flow.n_layers - 1, -1, -1):
        layer = flow.layers[l]
        into_mid, below = set(), set()
        for t in sorted(above):  # the MLP block: (l, attn, t) -> (l, mlp, t); a parallel MLP reads (l-1, mlp, t)
            for via, weight in (("mlp", layer.mlp[t]), ("residual", layer.mlp_residual[t])):
                if weight >= threshold:
                    parallel = layer.parallel and via == "mlp"
                    edges.append(Edge(l, via, "mlp", None, t, t, float(weight), parallel))
                    (below if parallel else into_mid).add(t)
        if into_mid:  # the attention block: (l-1, mlp, j) -> (l, attn, t)
            rows = np.isin(layer.attn_index[:, 0] if heads == "split" else layer.sum_index[:, 0], list(into_mid))
            index = (layer.attn_index if heads == "split" else layer.sum_index)[rows]
            weight = (layer.attn_weight if heads == "split" else layer.sum_weight)[rows]
            for row, w in zip(index, weight):
                if w >= threshold:
                    head = int(row[2]) if heads == "split" else None
                    edges.append(Edge(l, "attn", "attn", head, int(row[1]), int(row[0]), float(w)))
                    below.add(int(row[1]))
            for t in sorted(into_mid):
                if layer.attn_residual[t] >= threshold:
                    edges.append(Edge(l, "residual", "attn", None, t, t, float(layer.attn_residual[t])))
                    below.add(t)
        above = below
    return Graph(flow, token, threshold, heads, _renormalised(edges) if renormalise else edges, renormalise)


def _renormalised(edges: list[Edge]) -> list[Edge]:
    """Each node's kept incoming edges (one layer, one block, one target token) divided by their sum."""
    total: dict = {}
    for e in edges:
        total[e.layer, e.block, e.target] = total.get((e.layer, e.block, e.target), 0.0) + e.weight
    return [replace(e, weight=e.weight / total[e.layer, e.block, e.target]) for e in edges]


def sink_share_all(flow: Flow, threshold: float = THRESHOLD) -> list[float | None]:
    """Per layer, over every query of the text: of the attention contributions at or above ``threshold`` (one per
    query, source and head), the share whose source is the layer's sink key (None where none is kept)."""
    out = []
    for layer, sink in zip(flow.layers, flow.sink_keys):
        kept = layer.attn_weight >= threshold
        total = float(layer.attn_weight[kept].sum())
        from_sink = float(layer.attn_weight[kept & (layer.attn_index[:, 1] == sink)].sum())
        out.append(from_sink / total if total > 0 else None)
    return out
