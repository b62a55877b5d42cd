"""Contribution graphs: which tokens, through which heads and MLPs, feed a prediction, under any recipe
(docs/methods.md#contributions, docs/methods.md#routes).

``trace`` runs one forward and measures every layer's contributions (:mod:`attnviz.flow.trace`); ``graph`` keeps a
token's routes at a threshold and says how much of the attention flow comes from the sink key
(:mod:`attnviz.flow.graph`); ``lens`` reads a node through the model's head (:mod:`attnviz.flow.lens`).
"""

from attnviz.flow.graph import THRESHOLD, Edge, Graph, check, graph, sink_share_all
from attnviz.flow.lens import Reading, lens
from attnviz.flow.trace import FLOOR, Flow, trace

__all__ = ["FLOOR", "THRESHOLD", "Edge", "Flow", "Graph", "Reading", "check", "graph", "lens", "routes",
           "sink_share_all", "trace"]


def routes(loaded, text: str, recipe="fwd", token: int = -1, threshold: float = THRESHOLD, heads: str = "split",
           max_tokens: int | None = None, on_layer=None, renormalise: bool = False) -> Graph:
    """The contribution graph of ``token`` in ``text`` under ``recipe``: :func:`trace` then :func:`graph` (what
    ``attnviz routes`` prints; ``renormalise`` as :func:`graph`). The threshold and token are checked before the model
    runs."""
    check(threshold, heads)
    flow = trace(loaded, text, recipe, max_tokens=max_tokens, on_layer=on_layer, token=token)
    return graph(flow, token, threshold, heads, renormalise)
