"""The compression valley (docs/methods.md#the-compression-valley): the matrix-based entropy of each layer's input
against a direct numpy computation on stock transformers' hidden states, in float32 and bfloat16, under a recipe;
the sinks JSON's fields, the sweep measure, the figure and the Attention sinks page's section."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

import tiny
from attnviz.capture import capture
from attnviz.core.engine.hooks import layer_input_norms
from attnviz.effects import valley
from attnviz.plan import Keep
from attnviz.stats.spectrum import matrix_entropy, matrix_entropy_of
from conftest import ENGLISH

SHORT = "The cat sat on a mat."  # 21 tokens: fewer than d = 32, Z Z^T itself
LONG = "The keeper lit the lamp at dusk, and watched the sea until the dawn came."  # 73 tokens: Z^T Z, d x d
FAMILIES = ["llama", "gemma3_text", "gpt2"]
BF16_LIMIT = 5e-3  # |H(bfloat16) - H(float32)|: the stream itself has about three significant digits in bfloat16


def _stock_entropies(stock, text: str) -> tuple[list[float], list[float]]:
    """H and the first token's norm of each layer's input, from stock transformers' output_hidden_states (the input
    of layer l is hidden_states[l]), with numpy's eigenvalues of Z Z^T in float64."""
    ids = torch.tensor([tiny.CharTokenizer()(text)["input_ids"]])
    with torch.no_grad():
        states = stock(ids, output_hidden_states=True).hidden_states
    n_layers = stock.config.num_hidden_layers
    return ([matrix_entropy_of(states[l][0].numpy()) for l in range(n_layers)],
            [float(np.linalg.norm(states[l][0, 0].numpy())) for l in range(n_layers)])


def test_matrix_entropy_on_hand_spectra():
    assert matrix_entropy(np.ones(5), 5) == pytest.approx(1.0)  # n orthogonal rows of one norm
    assert matrix_entropy([3.0, 0, 0, 0], 4) == pytest.approx(0.0)  # rank one
    assert matrix_entropy([1.0, 1.0], 4) == pytest.approx(np.log(2) / np.log(4))
    assert matrix_entropy([1.0, 1.0, -1e-17], 4) == matrix_entropy([1.0, 1.0], 4)  # rounding below 0 counts 0
    assert np.isnan(matrix_entropy([2.0], 1)) and np.isnan(matrix_entropy([0.0, 0.0], 2))
    z = np.random.default_rng(0).normal(size=(7, 3))  # n > d: Z^T Z has the same nonzero spectrum as Z Z^T
    assert matrix_entropy(np.linalg.eigvalsh(z.T @ z), 7) == pytest.approx(matrix_entropy_of(z), abs=1e-12)
    massive = z.copy()
    massive[0] *= 1e3  # one row's norm far above the others': the valley
    assert matrix_entropy_of(massive) < 0.01 < matrix_entropy_of(z)


