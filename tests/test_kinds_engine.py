"""Attention kinds as an axis of the recipe (docs/methods.md#attention-kinds): the engine's maps equal each kind's
formula written out in numpy from the layer's own queries and keys, with and without a mask; gradients flow; a
model's own kind (a lab config, gpt-oss's learned sink, Qwen3-Next's gate) is what runs by default, and its plain
forward agrees with a capture; a kind a model or a mask cannot take is refused in one line."""

import math

import numpy as np
import pytest
import torch

import tiny
from attnviz import recipe
from attnviz.core import engine
from attnviz.core.spec import kinds
from attnviz.errors import InputError

IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 4, 8, 6]])
KINDS = ["softmax", "softpick", "sigmoid", "sigmoid(bias=0.5)", "sink(logit=0)", "sink(logit=1.5)", "relu"]


def _run(lm, arch, kind, grad=False):
    built = recipe.build(lm, arch, kind=kind)
    record = engine.Record.every_layer(storage_dtype=torch.float32, qkv=True)
    logits, _, run = built.forward(lm, IDS, record, engine.Feed(grad=grad))
    return built, logits, run


def _formula(spec: str, z: np.ndarray) -> np.ndarray:
    """The kind's definition in numpy over a row of scores with -inf on forbidden keys (float64)."""
    allowed = np.isfinite(z)
    name = spec.split("(")[0]
    if name == "softmax":
        e = np.where(allowed, np.exp(z - z.max(-1, keepdims=True)), 0.0)
        return e / e.sum(-1, keepdims=True)
    if name == "sink":
        s = float(spec.split("=")[1].rstrip(")"))
        e = np.where(allowed, np.exp(z), 0.0)
        return e / (math.exp(s) + e.sum(-1, keepdims=True))
    if name == "softpick":
        m = np.where(allowed, z, -np.inf).max(-1, keepdims=True)  # the row maximum, as the definition computes it
        e = np.where(allowed, np.exp(z - m) - np.exp(-m), 0.0)
        return np.maximum(e, 0.0) / (np.abs(e).sum(-1, keepdims=True) + kinds.EPS)
    if name == "sigmoid":
        b = float(spec.split("=")[1].rstrip(")")) if "=" in spec else None
        bias = -np.log(allowed.sum(-1, keepdims=True)) if b is None else b
        return np.where(allowed, 1.0 / (1.0 + np.exp(-(z + bias))), 0.0)
    if name == "relu":
        return np.where(allowed, np.maximum(z, 0.0), 0.0) / allowed.sum(-1, keepdims=True)
    raise AssertionError(spec)


def _scores(run, layer, allowed):
    q, k, _, scaling = run.qkv[layer]
    q, k = torch.as_tensor(q).float(), torch.as_tensor(k).float()  # float32 scores, as the model makes them
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    z = ((q * scaling) @ k.transpose(-1, -2))[0].double().numpy()
    return np.where(allowed, z, -np.inf)


