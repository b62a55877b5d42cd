"""Attention tensors from anywhere, for the viewer: what BertViz, CircuitsVis and inspectus users have.

:func:`from_attention` turns any of these into a hand-made :class:`~attnviz.capture.Capture` (no
recipe: nothing was run), so the viewer, its payload, its regions and its HTML file treat them as
they treat a capture:

- a transformers ``output_attentions`` tuple, one (batch, heads, q, k) tensor per layer (``batch``
  picks the text);
- a TransformerLens ``ActivationCache``, read as ``cache["pattern", layer]`` (TransformerLens itself is
  never imported: the object is recognised by its type's name and module);
- a numpy array or torch tensor of shape (layers, batch, heads, q, k) (``torch.stack`` of the tuple),
  (layers, heads, q, k), (heads, q, k) or (q, k);
- non-square maps (cross-attention): ``tokens`` label the keys, ``query_tokens`` the queries.

A cell where every head of the layer holds exactly 0 is drawn as masked (a causal map's upper
triangle). Maps are read, not copied, where they already are float32 on the CPU: 2,048 tokens of
a 30-layer, 9-head model are 4.5 GB of float32.

Bad input is one :class:`~attnviz.errors.InputError` line each: a shape that is not a map, layers of
different shapes, tokens that do not match the keys (or the queries), NaN or infinite values,
negative weights. Rows that do not sum to one are allowed (a learned sink, softmax-off-by-one or an
intervention drops mass) and said once, as a warning and in the viewer's note.
"""

from __future__ import annotations

import hashlib
import warnings

import numpy as np

from attnviz.capture import Capture
from attnviz.errors import InputError

ROW_SUM_TOLERANCE = 1e-2  # |Σ_j p_ij − 1| above this (on a row that is not all zero) is said once; bf16 rows miss by ~4e-3


def _array(x, where: str) -> np.ndarray:
    """A float32 numpy view of a tensor or array (a copy only where the dtype or the device needs one)."""
    if x is None:
        raise InputError(f"{where} is None: the model returned no attention weights (load it with "
                         "attn_implementation='eager' and pass output_attentions=True)")
    if hasattr(x, "detach"):  # torch: .float() and .cpu() return the tensor itself where nothing changes
        x = x.detach().float().cpu().numpy()
    try:
        out = np.asarray(x, dtype=np.float32)
    except (TypeError, ValueError):
        raise InputError(f"{where} is a {type(x).__name__}, not an array of attention weights") from None
    return out


def _is_activation_cache(obj) -> bool:
    return type(obj).__name__ == "ActivationCache" and type(obj).__module__.startswith("transformer_lens")


def _layers(attention, batch: int) -> tuple[list[np.ndarray], str]:
    """The per-layer (heads, q, k) maps of any accepted input, and what it was."""
    def pick(maps: np.ndarray, where: str) -> np.ndarray:
        if maps.ndim == 4:
            if not -maps.shape[0] <= batch < maps.shape[0]:
                raise InputError(f"batch {batch} does not exist: {where} holds {maps.shape[0]} texts")
            return maps[batch]
        if maps.ndim == 3:
            return maps
        raise InputError(f"{where} has shape {tuple(maps.shape)}: expected (batch, heads, q, k) or (heads, q, k)")

    if _is_activation_cache(attention):
        cfg = getattr(getattr(attention, "model", None), "cfg", None)
        count = getattr(cfg, "n_layers", None)
        if count is None:
            count = sum(1 for name in attention.keys() if name.endswith("attn.hook_pattern"))
        return [pick(_array(attention["pattern", l], f"cache['pattern', {l}]"), f"cache['pattern', {l}]")
                for l in range(count)], "TransformerLens ActivationCache"
    if isinstance(attention, (tuple, list)):
        if not attention:
            raise InputError("the attention tuple is empty: expected one (batch, heads, q, k) tensor per layer")
        return [pick(_array(a, f"layer {l}"), f"layer {l}") for l, a in enumerate(attention)], "per-layer tuple"
    maps = _array(attention, "the attention")
    if maps.ndim == 5:
        if not -maps.shape[1] <= batch < maps.shape[1]:
            raise InputError(f"batch {batch} does not exist: the attention holds {maps.shape[1]} texts")
        return list(maps[:, batch]), "(layers, batch, heads, q, k) array"
    if maps.ndim == 4:
        return list(maps), "(layers, heads, q, k) array"
    if maps.ndim == 3:
        return [maps], "(heads, q, k) array"
    if maps.ndim == 2:
        return [maps[None]], "(q, k) array"
    raise InputError(f"the attention has shape {tuple(maps.shape)}: expected (layers, heads, q, k), (heads, q, k), "
                     "(q, k), a per-layer tuple of (batch, heads, q, k) or a TransformerLens ActivationCache")


