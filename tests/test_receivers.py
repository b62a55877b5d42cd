"""Heads as receivers of path patching (docs/methods.md#heads-as-receivers): one head's keys, queries or values cut
equal a stock forward with hooks written here that remove the sender's write from that head's slice of the
projection alone (tiny Gemma 3, grouped-query, and the default model); the one opening: path patching with the scan's
senders makes one unpatched forward; bad input in one line; the figure."""

import numpy as np
import pytest
import torch

import tiny
from attnviz.core import engine
from attnviz.effects import causal
from attnviz.effects.paths import paths
from attnviz.errors import InputError

TEXT = "The keeper lit the lamp. The ships passed the rocks, and the keeper slept."


@torch.no_grad()
def _stock(model, ids, write_module, receiver, sink, layers, pre_norm):
    """The sink's attention per layer (stock eager maps, the mean over heads of key ``sink``'s column over the queries
    that see it) and the perplexity, with the sender's write (read at ``write_module``'s output) removed at the sink
    token from one head's slice of one projection: a forward hook on ``self_attn.{k,q,v}_proj`` whose slice of head h
    at the token becomes the projection of norm(stream − write), the stream read by a pre-hook on the layer."""
    kind, layer, head = receiver.split(".")
    block, h = layers[int(layer)], int(head[1:])
    proj = getattr(block.self_attn, f"{kind[0]}_proj")
    d = model.config.head_dim
    seen = {}
    handles = [
        write_module.register_forward_hook(
            lambda m, args, out: seen.__setitem__("write", (out[0] if isinstance(out, tuple) else out)[0, sink].clone())),
        block.register_forward_pre_hook(lambda m, args: seen.__setitem__("stream", args[0][0, sink].clone()))]

    def slice_of_head(m, args, out):
        out = out.clone()
        x = getattr(block, pre_norm)((seen["stream"] - seen["write"])[None])
        out[0, sink, h * d:(h + 1) * d] = torch.nn.functional.linear(x, m.weight, m.bias)[0, h * d:(h + 1) * d]
        return out
    handles.append(proj.register_forward_hook(slice_of_head))
    try:
        out = model(ids, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    types = getattr(model.config, "layer_types", None) or [None] * len(layers)
    windows = [model.config.sliding_window if t == "sliding_attention" else None for t in types]
    attention = [float(a[0, :, sink:sink + (w or a.shape[-1]), sink].mean(-1).mean())
                 for a, w in zip(out.attentions, windows)]
    nll = torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), ids[0, 1:])
    return attention, float(torch.exp(nll))


@pytest.mark.parametrize("receiver", ["keys.1.h0", "keys.1.h1", "values.1.h1", "values.2.h0", "queries.2.h3"])
def test_a_head_receiver_equals_hand_written_hooks_on_tiny_gemma3(receiver):
    """Tiny Gemma 3 (4 query heads sharing 2 key-value heads, q/k norms, post-norms): MLP 0's write at the sink token
    removed from one head's keys, values or queries; a key-value head's cut moves the sink or, for the top layer's
    values, the perplexity (above the tolerance);
    the sink token's own query under a causal mask sees key 0 alone, so a query head's cut changes nothing."""
    lm = tiny.loaded("gemma3_text")
    stock = tiny.build("gemma3_text", "eager")
    assert (stock.config.num_attention_heads, stock.config.num_key_value_heads) == (4, 2)
    found = paths(lm, TEXT, "fwd", "mlp.0", receiver)
    ids = torch.tensor([lm.tokenizer(TEXT)["input_ids"]])
    layers = stock.model.layers
    attention, ppl = _stock(stock, ids, layers[0].post_feedforward_layernorm, receiver, found.before.keys[0], layers,
                            "input_layernorm")
    after = found.after["mlp.0", receiver]
    np.testing.assert_allclose(after.attention, attention, atol=1e-4)
    assert after.perplexity == pytest.approx(ppl, rel=1e-4)
    moved = max(abs(a - b) for a, b in zip(after.attention, found.before.attention))
    changed = abs(after.perplexity - found.before.perplexity)
    if receiver.startswith("queries."):
        assert moved == 0 and changed == 0
    else:  # a top layer's values move no attention, only what the head reads
        assert (moved if receiver != "values.2.h0" else changed) > 1e-4
    assert found.heads("mlp.0") == [receiver] and found.receivers("mlp.0", single=False) == []


