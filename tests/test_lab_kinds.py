"""The lab trains under any kind and mask (docs/lab.md): each kind's tiny model learns through the recipe, saves a
checkpoint that ``attnviz.load`` reads back (tokenizer included), and a capture's maps and next-token distribution
equal the model's own plain forward; a mask other than the causal one changes what is learned; a seeded small
softmax run makes the first token a sink; the refusals are one line each."""

import json

import numpy as np
import pytest
import torch

import attnviz
from attnviz.capture import capture
from attnviz.errors import AttnvizError, InputError
from attnviz.lab import models
from attnviz.lab.tasks import BigramBackcopy
from attnviz.lab.train import Setup, train
from attnviz.plan import Keep
from attnviz.recipe import Recipe

TEXT = "t5 T1 t5 t7 t9 T2 t9 t4 t6"
FAMILY = {"softmax": "LlamaForCausalLM", "sink(logit=0)": "LlamaForCausalLM", "sink": "GptOssForCausalLM",
          "softpick": "LlamaForCausalLM", "sigmoid": "LlamaForCausalLM", "gate": "Qwen3NextForCausalLM",
          "relu": "LlamaForCausalLM"}


def tiny(**changes):
    return Setup(**{**dict(layers=1, width=32, heads=2, steps=3, batch=4, every=2, warmup=1, device="cpu",
                           task=BigramBackcopy(vocab=16, triggers=2, length=16)), **changes})


@pytest.mark.parametrize("kind", list(FAMILY))
def test_each_kind_trains_saves_and_loads_as_its_own_forward(kind, tmp_path):
    setup = tiny(kind=kind)
    end = train(setup, tmp_path)
    before, after = models.load(setup, tmp_path / "step-0"), models.load(setup, end)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(before.state_dict()[q], after.state_dict()[q])  # gradients flowed
    if kind == "sink":  # gpt-oss's learned sink logits learn too
        assert not torch.equal(before.model.layers[0].self_attn.sinks, after.model.layers[0].self_attn.sinks)
    meta = json.loads((end / "attnviz_run.json").read_text())
    assert meta["recipe"] == {"kind": setup.kind, "arch": "fwd"} and meta["step"] == 3
    hidden = torch.randn(1, 5, setup.width)
    block = after.model.layers[0].mlp
    for mlp in (block(hidden), type(block).forward(block, hidden)):  # attention only: the lab's and the stock forward
        assert torch.equal(mlp[0] if isinstance(mlp, tuple) else mlp, torch.zeros(1, 5, setup.width))

    lm = attnviz.load(str(end), device="cpu")
    assert type(lm.model).__name__ == FAMILY[kind] and lm.tokenizer.bos_token == "<bos>"
    cap = capture(lm, TEXT, keep=Keep(storage_dtype=torch.float32))
    assert cap.tokens[:3] == ["<bos>", "t5", "T1"]
    with torch.no_grad():
        out = lm.model(torch.tensor([cap.token_ids]), output_attentions=True)
    np.testing.assert_allclose(cap.layer_probs(0), out.attentions[0][0].numpy(), atol=1e-5)
    np.testing.assert_allclose(cap.next_logprobs, torch.log_softmax(out.logits[0, -1], -1).numpy(), atol=1e-5)


def test_a_relu_models_maps_are_its_forward_written_by_hand(tmp_path):
    """A lab model trained with relu: the capture's map is ReLU(q·k/√d)/n from the layer's own projections and
    rotary, n the keys the causal row allows (docs/methods.md#attention-kinds)."""
    import math

    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    setup = tiny(kind="relu")
    lm = attnviz.load(str(train(setup, tmp_path)), device="cpu")
    assert lm.model.config.attnviz_kind == "relu"
    cap = capture(lm, TEXT, keep=Keep(storage_dtype=torch.float32))
    ids, inner, d = torch.tensor([cap.token_ids]), lm.model.model, setup.width // setup.heads
    n = ids.shape[1]
    with torch.no_grad():
        x = inner.layers[0].input_layernorm(inner.embed_tokens(ids))
        attn = inner.layers[0].self_attn
        q, k = (proj(x).view(1, n, setup.heads, d).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj))
        q, k = apply_rotary_pos_emb(q, k, *inner.rotary_emb(x, torch.arange(n)[None]))
        z = q @ k.transpose(-1, -2) / math.sqrt(d)
    causal = torch.ones(n, n).tril().bool()
    by_hand = torch.where(causal, z.clamp(min=0), 0.0) / causal.sum(-1, keepdim=True)
    assert float(by_hand.sum()) > 0 and not np.allclose(by_hand[0].sum(-1).numpy(), 1.0)  # rows need not sum to 1
    np.testing.assert_allclose(cap.layer_probs(0), by_hand[0].numpy(), atol=1e-6)


def test_the_mask_is_applied_in_training(tmp_path):
    """The same seed and batches under StableMask learn other weights than under the causal mask; the run records
    its mask."""
    fwd = json.loads((train(tiny(kind="softpick"), tmp_path / "fwd") / "attnviz_run.json").read_text())
    stable = json.loads((train(tiny(kind="softpick", arch="stablemask"), tmp_path / "sm") / "attnviz_run.json")
                        .read_text())
    assert stable["recipe"] == {"kind": "softpick", "arch": "stablemask"} and fwd["hash"] != stable["hash"]
    with open(tmp_path / "sm" / "step-3" / "config.json") as f:
        assert json.load(f)["attnviz_arch"] == "stablemask"


