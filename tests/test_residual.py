"""Residual recompute Methods of seed 003 (docs/methods.md#residual-variants) against a direct implementation, and fine-tuning."""

import json

import numpy as np
import pytest
import torch

from attnviz.core import engine
from attnviz.core.engine import residual
from attnviz.core.spec.arch import parse
from attnviz.errors import ArchitectureError, InputError, ModelLoadError
from attnviz.effects.finetune import finetune

from tiny import VOCAB, loaded, pair

N = 10


def _ids(n=N, seed=5, batch=1):
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def direct(stock, ids, name):
    """docs/methods.md#residual-variants written out with the stock eager model: P from its own attention weights."""
    m = stock.model
    x = m.embed_tokens(ids)
    n = ids.shape[1]
    pe = m.rotary_emb(x, torch.arange(n)[None])
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    target = "mlp" if name in ("method1", "method3.1", "method3.2") else "attn"
    h, recomputed = x, []
    for l, layer in enumerate(m.layers):
        a, probs = layer.self_attn(layer.input_layernorm(h), position_embeddings=pe, attention_mask=causal)
        attn = layer.self_attn
        v = attn.v_proj(layer.input_layernorm(x)).view(1, n, -1, attn.head_dim).transpose(1, 2)
        v = v.repeat_interleave(probs.shape[1] // v.shape[1], dim=1)
        a_tilde = attn.o_proj((probs @ v).transpose(1, 2).reshape(1, n, -1))
        w = 1.0 if name in ("method1", "method2") else 1.0 / max(l, 1)
        past = x + w * sum(recomputed) if recomputed else x
        if target == "mlp":
            f = layer.mlp(layer.post_attention_layernorm(h + a))
            h = past + f
            recomputed.append(layer.mlp(layer.post_attention_layernorm(x + a_tilde)))
        else:
            u = past + a
            h = u + layer.mlp(layer.post_attention_layernorm(u))
            recomputed.append(a_tilde)
    return stock.lm_head(m.norm(h))


@pytest.mark.parametrize("name", residual.METHODS)
def test_each_method_equals_a_direct_implementation(name):
    stock, ours = pair("llama")
    ids = _ids()
    with torch.no_grad():
        expected = direct(stock, ids, name)
        got, _ = residual.forward(ours, residual.Variant(name, 3), ids, list(parse("fwd", 3).layers))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        plain = stock(ids).logits
    assert (got - plain).abs().max() > 1e-3  # the variant changes the function


@pytest.mark.parametrize("name", residual.METHODS)
def test_a_variants_logits_go_through_the_models_whole_head(name):
    """Granite with unit residual and embedding multipliers is a decoder the variants run on, and its head divides by
    ``logits_scaling``: the variant's logits are the direct implementation's through that head (the model's own head,
    attnviz/core/model/head.py), not its final norm and output layer alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("granite", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=512, residual_multiplier=1.0, embedding_multiplier=1.0,
                                  logits_scaling=4.0)
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    ours.load_state_dict(stock.state_dict())
    ids = _ids()
    with torch.no_grad():
        expected = direct(stock, ids, name) / 4.0
        got, _ = residual.forward(ours, residual.Variant(name, 3), ids, list(parse("fwd", 3).layers))
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
        if name == "method2":  # on a one-layer model Method 2 is the plain forward: the stock logits themselves
            config.num_hidden_layers = 1
            one = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
            got, _ = residual.forward(one, residual.Variant(name, 1), ids, list(parse("fwd", 1).layers))
            torch.testing.assert_close(got, one(ids).logits, atol=1e-6, rtol=1e-5)


def test_weights_are_ones_one_over_l_and_learned_from_one_over_l():
    sums = residual.Variant("method1", 4).weights
    means = residual.Variant("method3.1", 4).weights
    learned = residual.Variant("method4.2", 4).weights
    assert sums[3].tolist() == [1, 1, 1, 0] and sums[0].sum() == 0
    np.testing.assert_allclose(means[3].numpy(), [1 / 3] * 3 + [0])
    assert isinstance(learned, torch.nn.Parameter) and torch.equal(learned.detach(), means)
    _, ours = pair("llama")
    ids = _ids()
    with torch.no_grad():
        a, _ = residual.forward(ours, residual.Variant("method3.1", 3), ids, list(parse("fwd", 3).layers))
        b, _ = residual.forward(ours, residual.Variant("method3.2", 3), ids, list(parse("fwd", 3).layers))
    torch.testing.assert_close(a, b)  # 3.2 starts where 3.1 is


def test_residual_forward_records_attention_and_follows_the_mask():
    _, ours = pair("llama")
    masks = list(parse("nosink-fwd", 3).layers)
    with torch.no_grad():
        _, run = residual.forward(ours, residual.Variant("method2", 3), _ids(), masks, engine.Record(layers=frozenset({1})))
    assert set(run.probs) == {1} and (run.probs[1][0, :, 1:, 0] == 0).all()  # key 0 hidden from later queries


def test_refusals():
    with pytest.raises(ArchitectureError, match="unknown residual variant"):
        residual.method("method5")
    with pytest.raises(ModelLoadError, match="need sequential pre-norm layers.*'gpt2' is not such a decoder: it has no "
                                              "rotary embedding"):
        residual.check_family(loaded("gpt2").model)
    with pytest.raises(ModelLoadError, match="'gemma2' is not such a decoder: the residual stream adds its blocks' "
                                              "outputs after post-norms"):
        residual.check_family(loaded("gemma2").model)
    with pytest.raises(ArchitectureError, match="cannot fine-tune"):
        finetune(loaded("llama"), list(range(3, 90)), "/tmp/never", "method1", recipe="bidir", steps=1)
    with pytest.raises(InputError, match="--steps must be positive"):
        finetune(loaded("llama"), list(range(3, 90)), "/tmp/never", "method1", steps=0)
    with pytest.raises(InputError, match="cannot write --out"):
        finetune(loaded("llama"), list(range(3, 90)), "/proc/attnviz/out", "method1", steps=1)


def test_finetune_changes_the_loss_saves_and_loads_back(tmp_path):
    lm = loaded("llama")
    lm.tokenizer = _SavingTokenizer()
    ids = _ids(400, seed=9)[0].tolist()
    out = tmp_path / "ft"
    result = finetune(lm, ids, out, "method3.2", steps=2, seq_len=32, batch=4, lr=1e-2, save_every=1)
    assert len(result.losses) == 2 and result.losses[0] != result.losses[1]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["residual"] == "method3.2" and metrics["eval_loss"] != metrics["before"]["eval_loss"]
    assert {"eval_loss", "eval_perplexity", "eval_accuracy", "eval_runtime"} <= set(metrics)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left
    back = _load_dir(out)
    assert back.residual is not None and back.residual.name == "method3.2"
    torch.testing.assert_close(back.residual.weights.detach(), result.variant.weights.detach())
    assert not torch.equal(result.variant.weights.detach(), residual.Variant("method3.2", 3).weights.detach())
    ids_t = torch.tensor([ids[:16]])
    with torch.no_grad():
        before, _ = residual.forward(lm.model, back.residual, ids_t, list(parse("fwd", 3).layers))
        again, _ = residual.forward(back.model, back.residual, ids_t, list(parse("fwd", 3).layers))
    torch.testing.assert_close(again, before)


class _SavingTokenizer:
    def __call__(self, text, add_special_tokens=True, **kwargs):  # HF tokenizers take verbose= etc.
        return {"input_ids": [3 + (ord(c) % (VOCAB - 3)) for c in text]}

    def save_pretrained(self, directory):
        (directory / "tiny_tokenizer.txt").write_text("char")


def _load_dir(out):
    """Load a fine-tuned tiny directory the way models.load does (weights from safetensors + variant)."""
    from transformers import AutoModelForCausalLM

    from attnviz.core.loading.models import LoadedModel
    from attnviz.core.engine.residual import Variant

    model = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True, attn_implementation="attnviz").eval()
    return LoadedModel(model, _SavingTokenizer(), str(out), None, 0.0, residual=Variant.load(out))



def test_an_interrupted_finetune_leaves_the_last_complete_checkpoint(tmp_path):
    lm = loaded("llama")
    lm.tokenizer = _SavingTokenizer()
    out = tmp_path / "ft"

    def stop_at_3(step, total, loss):
        if step == 3:
            raise KeyboardInterrupt

    result = finetune(lm, _ids(400, seed=2)[0].tolist(), out, "method1", steps=5, seq_len=32, batch=2,
                      save_every=2, on_step=stop_at_3)
    assert result.interrupted and result.steps == 3
    assert json.loads((out / "metrics.json").read_text())["steps"] == 2  # the checkpoint of step 2, complete
    assert _load_dir(out).residual.name == "method1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ft"]  # no half-written or temporary directory


def test_capture_under_a_variant_records_its_attention_and_names_it():
    from attnviz.figures import export
    from attnviz.capture import capture
    from attnviz.recipe import Recipe
    from attnviz.plan import Keep

    lm = loaded("llama")
    cap = capture(lm, "variant maps", Recipe.of(lm, "nosink-fwd", residual="method2"), Keep(storage_dtype=torch.float32))
    with torch.no_grad():
        logits, run = residual.forward(lm.model, residual.Variant("method2", 3), torch.tensor([cap.token_ids]), list(parse("nosink-fwd", 3).layers), engine.Record(layers=frozenset({0, 1, 2}), storage_dtype=torch.float32))
    for layer in range(3):
        torch.testing.assert_close(torch.from_numpy(cap.layer_probs(layer)), run.probs[layer][0])
    np.testing.assert_allclose(cap.next_logprobs, torch.log_softmax(logits[0, -1], -1).numpy(), atol=1e-5)
    meta = export.describe(cap, 2, 1)
    assert meta["residual"] == "method2" and "_method2_" in export.filename(meta, "pdf")
    with pytest.raises(InputError, match="hidden states are not recorded"):
        capture(lm, "variant maps", Recipe.of(lm, "fwd", residual="method1"), Keep(hidden_states=True))
    with pytest.raises(ModelLoadError, match="need sequential pre-norm layers"):
        capture(loaded("gpt2"), "no", Recipe.of(loaded("gpt2"), "fwd", residual="method1"))
