"""Heads as receivers of path patching (docs/methods.md#heads-as-receivers): which heads of a layer read a write.

A head receiver is one head's keys, queries or values at a layer: ``keys.m.hK`` and ``values.m.hK`` name key-value
head K (where query heads share their keys and values, grouped-query attention, one key-value head serves a group of
them: that head is the receiver, as the model computes it once), ``queries.m.hQ`` names query head Q; ``.h*`` names
every head of that layer's keys, queries or values, each its own path. Cutting the path sender → head removes the
sender's write from that head's slice of the projection alone: at the sink token, the slice becomes the projection of
norm(stream − write) (norm the layer's attention pre-norm, the stream its input, read in the same forward), every
other head and every other position as the model computed them. Everything after the projection (a q/k norm, the
rotation, the attention) runs as the model runs it. Read at the named site ``resid_pre`` and at the projection's
output (:func:`attnviz.core.engine.sites.at_module`), in the asking thread only.
"""

from __future__ import annotations

import re

import torch

from attnviz.core.engine import sites
from attnviz.core.model.modules import projection
from attnviz.errors import InputError

HEAD = re.compile(r"^(keys|queries|values)\.(\d+)\.h(\d+|\*)$")
_PROJ = {"keys": "k", "queries": "q", "values": "v"}


def is_head(name: str) -> bool:
    """Whether ``name`` names one head's keys, queries or values (or every head of a layer, ``.h*``), or heads
    alone joined by +."""
    return all(HEAD.match(part) is not None for part in name.split("+"))


def shared(name: str) -> str:
    """The layer-wide receiver a head receiver's layer is checked against (``keys.m``: the same layer's inputs)."""
    vectors, layer = HEAD.match(name).group(1, 2)
    return f"{'queries' if vectors == 'queries' else 'keys'}.{layer}"


def counts(model, layer: int, vectors: str) -> tuple[int, int]:
    """(heads, head dimension) of ``layer``'s projection of ``vectors`` (keys, queries or values): query heads for
    the queries, key-value heads for the keys and values; a fused projection is refused in one line (it is not a
    head's own)."""
    from attnviz.core.model import anatomy

    attn = anatomy.of(model)[layer].attn
    proj = _values(attn) if vectors == "values" else projection(attn, _PROJ[vectors])
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    d = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return proj.out_features // d, d


def _values(attn) -> torch.nn.Module:
    proj = getattr(attn, "v_proj", None)
    if not isinstance(proj, torch.nn.Linear):
        raise InputError(f"{type(attn).__name__} has no projection of the values alone: a head's values are not a "
                         "receiver of their own")
    return proj


def expand(names: list[str], model) -> list[str]:
    """The receivers with every head receiver checked (its head exists) and each ``.h*`` written out, a head each;
    other receivers as they are."""
    out = []
    for name in names:
        parts = []
        for part in name.split("+"):
            match = HEAD.match(part)
            if match is None:
                parts.append([part])
                continue
            vectors, layer, head = match.group(1), int(match.group(2)), match.group(3)
            heads, _ = counts(model, layer, vectors)
            if head != "*" and int(head) >= heads:
                noun = "query" if vectors == "queries" else "key-value"
                raise InputError(f"{part}: layer {layer} has {noun} heads 0..{heads - 1} for its {vectors}")
            parts.append([f"{vectors}.{layer}.h{h}" for h in range(heads)] if head == "*" else [part])
        if len(parts) > 1 and any(len(p) > 1 for p in parts):
            raise InputError(f"{name}: .h* names each head as its own path; join single heads with +")
        out += ["+".join(p[0] for p in parts)] if len(parts) > 1 else parts[0]
    return list(dict.fromkeys(out))