@pytest.mark.parametrize("arch", ["fwd", "bidir", "sliding(w=3)"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_is_its_formula_with_and_without_a_mask(kind, arch):
    lm = tiny.loaded("llama")
    built, _, run = _run(lm, arch, kind)
    assert built.recipe.kind == ("" if kind == "softmax" else kinds.parse(kind).spec)
    for layer in range(lm.n_layers):
        allowed = run.host_allowed([layer])[layer]
        allowed = np.asarray(allowed).reshape(-1, *allowed.shape[-2:])[0]
        expected = _formula(kind, _scores(run, layer, allowed))
        got = np.asarray(run.probs[layer][0], dtype=np.float64)
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["softpick", "sink(logit=0)"])
def test_a_kind_combines_with_stablemask(kind):
    """StableMask's pseudo-logits take part in the row (the kind's sum) and are dropped after it."""
    lm = tiny.loaded("llama")
    _, _, plain = _run(lm, "fwd", kind)
    _, _, stable = _run(lm, "stablemask", kind)
    p = np.asarray(stable.probs[0][0])
    assert np.allclose(np.triu(p, 1), 0)  # nothing on a future key
    assert (p.sum(-1)[:, :-1] < np.asarray(plain.probs[0][0]).sum(-1)[:, :-1] + 1e-6).all()  # the pseudo-slots took mass
    assert not np.allclose(p, np.asarray(plain.probs[0][0]), atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_flow_through_every_kind(kind):
    lm = tiny.loaded("llama")
    lm.model.zero_grad(set_to_none=True)
    _, logits, _ = _run(lm, "fwd", kind, grad=True)
    torch.nn.functional.cross_entropy(logits[0, :-1], IDS[0, 1:]).backward()
    grad = lm.model.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and float(grad.abs().sum()) > 0
    lm.model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", ["softpick", "sigmoid", "sink(logit=0)", "relu"])
def test_a_models_own_kind_runs_by_default_and_its_plain_forward_agrees(kind):
    """A lab config's ``attnviz_kind``: a capture without a kind runs it, and the model's own forward outside any
    run (the kind written out, :func:`attnviz.core.spec.kinds.eager`) gives the same logits and maps."""
    lm = tiny.loaded("llama")
    lm.model.config.attnviz_kind = kind
    try:
        built, logits, run = _run(lm, "fwd", None)
        assert built.recipe.kind == ""  # the model's own
        _, named, _ = _run(lm, "fwd", kind)
        assert recipe.build(lm, "fwd", kind=kind).recipe.kind == ""  # naming the own kind is the same recipe
        own = lm.model(IDS, output_attentions=True)
        torch.testing.assert_close(own.logits, logits, atol=1e-5, rtol=0)
        for layer in range(lm.n_layers):
            torch.testing.assert_close(own.attentions[layer], torch.as_tensor(run.probs[layer]), atol=1e-6, rtol=0)
        other = _run(lm, "fwd", "softmax")[1]
        assert not torch.allclose(other, logits, atol=1e-4)  # softmax is a what-if on it
    finally:
        del lm.model.config.attnviz_kind


def test_gpt_oss_learned_sink_is_its_own_kind_and_the_others_are_what_ifs():
    lm = tiny.loaded("gpt_oss")
    assert kinds.own(lm.model) == kinds.Sink()
    stock = tiny.build("gpt_oss")
    stock.load_state_dict(lm.model.state_dict())
    expected = stock(IDS, output_attentions=True).attentions
    _, _, own = _run(lm, "fwd", None)
    _, _, named = _run(lm, "fwd", "sink")
    _, _, soft = _run(lm, "fwd", "softmax")
    _, _, zero = _run(lm, "fwd", "sink(logit=0)")
    for layer in range(lm.n_layers):
        torch.testing.assert_close(torch.as_tensor(own.probs[layer]), expected[layer], atol=1e-6, rtol=0)
        np.testing.assert_allclose(named.probs[layer], own.probs[layer], atol=1e-7)
        np.testing.assert_allclose(np.asarray(soft.probs[layer]).sum(-1), 1.0, atol=1e-5)  # no sink column
        allowed = np.tril(np.ones((IDS.shape[1],) * 2, bool))
        if layer % 2 == 0:  # gpt-oss's sliding layers: compare the full-attention ones only
            continue
        np.testing.assert_allclose(zero.probs[layer][0], _formula("sink(logit=0)", _scores(zero, layer, allowed)),
                                   atol=1e-6)


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(vocab_size=tiny.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, partial_rotary_factor=1.0,
                             layer_types=["full_attention"] * 2, mlp_only_layers=[0, 1], max_position_embeddings=64)
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(config).eval()


def test_qwen3_next_gate_runs_through_the_engine_as_its_own_kind():
    from attnviz.core.loading.models import LoadedModel

    model = _qwen3_next()
    stock = _qwen3_next()
    stock.config._attn_implementation = "eager"
    expected = stock(IDS, output_attentions=True)
    lm = LoadedModel(model, None, "tiny-qwen3-next", None, 0.0)
    assert kinds.own(model) == kinds.Gate()
    built, logits, run = _run(lm, "fwd", None)
    torch.testing.assert_close(logits, expected.logits, atol=1e-5, rtol=0)
    for layer in range(2):
        torch.testing.assert_close(torch.as_tensor(run.probs[layer]), expected.attentions[layer], atol=1e-6, rtol=0)
    assert recipe.build(lm, "fwd", kind="gate").recipe.kind == ""
    for other in ("softpick", "gate(headwise)"):
        with pytest.raises(InputError, match="cannot replace it"):
            recipe.build(lm, "fwd", kind=other)


@pytest.mark.parametrize("kind, arch, words", [
    ("gate", "fwd", "needs the gate's trained weights"),
    ("sink", "fwd", "needs learned sink logits"),
    ("sigmoid", "stablemask", "cannot combine with StableMask"),
    ("relu", "stablemask", "relu cannot combine with StableMask"),
    ("tanh", "fwd", "unknown attention kind"),
    ("sink(logit=x)", "fwd", "is a number"),
])
def test_a_kind_the_model_or_mask_cannot_take_is_refused_in_one_line(kind, arch, words):
    with pytest.raises(InputError, match=words) as err:
        recipe.build(tiny.loaded("llama"), arch, kind=kind)
    assert "\n" not in str(err.value)


def test_a_capability_that_does_not_apply_a_kind_refuses_it():
    lm = tiny.loaded("llama")
    with pytest.raises(InputError, match="does not apply the attention kind softpick"):
        recipe.build(lm, "fwd", kind="softpick").only("head classes")
    with pytest.raises(InputError, match="defined on the softmax's weights"):
        recipe.build(lm, "fwd", kind="sigmoid").softmax_only("score attribution")
    recipe.build(lm, "fwd", kind="softmax").softmax_only("score attribution")
    lm.model.config.attnviz_kind = "softpick"  # a lab model's own kind is refused there too
    try:
        with pytest.raises(InputError, match="not on softpick's"):
            recipe.build(lm, "fwd").softmax_only("score attribution")
    finally:
        del lm.model.config.attnviz_kind


def test_a_recipe_without_a_kind_keeps_its_key_and_one_with_a_kind_says_it():
    lm = tiny.loaded("llama")
    plain = recipe.Recipe.of(lm, "fwd")
    assert "kind" not in plain.to_dict() and recipe.Recipe.from_dict(plain.to_dict()) == plain
    picked = recipe.Recipe.of(lm, "fwd", kind="softpick")
    assert picked.key != plain.key and "softpick" in picked.describe()
    assert recipe.Recipe.from_dict(picked.to_dict()) == picked


def test_the_analyses_over_the_engine_run_the_recipes_kind():
    """Dataset sinks, the valley and the one opening of the scan, paths and patching read the recipe's kind: each
    equals the capture under that kind and differs from the softmax's."""
    import attnviz
    from attnviz.effects import dataset, valley
    from attnviz.effects.opening import Opening

    lm = tiny.loaded("llama")
    text = "the keeper lit the lamp and the ships passed"
    soft, pick = recipe.Recipe.of(lm, "fwd"), recipe.Recipe.of(lm, "fwd", kind="softpick")
    alphas = [dataset.sinks(lm, [text], r, max_len=16, n_samples=None).alpha for r in (soft, pick)]
    assert not np.allclose(alphas[0], alphas[1], equal_nan=True)
    captured = attnviz.capture(lm, text[:16], pick)
    np.testing.assert_allclose(np.nanmean(alphas[1][0], -1), np.nanmean(
        np.stack([captured.stat(layer, "alpha") for layer in range(lm.n_layers)]), -1), atol=1e-5)
    h = [[row["entropy"] for row in valley.measure(lm, text, r).as_json()["layers"]] for r in (soft, pick)]
    assert h[0][0] == pytest.approx(h[1][0]) and h[0][-1] != pytest.approx(h[1][-1])  # the input of layer 0 is the same
    opened = Opening(lm, text, pick, "a test")
    assert opened.computes.kind == kinds.Softpick()


@pytest.mark.parametrize("spec", ["softpick", "softpick(eps=1e-3)", "sigmoid", "sigmoid(bias=0.5)", "relu"])
def test_the_lean_training_weights_are_the_kind_s_own_numbers_and_gradients(spec):
    """The block route's training passes (attnviz.core.engine.lean): the mask added rather than filled, softpick and
    sigmoid without where: the kind's own weights bit for bit, and the same gradients (softpick's written out: to
    float rounding, and against finite differences), under a causal mask and under per-head windows, with scores far
    from 0 (softpick's exp overflows unless shifted), exactly 0, two keys tied for a row's maximum (their sum the same),
    and a row that sees one key; a row with no key is all zero."""
    from attnviz.core.engine import lean

    kind = kinds.parse(spec)
    gen = torch.Generator().manual_seed(0)
    n = 12
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    causal = (j <= i)[None, None]
    windows = torch.stack([(j <= i) & (i - j < w) for w in (1, 3, 12)])[None]  # (1, H, n, n): head 0 sees itself
    windows[..., 5, :] = False  # a row with no key at all
    for allow in (causal, windows):
        raw = torch.randn(2, 3, n, n, generator=gen) * 4
        raw[0, 0, 7] += 120.0  # e^z overflows float32 unless shifted by the row's maximum
        raw[1, 2, 9, :4] = 0.0
        raw[1, 1, 11, 2] = raw[1, 1, 11, 6] = 30.0  # two keys tie for the row's maximum
        scores = raw.clone().requires_grad_()
        fast = lean.weigher(kind)(allow)(lean.masked(scores, allow))
        plain = raw.clone().requires_grad_()
        want = kind.weights(plain.masked_fill(~allow, float("-inf")))
        assert torch.equal(fast, want)
        weight = torch.randn(fast.shape, generator=gen)
        (fast * weight).sum().backward()
        (want * weight).sum().backward()
        got, expected = scores.grad.clone(), plain.grad.clone()
        if spec.startswith("softpick"):  # the maximum's share goes to the first tied key (autograd's amax splits it)
            for grad in (got, expected):
                grad[1, 1, 11, 2] += grad[1, 1, 11, 6]
                grad[1, 1, 11, 6] = 0.0
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert lean.weigher(kinds.parse("softmax")) is None and lean.weigher(kinds.parse("sink(logit=0)")) is None
    if spec.startswith("softpick"):  # its backward is written out: against finite differences, in float64
        z = (torch.randn(2, 3, n, n, generator=gen, dtype=torch.float64) * 2).requires_grad_()
        assert torch.autograd.gradcheck(lambda z: lean.softpick(lean.masked(z, causal), causal.double(), 0.05), (z,))


@pytest.mark.parametrize("spec", ["softpick", "sigmoid", "relu"])
def test_a_lab_training_step_takes_the_lean_weights_and_learns_what_the_kind_s_own_weights_teach(spec, monkeypatch):
    """A lab model's training forward under softpick or sigmoid (no recorder, autograd on) takes the lean weights;
    its loss and every gradient are those of the kind's own weights."""
    from attnviz.core.engine import lean
    from attnviz.lab import train as lab

    model, loaded, built, x = tiny.lab_training(spec)
    taken, real = [], lean.weigher
    monkeypatch.setattr(lean, "weigher", lambda kind: taken.append(kind) or real(kind))

    def gradients():
        model.zero_grad(set_to_none=True)
        loss = lab.loss_of(built, loaded, x)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    loss, grads = gradients()
    assert taken == [kinds.parse(spec)]
    monkeypatch.setattr(lean, "weigher", lambda kind: None)  # the kind's own weights
    plain_loss, plain_grads = gradients()
    assert torch.equal(loss, plain_loss) and len(grads) == len(plain_grads)
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
