"""The model's head written once (attnviz/core/model/head.py): the engine's logits and the logit lens against the stock
model's own ``logits`` on families whose heads add something to the final norm and output layer (Phi: an output
bias; Gemma 2: a soft cap; Granite: ``logits_scaling``; Cohere and Cohere 2: ``logit_scale``), and the lens's reading
of a block's write against its definition written out by hand (docs/methods.md#routes)."""

import pytest
import torch

from attnviz import flow
from attnviz.core import engine
from attnviz.core.model import head

from tiny import VOCAB, loaded

FAMILIES = ("phi", "gemma2", "granite", "cohere", "cohere2")
TEXT = "Hello there, world."


def _loaded(kind: str):
    """A tiny model of ``kind`` whose head's extra part is large enough to be seen: Phi's output bias drawn at random
    (transformers initialises it to zero), Gemma 2's cap lowered to 0.5 (its random logits are about 0.2); Cohere
    (not in tests/tiny.py) built here the same way, with a logit scale of 0.25."""
    if kind == "cohere":
        from transformers import AutoConfig, AutoModelForCausalLM

        from attnviz.core.loading.models import LoadedModel
        from tiny import CharTokenizer

        config = AutoConfig.for_model("cohere", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, logit_scale=0.25)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
        return LoadedModel(model, CharTokenizer(), "tiny-cohere", None, 0.0)
    lm = loaded(kind)
    if kind == "phi":
        with torch.no_grad():
            lm.model.lm_head.bias.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
    if kind == "gemma2":
        lm.model.config.final_logit_softcapping = 0.5
    return lm


def _stock_logits(lm, ids) -> torch.Tensor:
    with torch.no_grad():
        return lm.model(torch.tensor([ids])).logits[0]


def _by_id(reading) -> torch.Tensor:
    """A lens reading of the whole vocabulary (``top`` = VOCAB / 2) as a (VOCAB,) tensor by token id (the character
    tokenizer decodes id i as chr(i))."""
    values = torch.full((VOCAB,), float("nan"))
    for token, value in reading.promoted + reading.suppressed:
        values[ord(token)] = value
    return values


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_head_and_the_lens_at_the_top_are_the_models_own_logits(kind):
    lm = _loaded(kind)
    traced = flow.trace(lm, TEXT)
    stock = _stock_logits(lm, traced.token_ids)
    # the head's extra part matters here: the final norm and output weight alone are not the logits
    found = head.of(lm.model)
    bare = found.normed(torch.from_numpy(traced.stream(traced.n_layers - 1, "mlp"))) @ found.output.weight.T
    assert (bare - stock).abs().max() > 1e-3
    for token in range(traced.n_tokens):
        reading = flow.lens(lm, traced, traced.n_layers - 1, "mlp", token, top=VOCAB // 2)
        got = _by_id(reading)
        torch.testing.assert_close(got, stock[token], rtol=1e-5, atol=1e-6)
        ranked = [lm.tokenizer.decode([int(i)]) for i in stock[token].topk(5).indices]
        assert [t for t, _ in reading.promoted[:5]] == ranked
    # the engine's head on the last layer's output, as a resumed forward reads it
    top = torch.from_numpy(traced.stream(traced.n_layers - 1, "mlp"))[None]
    torch.testing.assert_close(engine.head_logits(lm.model, top), stock[-1:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(engine.head_logits(lm.model, top, last_only=False), stock[None], rtol=1e-5, atol=1e-6)


def _write_by_hand(lm, traced, layer: int, point: str, token: int) -> torch.Tensor:
    """docs/methods.md#routes written out for these families: the write through the final norm's linear part at
    the stream's own scale (LayerNorm for Phi and Cohere: centred; RMSNorm for Granite and Gemma 2, whose weight is
    1 + γ), the output weight without its bias, Granite's division and Cohere's factor, and for Gemma 2 the cap's
    ratio cap·tanh(z/cap)/z at the stream's own logit z."""
    model, config = lm.model, lm.model.config
    kind = config.model_type
    stream = torch.from_numpy(traced.stream(layer, point)[token]).double()
    before = traced.stream(layer - 1, "mlp") if point == "attn" else traced.stream(layer, "attn")
    piece = stream - torch.from_numpy(before[token]).double()
    norm = model.model.final_layernorm if kind == "phi" else model.model.norm
    eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", None)
    gamma = norm.weight.detach().double() + (1.0 if kind == "gemma2" else 0.0)
    if kind in ("phi", "cohere", "cohere2"):
        piece, variance = piece - piece.mean(), stream.var(unbiased=False)
    else:
        variance = (stream ** 2).mean()
    weight = model.lm_head.weight.detach().double()
    write = weight @ (gamma * piece / torch.sqrt(variance + eps))
    if kind == "granite":
        write = write / config.logits_scaling
    if kind in ("cohere", "cohere2"):
        write = write * config.logit_scale
    if kind == "gemma2":
        with torch.no_grad():
            z = model.lm_head(norm(stream.float()[None]))[0].double()  # the stream's own reading, before the cap
        cap = config.final_logit_softcapping
        ratio = cap * torch.tanh(z / cap) / z
        write = write * torch.where(z == 0, 1.0, ratio)  # 1 at a logit of 0 (the pad token's zero row in Gemma 2)
    return write.float()


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_writes_reading_leaves_out_the_bias_and_keeps_the_scalings_and_the_caps_ratio(kind):
    lm = _loaded(kind)
    traced = flow.trace(lm, TEXT)
    for layer, point, token in ((0, "attn", 4), (1, "mlp", 7), (traced.n_layers - 1, "attn", traced.n_tokens - 1)):
        reading = flow.lens(lm, traced, layer, point, token, write=True, top=VOCAB // 2)
        torch.testing.assert_close(_by_id(reading), _write_by_hand(lm, traced, layer, point, token),
                                   rtol=1e-4, atol=1e-6)


def test_the_caps_ratio_is_one_without_a_cap_and_at_zero():
    capped = head.Head(None, torch.nn.Identity(), cap=2.0)
    z = torch.tensor([0.0, 1e-3, 1.0, -5.0])
    torch.testing.assert_close(capped.cap_ratio(z) * z, 2.0 * torch.tanh(z / 2.0))
    assert capped.cap_ratio(z)[0] == 1.0
    assert torch.equal(head.Head(None, torch.nn.Identity()).cap_ratio(z), torch.ones(4))