def test_a_sink_forms_under_softmax(tmp_path):
    """Seeded Bigram-Backcopy, softmax, causal: the non-trigger queries' attention on the first key rises well
    above its value at step 0 within 200 steps."""
    setup = Setup(width=32, heads=2, steps=200, batch=16, every=200, warmup=10, lr=1e-2, device="cpu",
                  task=BigramBackcopy(vocab=32, triggers=3, length=32))
    train(setup, tmp_path)
    x = setup.task.batch(64, 10**6)
    quiet = ~setup.task.needs_attention(x)
    quiet[:, 0] = False
    first = []
    for step in (0, 200):
        model = models.load(setup, tmp_path / f"step-{step}")
        model.set_attn_implementation("eager")
        with torch.no_grad():
            a = model(x, output_attentions=True).attentions[0][..., 0]  # (B, H, n): on key 0
        first.append([float(a[:, h][quiet].mean()) for h in range(setup.heads)])
    assert all(end > start + 0.1 for start, end in zip(*first)), first


@pytest.mark.parametrize("changes, words", [
    (dict(kind="nosuch"), "unknown attention kind"),
    (dict(kind="gate(headwise)"), "headwise"),
    (dict(kind="sigmoid", arch="stablemask"), "StableMask"),
    (dict(kind="relu", arch="stablemask"), "StableMask"),
    (dict(positions="nope"), "rotary"),
    (dict(kind="sink(logit=0, init=-4)"), "not both"),
    (dict(kind="sink(init=inf)"), "finite"),
])
def test_a_setup_the_lab_cannot_train_is_one_line(changes, words):
    with pytest.raises(InputError) as err:
        tiny(**changes)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_learned_sink_starts_where_init_says_and_learns_from_there(tmp_path):
    """sink(init=c): gpt-oss's learned logits, every head's at c at step 0 (gpt-oss's N(0, 0.02²) otherwise), then
    trained; the checkpoint is an ordinary gpt-oss whose own kind is the learned sink, its setup keeps the init."""
    setup = tiny(kind="sink(init=-6)")
    assert setup.kind == "sink(init=-6)" and models.family(setup.kind) == "gpt_oss"
    end = train(setup, tmp_path)
    start, after = (models.load(setup, f).model.layers[0].self_attn.sinks.detach() for f in (tmp_path / "step-0", end))
    assert torch.equal(start, torch.full((2,), -6.0)) and not torch.equal(after, start)
    assert json.loads((end / "attnviz_run.json").read_text())["setup"]["kind"] == "sink(init=-6)"
    default = models.build(tiny(kind="sink"), 16).model.layers[0].self_attn.sinks.detach()
    assert default.abs().max() < 0.2 and not torch.equal(default, start)
    lm = attnviz.load(str(end), device="cpu")  # a forward has no start: init as a capture's kind is refused
    with pytest.raises(InputError, match="where the lab starts") as err:
        Recipe.of(lm, "fwd", kind="sink(init=-6)")
    assert "\n" not in str(err.value)


def test_loading_a_run_a_step_past_it_and_a_folder_that_is_no_checkpoint(tmp_path):
    train(tiny(), tmp_path / "run")
    assert attnviz.load(str(tmp_path / "run"), device="cpu").model.config.attnviz_arch == "fwd"  # its last
    with pytest.raises(InputError, match="no step 99 .past its last.: its last is step-3") as err:
        attnviz.load(str(tmp_path / "run" / "step-99"), device="cpu")
    assert "\n" not in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AttnvizError, match="not a model directory .no config.json in it. nor a lab run") as err:
        attnviz.load(str(tmp_path / "empty"), device="cpu")
    assert "\n" not in str(err.value)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a checkpoint saved before they carried a tokenizer
        (tmp_path / "run" / "step-2" / name).unlink()
    with pytest.raises(InputError, match="has no tokenizer .saved before checkpoints carried one.") as err:
        attnviz.load(str(tmp_path / "run" / "step-2"), device="cpu")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["softmax", "sink"])
def test_an_attention_only_run_skips_its_zero_mlps_and_trains_the_very_same_weights(kind, tmp_path, monkeypatch):
    """Without MLPs the lab writes each MLP's zero without running it (gpt-oss: its router and expert loop); the
    weights it trains are bit for bit those of the stock MLP forward over the zero and frozen weights."""
    from safetensors.torch import load_file

    setup = tiny(kind=kind, layers=2, steps=4, every=4)
    assert "forward" in vars(models.build(setup, 16).model.layers[0].mlp)  # the lab's own forward: no MLP passes
    skipped = load_file(train(setup, tmp_path / "lab") / "model.safetensors")
    real = models.attention_only
    monkeypatch.setattr(models, "attention_only", lambda model, s: models.stock_mlps(real(model, s)))
    stock = load_file(train(setup, tmp_path / "stock") / "model.safetensors")
    assert skipped.keys() == stock.keys() and all(torch.equal(skipped[k], stock[k]) for k in skipped)