@pytest.mark.parametrize("text", [SHORT, LONG], ids=["n<d", "n>d"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_entropy_per_layer_equals_stock_hidden_states(kind, text):
    stock, ours = tiny.pair(kind)
    lm = tiny.LoadedModel(ours, tiny.CharTokenizer(), f"tiny-{kind}", None, 0.0)
    found = valley.measure(lm, text, "fwd")
    entropies, norms = _stock_entropies(stock, text)
    assert found.layers == list(range(lm.n_layers)) and found.n_tokens == len(text)
    np.testing.assert_allclose(found.entropy, entropies, atol=1e-5, rtol=0)
    np.testing.assert_allclose(found.first_norm, norms, rtol=1e-5)
    assert found.keys == [0] * lm.n_layers and np.isfinite(found.sink_rate()).all()


def test_the_sum_over_blocks_of_rows_equals_one_product():
    z = torch.randn(300, 16, dtype=torch.float32) * torch.logspace(0, 3, 16)  # a wide range of scales
    whole = valley.gram_spectrum(z, rows=1024)
    blocks = valley.gram_spectrum(z, rows=7)
    np.testing.assert_allclose(blocks, whole, rtol=1e-10, atol=1e-6 * whole.max())
    assert valley.accumulation_dtype(z.device) == torch.float64


def test_the_entropy_follows_the_recipe():
    """Measured in the recipe's own forward: NoSink-FWD reads its sink at key 1 (key 0's alpha undefined) and its
    layers above the first see another stream than FWD's; an intervention changes the stream too."""
    lm = tiny.loaded("llama")
    fwd, nosink = valley.measure(lm, LONG, "fwd"), valley.measure(lm, LONG, "nosink-fwd")
    assert nosink.keys == [1] * lm.n_layers and all(np.isnan(nosink.sink_rate(key0=True)))
    assert nosink.entropy[0] == pytest.approx(fwd.entropy[0], abs=1e-12)  # layer 0's input: the embedding
    assert max(abs(a - b) for a, b in zip(fwd.entropy[1:], nosink.entropy[1:])) > 1e-4
    from attnviz.recipe import Recipe

    ablated = valley.measure(lm, LONG, Recipe.of(lm, "fwd", intervene="ablate(heads=0,1,2,3)@0"))
    assert abs(ablated.entropy[1] - fwd.entropy[1]) > 1e-4 and ablated.entropy[0] == pytest.approx(fwd.entropy[0])


@pytest.mark.parametrize("kind", FAMILIES)
def test_bfloat16_entropy_is_close_to_float32(kind):
    from attnviz.support import in_dtype

    lm = tiny.loaded(kind)
    full, half = valley.measure(lm, LONG, "fwd"), valley.measure(in_dtype(lm, torch.bfloat16), LONG, "fwd")
    np.testing.assert_allclose(half.entropy, full.entropy, atol=BF16_LIMIT, rtol=0)
    np.testing.assert_allclose(half.first_norm, full.first_norm, rtol=2e-2)


def test_the_sinks_json_gains_entropy_and_keeps_every_other_field():
    from attnviz.cli import sinks_report

    lm = tiny.loaded("gemma3_text")
    keep = Keep(statistics=("alpha", "column_mean", "discarded"), value_norms=True)
    with layer_input_norms(lm.model) as norms, valley.layer_entropies(lm.model) as entropies:
        cap = capture(lm, LONG, "fwd", keep)
    plain, with_entropy = sinks_report(cap, 0.3, norms), sinks_report(cap, 0.3, norms, entropies=entropies)
    assert with_entropy.pop("entropy_variant") == valley.VARIANT and "entropy_variant" not in plain
    got = [layer.pop("entropy") for layer in with_entropy["layers"]]
    assert json.dumps(with_entropy) == json.dumps(plain)  # every other field, byte for byte
    np.testing.assert_allclose(got, valley.measure(lm, LONG, "fwd").entropy, atol=1e-6)


def test_the_cli_prints_each_layer_s_entropy(default_model, capsys):
    from attnviz.cli import main

    assert main(["sinks", "--model", "default", "--text", ENGLISH, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["entropy_variant"] == valley.VARIANT
    entropies = [layer["entropy"] for layer in doc["layers"]]
    assert len(entropies) == 30 and all(0 < h < 1 for h in entropies)


def test_the_sweep_measure_gives_one_row_a_layer():
    from attnviz.sweep import measures
    from attnviz.sweep.spec import Cell, measure_options

    options = {name: default for name, (_, default) in measure_options()["valley"].items()}
    rows = measures.valley(tiny.loaded("llama"), Cell("valley", "tiny", "fwd", "", "stdlib:specialnames", options))
    assert [r["layer"] for r in rows] == [0, 1, 2] and all(set(r) == set(measures.COLUMNS["valley"]) for r in rows)
    assert all(0 < r["entropy"] <= 1 and r["first_norm"] > 0 and r["key"] == 0 for r in rows)


def _figure():
    from attnviz.figures.valley import valley_figure

    return valley_figure(valley.measure(tiny.loaded("llama"), LONG, "nosink-fwd"), 0.3)


def test_the_figure_has_three_panels_over_depth():
    fig = _figure()
    axes = sorted({trace.yaxis for trace in fig.data})
    assert axes == ["y", "y2", "y3"]
    top, middle, bottom = (fig.layout[name].domain for name in ("yaxis", "yaxis2", "yaxis3"))
    assert top[0] > middle[1] and middle[0] > bottom[1]  # stacked, the norm on top and H at the bottom
    names = [trace.name for trace in fig.data]
    assert names[0] == "‖first token‖" and names[1] == "sink rate at key 1" and "entropy H" in names
    assert fig.layout.yaxis.type == "log" and "valley" in fig.layout.title.text


@pytest.mark.skipif(not shutil.which("chromium") and not os.environ.get("ATTNVIZ_REQUIRE_BROWSER"),
                    reason="needs chromium (bash scripts/setup.sh dev)")
def test_the_figure_renders_in_chromium():
    from attnviz.figures import export

    data = export.figure_bytes(_figure(), "png", {"tool": "attnviz", "figure": "compression-valley"})
    assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_the_sinks_page_shows_the_compression_valley(model_cache, tmp_path):
    from test_app import app_test, charts, on_page, texts, title

    at = app_test(tmp_path)
    at.run()
    on_page(at, "pages/sinks.py")
    assert "The compression valley" in texts(at.subheader)
    assert not any("compression valley" in (title(c) or "") for c in charts(at))  # one more forward: asked for
    at.toggle(key="sk_valley").set_value(True).run()
    assert not at.exception, [e.value for e in at.exception]
    shown = [c for c in charts(at) if "the compression valley" in (title(c) or "")]
    assert len(shown) == 1 and {t.get("yaxis", "y") for t in shown[0]["data"]} == {"y", "y2", "y3"}
    assert "The lowest entropy enters layer" in texts(at.caption)