def test_every_head_of_a_layer_is_its_own_path_and_the_heads_together_are_the_layer_s_keys():
    """``keys.1.h*``: one path a key-value head; both heads joined by + cut what ``keys.1`` cuts."""
    lm = tiny.loaded("gemma3_text")
    found = paths(lm, TEXT, "fwd", "mlp.0", "keys.1.h*,keys.1.h0+keys.1.h1,keys.1")
    assert found.heads("mlp.0") == ["keys.1.h0", "keys.1.h1", "keys.1.h0+keys.1.h1"]
    np.testing.assert_allclose(found.after["mlp.0", "keys.1.h0+keys.1.h1"].attention,
                               found.after["mlp.0", "keys.1"].attention, atol=1e-6)


@pytest.mark.parametrize("receiver", ["keys.12.h1", "values.12.h2", "queries.13.h4"])
def test_a_head_receiver_on_the_default_model_equals_hand_written_hooks(default_model, receiver):
    """SmolLM2 (9 query heads, 3 key-value heads): MLP 0's write removed from one head's keys, values or queries."""
    from pydoc_data.topics import topics

    text = topics["specialnames"][:400]
    found = paths(default_model, text, "fwd", "mlp.0", receiver)
    model = default_model.model
    ids = torch.tensor([default_model.tokenizer(text)["input_ids"]])
    model.set_attn_implementation("eager")
    try:
        attention, ppl = _stock(model, ids, model.model.layers[0].mlp, receiver, found.before.keys[0],
                                model.model.layers, "input_layernorm")
    finally:
        model.set_attn_implementation("attnviz")
    after = found.after["mlp.0", receiver]
    np.testing.assert_allclose(after.attention, attention, atol=1e-4)
    assert after.perplexity == pytest.approx(ppl, rel=1e-4)


def test_bad_head_receivers_are_one_line():
    lm = tiny.loaded("gemma3_text")
    with pytest.raises(InputError, match="key-value heads 0..1"):
        paths(lm, TEXT, "fwd", "mlp.0", "keys.1.h2")
    with pytest.raises(InputError, match="query heads 0..3"):
        paths(lm, TEXT, "fwd", "mlp.0", "queries.1.h4")
    with pytest.raises(InputError, match="not above mlp.1"):
        paths(lm, TEXT, "fwd", "mlp.1", "values.1.h0")
    with pytest.raises(InputError, match="join single heads"):
        paths(lm, TEXT, "fwd", "mlp.0", "keys.1.h*+mlp.2")
    with pytest.raises(InputError, match="unknown receiver 'keys.1.x0'"):
        paths(lm, TEXT, "fwd", "mlp.0", "keys.1.x0")
    with pytest.raises(InputError, match="values alone"):
        paths(tiny.loaded("gpt_neox"), TEXT, "fwd", "mlp.0", "values.1.h0")


def _counting(monkeypatch):
    calls = []
    forward = engine.forward
    monkeypatch.setattr(engine, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    return calls


def test_paths_with_the_scan_s_senders_make_one_unpatched_forward(monkeypatch):
    """The one opening: the scan and the paths after it read the same unpatched forward; every patched run resumes."""
    lm = tiny.loaded("gemma3_text")
    calls = _counting(monkeypatch)
    found = paths(lm, TEXT, "fwd", None, "head")
    assert len(calls) == 1 and found.senders == causal.scan(lm, TEXT, "fwd", leaders=False).necessary
    assert len(calls) == 2  # the scan alone: its own one

