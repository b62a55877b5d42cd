"""The logit lens on a node of a contribution graph (docs/methods.md#routes): a stream read as if it were the last
layer's (the model's own head, :mod:`attnviz.core.model.head`: final norm, output layer with its bias, the family's
scalings), and what a block's write alone adds to that reading (the write through the final norm's linear part with
the stream's own frozen scale, the output layer without its bias, the scalings, the soft cap's ratio frozen at the
stream's own reading)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnviz.errors import InputError
from attnviz.flow.trace import Flow

TOP = 8


@dataclass(frozen=True)
class Reading:
    """Tokens a vector promotes and suppresses most: (token, logit) from the highest and the lowest."""

    what: str
    promoted: list[tuple[str, float]]
    suppressed: list[tuple[str, float]]

    def as_json(self) -> dict:
        return {"what": self.what, "promoted": [[t, round(v, 4)] for t, v in self.promoted],
                "suppressed": [[t, round(v, 4)] for t, v in self.suppressed]}


def _ends(loaded, logits: torch.Tensor, top: int) -> tuple[list, list]:
    values, order = logits.sort(descending=True)
    decode = lambda i: loaded.tokenizer.decode([int(i)])  # noqa: E731
    return ([(decode(i), float(v)) for i, v in zip(order[:top], values[:top])],
            [(decode(i), float(v)) for i, v in zip(order[-top:].flip(0), values[-top:].flip(0))])


@torch.no_grad()
def lens(loaded, flow: Flow, layer: int, point: str, token: int, write: bool = False, top: int = TOP) -> Reading:
    """What the stream of ``token`` after ``layer``'s ``point`` ("attn" or "mlp"; layer -1 "mlp" the first layer's
    input) promotes and suppresses, read through the model's own head (:mod:`attnviz.core.model.head`: at the top
    layer these are the model's logits); with ``write``, what that block's write alone adds (not for layer -1): the
    write through the final norm's linear part at the stream's own frozen scale, the output layer without its bias,
    the family's scalings, and the soft cap's ratio at the stream's own reading (docs/methods.md#routes)."""
    from attnviz.core.model import head as model_head
    from attnviz.effects.schemes import norm_form

    if point not in ("attn", "mlp") or not -1 <= layer < flow.n_layers or (layer == -1 and (point != "mlp" or write)):
        raise InputError(f"no node {point} of layer {layer}: layers 0..{flow.n_layers - 1}, after 'attn' or 'mlp' "
                         "(layer -1 'mlp': the first layer's input, which no block writes)")
    if not 0 <= token < flow.n_tokens:
        raise InputError(f"token {token} does not exist: the text has tokens 0..{flow.n_tokens - 1}")
    head = model_head.of(loaded.model)
    dtype, device = head.output.weight.dtype, head.output.weight.device
    stream = torch.from_numpy(flow.stream(layer, point)[token]).to(device)
    # in float32 from the run's own activations: the final norm in the model's dtype as its forward runs it, then
    # the output layer (with its bias) and the family's scalings
    reading = head.scaled(head.output32(head.normed(stream.to(dtype)[None])))[0]
    if not write:
        logits = head.capped(reading)
        what = f"the stream of token {token} after layer {layer}'s {point}"
    else:
        before = torch.from_numpy(flow.stream(layer - 1, "mlp") if point == "attn" else flow.stream(layer, "attn"))
        piece = stream - before[token].to(stream.device)
        if head.norm is not None:
            form = norm_form(head.norm, stream.shape[-1], "the final norm")
            piece = form.linear(piece[None], form.inv(stream[None]))[0]
        # the bias belongs to no block's write; the scalings are linear; the cap is not, so the write is scaled by
        # the ratio the cap applies to the stream's own reading of each token
        logits = head.scaled(head.output32(piece, bias=False)) * head.cap_ratio(reading)
        what = f"layer {layer}'s {point} write at token {token}"
    promoted, suppressed = _ends(loaded, logits, top)
    return Reading(what, promoted, suppressed)