def cut_pairs(found, model, cuts: dict[str, list[tuple[int, int, torch.Tensor]]], streams: dict) -> list:
    """The site functions that cut each head receiver in ``cuts`` ({receiver: [(row, token, delta)]}): at its
    projection's output, the head's slice at the token replaced by the projection of norm(stream − delta), the
    stream read at ``resid_pre`` into ``streams[("resid_pre", m)]`` by the caller's reader."""
    by_proj: dict[tuple[str, int], list] = {}
    for receiver, rows in cuts.items():
        vectors, layer, head = HEAD.match(receiver).groups()
        by_proj.setdefault((vectors, int(layer)), []).extend((row, token, delta, int(head))
                                                             for row, token, delta in rows)
    pairs = []
    for (vectors, layer), rows in sorted(by_proj.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        attn = found[layer].attn
        proj = _values(attn) if vectors == "values" else projection(attn, _PROJ[vectors])
        _, d = counts(model, layer, vectors)
        pairs.append((sites.at_module(proj), _slice(rows, streams, layer, found[layer].attn_norm, proj, d)))
    return pairs


def _slice(rows, streams: dict, layer: int, norm, proj, d: int):
    def fn(value):
        value = value.clone()
        for row, token, delta, head in rows:
            x = (streams["resid_pre", layer][row, token].float() - delta).to(value.dtype)
            x = norm.forward(x[None])[0] if norm is not None else x
            value[row, token, head * d:(head + 1) * d] = proj.forward(x[None])[0, head * d:(head + 1) * d]
        return value
    return fn


_INPUT = {"attn": "attn_in", "mlp": "mlp_in", "keys": "k_in", "queries": "q_in"}


class Cut:
    """The site functions of one batch: row i removes ``delta_i`` (its sender's write at the sink token) from its
    receivers' inputs alone. A block's, the keys' or the queries' input at the token becomes norm(stream − delta),
    the stream read at the layer's input (or between its blocks, for an MLP) in the same forward, norm the pre-norm
    the receiver reads through (none: the stream itself); the head's input is the top layer's output − delta."""

    def __init__(self, found, rows: list[tuple[list[str], int, torch.Tensor]], model=None):
        self.found, self.rows, self.model = found, rows, model
        self.streams: dict[tuple[str, int], torch.Tensor] = {}

    def pairs(self) -> list:
        top = len(self.found.layers) - 1
        cuts: dict[tuple[str, int], list[tuple[int, int, torch.Tensor]]] = {}
        heads: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
        for row, (receivers, token, delta) in enumerate(self.rows):
            for receiver in receivers:
                if is_head(receiver):  # its layer's stream read as the keys' is
                    heads.setdefault(receiver, []).append((row, token, delta))
                    cuts.setdefault(("stream", int(receiver.split(".")[1])), [])
                    continue
                reader, m = (("head", top) if receiver == "head"
                             else (receiver.split(".")[0], int(receiver.split(".")[1])))
                cuts.setdefault((reader, m), []).append((row, token, delta))
        pairs = []
        for site, m in sorted({self._stream(r, m) for r, m in cuts if r != "head"}, key=lambda s: (s[1], s[0])):
            pairs.append((sites.Site(site, m), self._read(site, m)))
        for (reader, m), rows in cuts.items():
            if reader == "stream":
                continue
            if reader == "head":
                pairs.append((sites.Site("resid_post", m), self._minus(rows)))
            else:
                layer = self.found[m]
                norm = layer.mlp_norm if reader == "mlp" else layer.attn_norm
                pairs.append((sites.Site(_INPUT[reader], m), self._normed(rows, self._stream(reader, m), norm)))
        return pairs + cut_pairs(self.found, self.model, heads, self.streams)

    def _stream(self, reader: str, m: int) -> tuple[str, int]:
        return ("resid_mid" if reader == "mlp" and not self.found[m].parallel else "resid_pre", m)

    def _read(self, site: str, m: int):
        def fn(value):
            # the forward runs upwards: no receiver below layer m reads its stream again (held, every layer's
            # stream of every row would outlive its layer: the paths' plan counts two a row)
            for key in [key for key in self.streams if key[1] < m]:
                del self.streams[key]
            self.streams[site, m] = value
        return fn

    def _normed(self, rows, stream: tuple[str, int], norm):
        def fn(value):
            value = value.clone()
            for row, token, delta in rows:
                x = self.streams[stream][row, token].float() - delta
                x = x.to(value.dtype)
                value[row, token] = norm.forward(x[None])[0] if norm is not None else x
            return value
        return fn

    @staticmethod
    def _minus(rows):
        def fn(value):
            value = value.clone()
            for row, token, delta in rows:
                value[row, token] = (value[row, token].float() - delta).to(value.dtype)
            return value
        return fn
