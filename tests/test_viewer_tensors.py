"""Any attention tensors in the viewer (attnviz.viewer.tensors): a transformers output_attentions tuple,
a TransformerLens ActivationCache, arrays of every accepted rank, cross-attention; the widget, its
regions and the self-contained HTML file, against the tensors themselves."""

import os
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import attnviz
from attnviz.errors import InputError
from attnviz.viewer import payload as payload_mod
from attnviz.viewer.tensors import from_attention

from tiny import build

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

IDS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]]
TOKENS = list("abcdefghijkl")


@pytest.fixture(scope="module")
def eager():
    model = build("llama", "eager")
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS), output_attentions=True).attentions  # 3 × (2, 4, 12, 12)


def test_an_output_attentions_tuple_is_shown_as_it_is(eager):
    cap = from_attention(eager, TOKENS, batch=1)
    assert cap.layers == [0, 1, 2] and cap.n_heads == 4 and cap.tokens == TOKENS and cap.recipe is None
    for l in cap.layers:
        np.testing.assert_array_equal(cap.layer_probs(l), eager[l][1].numpy())
        assert (cap.allowed[l] == np.tril(np.ones((12, 12), bool))).all()  # the causal triangle reads as masked
    data = payload_mod.payload([cap])
    values = payload_mod.decode(data["panels"][0]["layers"]["2"]["heads"][3], **data["encoding"])  # head 2
    ok = cap.allowed[2] & (cap.layer_probs(2)[2] > 1e-8)
    np.testing.assert_allclose(values[ok], eager[2][1, 2].numpy()[ok], rtol=3e-4)  # 16-bit codes: exact hover
    assert from_attention(eager, TOKENS, batch=0).meta["digest"] != cap.meta["digest"]
    with pytest.raises(InputError, match="batch 2 does not exist: layer 0 holds 2 texts"):
        from_attention(eager, TOKENS, batch=2)


def test_arrays_of_every_rank_and_dtype(eager):
    stacked = torch.stack(eager)  # (layers, batch, heads, q, k)
    one = eager[1][0]
    cases = {"5": (stacked, 0, 3), "4": (stacked[:, 0].numpy(), 0, 3), "3": (one, 0, 1), "2": (one[2].numpy(), 0, 1),
             "bf16": (one.to(torch.bfloat16), 0, 1)}
    for name, (attention, batch, layers) in cases.items():
        cap = from_attention(attention, TOKENS, batch=batch)
        assert len(cap.layers) == layers, name
    np.testing.assert_array_equal(from_attention(one[2].numpy(), TOKENS).layer_probs(0)[0], one[2].numpy())
    assert from_attention(one, None).tokens == [str(j) for j in range(12)]  # positions when no tokens are given


def test_a_transformer_lens_activation_cache_is_read_by_pattern(tmp_path, monkeypatch):
    pytest.importorskip("transformer_lens")
    from transformer_lens.model_bridge import TransformerBridge

    from tiny import char_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = build("gpt2"), char_tokenizer()
    model.save_pretrained(tmp_path), tokenizer.save_pretrained(tmp_path)
    bridge = TransformerBridge.boot_transformers(str(tmp_path), hf_model=model, tokenizer=tokenizer)
    _, cache = bridge.run_with_cache(torch.tensor([[5, 6, 7, 8, 9, 10, 11]]))
    tokens = list("ABCDEFG")
    cap = from_attention(cache, tokens)
    assert cap.layers == [0, 1, 2] and cap.meta["source"] == "TransformerLens ActivationCache"
    for l in cap.layers:
        np.testing.assert_array_equal(cap.layer_probs(l), cache["pattern", l][0].numpy())
    widget = attnviz.show(cache, tokens)
    assert widget.data["n_tokens"] == 7 and widget.data["layers"] == [0, 1, 2]