def from_attention(attention, tokens=None, *, query_tokens=None, batch: int = 0, name: str = "attention") -> Capture:
    """A :class:`Capture` of given attention maps (see the module docstring); ``tokens`` label the keys
    (default: their positions), ``query_tokens`` the queries where they are not the keys; ``name`` is
    what the viewer and exported files call the source. A Capture is returned as it is (it has its tokens)."""
    if isinstance(attention, Capture):
        if tokens is not None or query_tokens is not None:  # e.g. show(cap, 5): the old positional layer
            raise InputError("a capture carries its own tokens: call show(cap) (layer=, head= by keyword)")
        return attention
    maps, source = _layers(attention, batch)
    heads, q, k = maps[0].shape
    for l, m in enumerate(maps):
        if m.shape != maps[0].shape:
            raise InputError(f"layer {l} has maps of shape {tuple(m.shape)}, layer 0 of {tuple(maps[0].shape)}: "
                             "every layer must have the same heads, queries and keys")
    tokens = [str(t) for t in tokens] if tokens is not None else [str(j) for j in range(k)]
    if query_tokens is None and q != k:
        if len(tokens) == q + k:  # BertViz's cross-attention call: the query text's tokens, then the key text's
            query_tokens, tokens = tokens[:q], tokens[q:]
        else:
            raise InputError(f"the maps are {q} × {k} (queries × keys): give query_tokens= for the {q} queries "
                             f"and tokens= for the {k} keys")
    if len(tokens) != k:
        raise InputError(f"{len(tokens)} tokens given, but the maps have {k} keys")
    if query_tokens is not None:
        query_tokens = [str(t) for t in query_tokens]
        if len(query_tokens) != q:
            raise InputError(f"{len(query_tokens)} query tokens given, but the maps have {q} queries")
    digest = hashlib.sha1()
    worst = 1.0  # the row sum furthest from one
    for l, m in enumerate(maps):
        if not np.isfinite(m).all():
            raise InputError(f"layer {l} holds NaN or infinite values: attention weights must be finite")
        if (m < 0).any():
            raise InputError(f"layer {l} holds negative values: attention weights are probabilities")
        sums = m.sum(-1)
        live = sums[sums > 0]  # rows with any weight (a fully masked row sums to 0)
        if live.size:
            far = float(live.flat[np.abs(live - 1).argmax()])
            if abs(far - 1) > max(ROW_SUM_TOLERANCE, abs(worst - 1)):
                worst = far
        digest.update(m[:, ::max(1, q // 64), ::max(1, k // 64)].tobytes())
    note = ""
    if worst != 1.0:
        note = (f"Some rows do not sum to one (a row sums to {worst:.4g}): shown as given. A learned sink, "
                "softmax-off-by-one or an intervention drops mass.")
        warnings.warn(note, stacklevel=3)
    layers = list(range(len(maps)))
    return Capture(text="".join(tokens), tokens=tokens, token_ids=list(range(k)), arch=name,
                   layer_masks=["given"] * len(maps), layers=layers, kv_groups=list(range(heads)),
                   allowed={l: (m > 0).any(0) for l, m in zip(layers, maps)},
                   probs=dict(zip(layers, maps)), query_tokens=query_tokens,
                   meta={"model": name, "source": source, "digest": digest.hexdigest()[:16], "note": note})
