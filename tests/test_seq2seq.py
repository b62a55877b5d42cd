"""Encoder-decoder capture (docs/methods.md#cross-attention): equivalence with stock eager on tiny T5 and BART, masks on the
encoder only, generation under the encoder architecture, loading from a directory, refusals."""

import json

import numpy as np
import pytest
import torch

from attnviz.core.spec import arch
from attnviz import seq2seq
from attnviz.capture import Capture
from attnviz.errors import InputError
from attnviz.core.loading.models import load

from tiny import S2S, char_tokenizer, loaded, seq2seq_loaded, seq2seq_pair

SOURCE = "the cat sat on the mat"
TARGET = "die katze"


def _ids(n, seed):
    return torch.randint(3, 100, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", S2S)
def test_all_three_kinds_reproduce_stock_eager(kind):
    stock, ours = seq2seq_pair(kind)
    src, dec = _ids(9, 1), _ids(6, 2)
    with torch.no_grad():
        ref = stock(input_ids=src, decoder_input_ids=dec, output_attentions=True)
    n_enc = len(ref.encoder_attentions)
    out, stacks = seq2seq.forward(ours, src, dec, list(arch.parse("bidir", n_enc).layers), storage_dtype=torch.float32)
    assert (out.logits - ref.logits).abs().max().item() <= 1e-5
    for name, refs in (("encoder", ref.encoder_attentions), ("decoder", ref.decoder_attentions),
                       ("cross", ref.cross_attentions)):
        run = stacks.runs[name]
        assert len(run.probs) == len(refs)
        for layer, expected in enumerate(refs):
            assert (run.probs[layer] - expected).abs().max().item() <= 1e-5, (name, layer)
            np.testing.assert_allclose(run.probs[layer].sum(-1).numpy(), 1.0, atol=1e-5)  # every row sums to 1
    assert stacks.runs["cross"].probs[0].shape[-2:] == (6, 9)  # target rows x source columns


@pytest.mark.parametrize("kind", S2S)
def test_architecture_applies_to_the_encoder_only(kind):
    _, ours = seq2seq_pair(kind)
    src, dec = _ids(8, 3), _ids(5, 4)
    n_enc = len(seq2seq.attention_stacks(ours)["encoder"])
    out_b, bidir = seq2seq.forward(ours, src, dec, list(arch.parse("bidir", n_enc).layers), storage_dtype=torch.float32)
    out_f, causal = seq2seq.forward(ours, src, dec, list(arch.parse("fwd", n_enc).layers), storage_dtype=torch.float32)
    i, j = np.indices((8, 8))
    for layer, allowed in causal.runs["encoder"].allowed.items():
        np.testing.assert_array_equal(allowed.whole()[0, 0].numpy(), j <= i)  # seed 004's encoder with a causal mask
        assert (causal.runs["encoder"].probs[layer][0][:, ~(j <= i)] == 0).all()
    for layer, allowed in causal.runs["decoder"].allowed.items():  # the decoder stays causal either way
        np.testing.assert_array_equal(allowed.whole()[0, 0].numpy(), np.tril(np.ones((5, 5), bool)))
    for layer, allowed in causal.runs["cross"].allowed.items():  # cross sees every source token
        assert allowed.whole()[0, 0].numpy().shape == (5, 8) and allowed.whole()[0, 0].all()
    change = (out_f.encoder_last_hidden_state - out_b.encoder_last_hidden_state).abs().max().item()
    assert change > 1e-3 and not torch.equal(out_f.logits, out_b.logits)  # the encoder mask reaches the output


def test_capture_with_a_target_gives_three_captures():
    lm = seq2seq_loaded("bart")
    cap = seq2seq.capture_seq2seq(lm, SOURCE, TARGET, arch="fwd", storage_dtype=torch.float32)
    n_src, n_tgt = len(SOURCE) + 1, len(TARGET) + 2  # </s> appended; decoder start token first
    assert not cap.generated and cap.target == TARGET
    assert cap.encoder.probs[0].shape == (4, n_src, n_src) and cap.encoder.arch == "fwd"
    assert cap.decoder.probs[2].shape == (2, n_tgt, n_tgt) and cap.decoder.layers == [0, 1, 2]
    cross = cap.view("cross")
    assert cross.probs[0].shape == (2, n_tgt, n_src)
    assert cross.row_tokens == cap.decoder.tokens and cross.tokens == cap.encoder.tokens
    assert cross.meta["attention"] == "cross" and cross.meta["encoder_arch"] == "fwd"
    with pytest.raises(InputError, match="unknown attention type"):
        cap.view("sideways")


def test_capture_saves_and_loads_its_row_tokens(tmp_path):
    cap = seq2seq.capture_seq2seq(seq2seq_loaded("t5"), SOURCE, TARGET).cross
    back = Capture.load(cap.save(tmp_path / "cross"))
    assert back.row_tokens == cap.row_tokens and back.tokens == cap.tokens
    np.testing.assert_array_equal(back.probs[1], cap.probs[1])


@pytest.mark.parametrize("kind", S2S)
def test_empty_target_is_the_stock_models_greedy_output(kind):
    lm = seq2seq_loaded(kind, seed=5)
    cap = seq2seq.capture_seq2seq(lm, SOURCE, "", arch="bidir", max_new_tokens=6)
    src = torch.tensor([char_tokenizer()(SOURCE)["input_ids"]])
    stock, _ = seq2seq_pair(kind, seed=5)
    with torch.no_grad():
        expected = stock.generate(src, max_new_tokens=6, do_sample=False, num_beams=1)[0].tolist()
    assert cap.generated and cap.decoder.token_ids == expected


def test_generation_follows_the_encoder_mask():
    """Greedy output under a causal encoder = argmax of the masked teacher-forced forward, step by step."""
    lm = seq2seq_loaded("t5", seed=7)
    masks = list(arch.parse("fwd", 2).layers)
    src = torch.tensor([char_tokenizer()(SOURCE)["input_ids"]])
    ids = seq2seq.generate(lm.model, src, masks, max_new_tokens=5)
    manual = [0]
    for _ in range(len(ids) - 1):
        out, _ = seq2seq.forward(lm.model, src, torch.tensor([manual]), masks)
        manual.append(int(out.logits[0, -1].argmax()))
    assert ids == manual


def test_decoder_only_models_are_refused():
    with pytest.raises(InputError, match="decoder-only"):
        seq2seq.capture_seq2seq(loaded("llama"), SOURCE, TARGET)


def test_a_local_encoder_decoder_directory_loads_like_any_model(tmp_path):
    stock, _ = seq2seq_pair("t5", seed=3)
    stock.save_pretrained(tmp_path, safe_serialization=True)
    char_tokenizer().save_pretrained(tmp_path)
    lm = load(str(tmp_path), device="cpu")
    assert lm.is_encoder_decoder and lm.n_layers == 2
    cap = seq2seq.capture_seq2seq(lm, SOURCE, TARGET, storage_dtype=torch.float32)
    src = torch.tensor([char_tokenizer()(SOURCE)["input_ids"]])
    dec = torch.tensor([cap.decoder.token_ids])
    with torch.no_grad():
        ref = stock.eval()(input_ids=src, decoder_input_ids=dec, output_attentions=True)
    np.testing.assert_allclose(cap.cross.probs[1], ref.cross_attentions[1][0].numpy(), atol=1e-5)


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-t5")
    seq2seq_pair("t5", seed=3)[0].save_pretrained(path, safe_serialization=True)
    char_tokenizer().save_pretrained(path)
    return path


def test_cli_capture_writes_each_kind(t5_dir, tmp_path):
    from test_cli import run

    out = run("capture", "--model", str(t5_dir), "--text", SOURCE, "--target", TARGET, "--out", str(tmp_path / "m.npz"))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["encoder_arch"] == "bidir" and not doc["generated"] and doc["target"] == TARGET
    assert set(doc["out"]) == {"encoder", "decoder", "cross"}
    cross = Capture.load(doc["out"]["cross"])
    assert cross.probs[0].shape == (4, len(TARGET) + 2, len(SOURCE) + 1)
    assert cross.row_tokens[1:3] == list(TARGET[:2])
    one = run("capture", "--model", str(t5_dir), "--text", SOURCE, "--attention", "encoder", "--arch", "fwd",
              "--out", str(tmp_path / "enc.npz"))
    assert one.returncode == 0, one.stderr
    enc = Capture.load(json.loads(one.stdout)["out"]["encoder"])
    assert enc.arch == "fwd" and (np.triu(enc.probs[1][0], 1) == 0).all()


@pytest.mark.parametrize("args,message", [
    (["capture", "--model", "T5", "--text", SOURCE, "--attention", "self"], "is for decoder-only models"),
    (["sinks", "--model", "T5", "--text", SOURCE], "is an encoder-decoder model"),
    (["capture", "--model", "T5", "--text", SOURCE, "--arch", "fwd*9"], "9 layers"),
])
def test_cli_bad_input_for_encoder_decoders(args, message, t5_dir, tmp_path):
    from test_cli import run

    args = [str(t5_dir) if a == "T5" else a for a in args]
    out = run(*args, *(["--out", str(tmp_path / "x.npz")] if args[0] == "capture" else []))
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_cli_cross_attention_of_a_decoder_only_model_is_refused(model_cache, tmp_path):
    from test_cli import run

    out = run("capture", "--text", SOURCE, "--attention", "cross", "--out", str(tmp_path / "x.npz"))
    assert out.returncode == 2 and "decoder-only" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_heatmaps_page_shows_the_three_kinds_of_an_encoder_decoder(t5_dir, tmp_path, model_cache):
    from test_app import app_test, arr, charts, on_page, texts

    at = app_test(tmp_path)
    at.run()
    at.sidebar.text_input(key="model").input(str(t5_dir)).run()
    at.sidebar.text_area(key="text").input(SOURCE).run()
    assert not at.exception and not at.error, texts(at.error)
    at.text_input(key="hm_target").input(TARGET).run()
    at.radio(key="hm_stack").set_value("cross").run()
    assert not at.exception and not at.error, texts(at.error)
    spec = charts(at)[0]
    assert arr(spec["data"][0]["customdata"]).shape == (len(TARGET) + 2, len(SOURCE) + 1)  # target rows x source cols
    assert spec["layout"]["yaxis"]["title"]["text"] == "target (query)"
    assert spec["layout"]["xaxis"]["title"]["text"] == "source (key)"
    np.testing.assert_allclose(np.nansum(arr(spec["data"][0]["customdata"]), axis=1), 1.0, atol=2e-3)
    # the sidebar architecture goes on the encoder: FWD makes it causal
    at.radio(key="hm_stack").set_value("encoder").run()
    z = arr(charts(at)[0]["data"][0]["customdata"])
    assert not np.isnan(z[np.tril_indices(len(z))]).any() and not np.isnan(z[0, 1])  # stock encoder: bidir
    at.radio(key="hm_encoder").set_value("sidebar").run()
    z = arr(charts(at)[0]["data"][0]["customdata"])
    assert np.isnan(z[np.triu_indices(len(z), 1)]).all()
    at.slider(key="hm_layer").set_value(0).run()
    assert not at.exception
    # an empty target: the model's own output, shown
    at.text_input(key="hm_target").input("").run()
    assert "Model output" in texts(at.markdown)
    # pages that take decoder-only models say so instead of failing
    on_page(at, "pages/sinks.py")
    assert "encoder-decoder model" in texts(at.error)


def test_cross_attention_view_of_a_decoder_only_model_is_refused(tmp_path, model_cache):
    from test_app import app_test, texts

    at = app_test(tmp_path)
    at.run()
    at.radio(key="hm_stack").set_value("cross").run()
    assert not at.exception
    assert "decoder-only model" in texts(at.error) and "no cross-attention" in texts(at.error)