def test_cross_attention_takes_query_tokens_or_bertviz_s_joined_tokens():
    gen = torch.Generator().manual_seed(0)
    cross = torch.softmax(torch.randn(2, 1, 3, 5, 7, generator=gen), -1)  # (layers, batch, heads, q=5, k=7)
    queries, keys = list("vwxyz"), list("ABCDEFG")
    cap = from_attention(cross, keys, query_tokens=queries)
    assert cap.row_tokens == queries and cap.tokens == keys and cap.layer_probs(1).shape == (3, 5, 7)
    assert from_attention(cross, queries + keys).row_tokens == queries  # the query text's tokens, then the keys'
    data = payload_mod.payload([cap])
    assert data["row_tokens"] == queries and data["panels"][0]["layers"]["0"]["shape"] == [5, 7]
    with pytest.raises(InputError, match=r"the maps are 5 × 7 \(queries × keys\): give query_tokens="):
        from_attention(cross, keys)


@pytest.mark.parametrize("attention,tokens,message", [
    (np.ones((2, 3, 4, 5, 6, 7)), None, r"has shape \(2, 3, 4, 5, 6, 7\): expected"),
    (np.full((4, 4), 0.25), list("abc"), "3 tokens given, but the maps have 4 keys"),
    (np.full((4, 4), np.nan), None, "layer 0 holds NaN or infinite values"),
    (-np.full((4, 4), 0.25), None, "layer 0 holds negative values"),
    ((torch.full((1, 2, 4, 4), 0.25), torch.full((1, 2, 3, 3), 1 / 3)), None, r"layer 1 has maps of shape \(2, 3, 3\)"),
    ((None, None), None, "attn_implementation='eager'"),  # what an SDPA model returns for output_attentions
    ((), None, "the attention tuple is empty"),
    ("not a tensor", None, "not an array of attention weights"),
])
def test_bad_input_is_one_line(attention, tokens, message):
    with pytest.raises(InputError, match=message) as err:
        attnviz.show(attention, tokens)
    assert "\n" not in str(err.value)


def test_a_capture_keeps_its_own_tokens(eager):
    cap = from_attention(eager, TOKENS)
    assert from_attention(cap) is cap
    with pytest.raises(InputError, match="a capture carries its own tokens"):
        attnviz.show(cap, 5)  # the old positional layer argument is refused, not silently ignored


def test_rows_that_do_not_sum_to_one_are_shown_and_said_once(eager):
    dropped = [a * 0.8 for a in eager]  # a learned sink's share taken from every row
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        widget = attnviz.show(dropped, TOKENS)
    said = [w for w in caught if "do not sum to one" in str(w.message)]
    assert len(said) == 1 and "0.8" in str(said[0].message)
    assert "do not sum to one" in widget.data["note"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # maps that do sum to one say nothing
        attnviz.show(eager, TOKENS)


def test_the_widget_cuts_a_region_from_the_tensors_it_holds(eager):
    widget = attnviz.show(eager, TOKENS, batch=1)
    widget.box = {"layer": 1, "head": None, "queries": [3, 9], "keys": [0, 4]}
    region = widget.region
    assert region.queries == (3, 9) and region.keys == (0, 4)
    np.testing.assert_array_equal(region.values[:, 2, 1], eager[1][1, :, 5, 1].numpy())


@pytest.mark.browser
@pytest.mark.skipif(not shutil.which("chromium") and not os.environ.get("ATTNVIZ_REQUIRE_BROWSER"),
                    reason="needs chromium (bash scripts/setup.sh dev)")
def test_save_html_writes_one_offline_file_that_draws_and_changes_layers(tmp_path):
    from appserver import browser_page

    n = 300  # above 256 tokens: the file's maps are max-pooled (8-bit codes)
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 2, n, n, generator=gen).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -torch.inf)
    attention = torch.softmax(scores, -1)
    path = attnviz.save_html(attention, [f"t{j}" for j in range(n)], tmp_path / "attention.html")
    text = path.read_text()
    assert "src=\"http" not in text and "attnvizHeatmap" in text
    with browser_page() as page:
        requests = []
        page.on("request", lambda r: requests.append(r.url))
        page.goto(path.as_uri())
        page.wait_for_function("() => document.querySelector('.avz-canvas')?.getAttribute('data-shown') === '2/mean/log'")
        assert page.evaluate("() => document.querySelector('.avz-root').__attnviz.panels[0].geom.m.w") == 150  # 2 tokens a pixel
        slider = page.locator(".avz-layer")
        slider.focus()
        slider.press("Home")
        page.wait_for_function("() => document.querySelector('.avz-canvas').getAttribute('data-shown') === '0/mean/log'")
        assert all(url.startswith(("file:", "data:")) for url in requests), requests
