"""The logit lens on a node of a contribution graph (docs/methods.md#routes): a stream read as if it were the last
layer's (the model's final norm, then its unembedding), and what a block's write alone adds to that reading (the
write through the final norm's linear part with the stream's own frozen scale, then the unembedding)."""

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
    input) promotes and suppresses; with ``write``, what that block's write alone adds (not for layer -1)."""
    from attnviz.core.model import anatomy
    from attnviz.effects.schemes import norm_form

    if point not in ("attn", "mlp") or not -1 <= layer < flow.n_layers or (layer == -1 and (point != "mlp" or write)):
        raise InputError(f"no node {point} of layer {layer}: layers 0..{flow.n_layers - 1}, after 'attn' or 'mlp' "
                         "(layer -1 'mlp': the first layer's input, which no block writes)")
    if not 0 <= token < flow.n_tokens:
        raise InputError(f"token {token} does not exist: the text has tokens 0..{flow.n_tokens - 1}")
    head = loaded.model.get_output_embeddings()
    weight = head.weight.detach().float()
    stream = torch.from_numpy(flow.stream(layer, point)[token]).to(weight.device)
    final = anatomy.of(loaded.model).final_norm
    if not write:
        normed = final(stream.to(head.weight.dtype)[None]).float()[0] if final is not None else stream
        logits = normed @ weight.T
        what = f"the stream of token {token} after layer {layer}'s {point}"
    else:
        before = torch.from_numpy(flow.stream(layer - 1, "mlp") if point == "attn" else flow.stream(layer, "attn"))
        piece = stream - before[token].to(stream.device)
        if final is not None:
            form = norm_form(final, stream.shape[-1], "the final norm")
            piece = form.linear(piece[None], form.inv(stream[None]))[0]
        logits = piece @ weight.T
        what = f"layer {layer}'s {point} write at token {token}"
    promoted, suppressed = _ends(loaded, logits, top)
    return Reading(what, promoted, suppressed)

