"""Query-block attention: blocks of rows give the same probabilities, outputs, scores
and statistics as one whole-layer softmax, with block sizes that do not divide n."""

import numpy as np
import pytest
import torch

from attnviz.core.engine import routes
from attnviz.core import engine
from attnviz.stats import metrics
from attnviz.core.spec.arch import parse
from attnviz.capture import capture
from attnviz.plan import Keep
from attnviz.core.record.reduce import LayerSummary

from tiny import build, loaded

N = 13
TEXT = "Hi, there. A b"  # 14 characters, one token each: delimiters among them


def _ids(n=N, seed=1):
    return torch.randint(3, 90, (1, n), generator=torch.Generator().manual_seed(seed))


def _rows_to_bytes(rows, heads=4, n=N):
    return 4 * heads * n * rows


@pytest.mark.parametrize("kind,spec", [
    ("llama", "fwd"), ("llama", "nosink-bidir*3"), ("llama", "stablemask(gamma=0.5)"),
    ("llama", "stablemask(slopes=alibi, T=20)"), ("llama", "sliding(w=4)*2 + back"),
    ("gemma2", "fwd"), ("gpt_oss", "bidir*3"), ("qwen2", "fwd"),
])
@pytest.mark.parametrize("rows", [1, 5, 6])  # 13 = 5+5+3 = 6+6+1: blocks that do not divide n
@pytest.mark.parametrize("scores", [True, False])  # without scores, blocks also skip keys none of their rows sees
def test_blocks_equal_the_whole_layer(kind, spec, rows, scores, monkeypatch):
    model = build(kind)
    calls = []
    block_probs = routes.block_probs
    monkeypatch.setattr(routes, "block_probs", lambda *a, **k: calls.append(a[3].shape[2]) or block_probs(*a, **k))
    masks = list(parse(spec, 3).layers)
    whole, run_w = engine.forward(model, _ids(), masks, engine.Record(storage_dtype=torch.float32, scores=True))
    heads = model.config.num_attention_heads
    parts, run_b = engine.forward(model, _ids(), masks, engine.Record(storage_dtype=torch.float32, scores=scores, block_bytes=_rows_to_bytes(rows, heads)))
    assert calls[:3] == [N, N, N] and calls[3:] == ([rows] * (N // rows) + [N % rows][:N % rows]) * 3
    assert (parts.logits - whole.logits).abs().max().item() <= 1e-5
    for layer in range(3):
        assert (run_b.probs[layer] - run_w.probs[layer]).abs().max().item() <= 1e-6, layer
        if not scores:
            continue
        finite = torch.isfinite(run_w.scores[layer])
        assert torch.equal(finite, torch.isfinite(run_b.scores[layer]))
        assert (run_b.scores[layer][finite] - run_w.scores[layer][finite]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("spec", ["fwd", "nosink-fwd(m=2)*3", "bidir*3", "stablemask(gamma=0.5)", "back*3"])
@pytest.mark.parametrize("rows", [2, 5])
def test_streamed_statistics_equal_the_definitions_on_full_maps(spec, rows):
    lm = loaded("llama")
    full = capture(lm, TEXT, spec, Keep(storage_dtype=torch.float32))
    reduced = capture(lm, TEXT, spec, Keep(statistics=True, block_bytes=_rows_to_bytes(rows, n=len(TEXT))))
    assert reduced.reduced and not reduced.probs
    for layer in range(3):
        probs, allowed = full.layer_probs(layer), full.allowed[layer]
        stats = reduced.stats[layer]
        expected = {"alpha": metrics.alpha(probs, allowed), "column_mean": metrics.column_mean(probs),
                    "key0": metrics.key_profile(probs, allowed, 0), "discarded": metrics.discarded_mass(probs),
                    "entropy": metrics.entropy(probs, allowed, normalised=True),
                    "allocation": metrics.allocation(probs, full.tokens)}
        for name, value in expected.items():
            np.testing.assert_allclose(stats[name], value, atol=2e-6, equal_nan=True, err_msg=f"{name} L{layer}")


def test_layer_summary_on_a_hand_written_matrix():
    """Two heads, three queries, fed in blocks of one and two rows, against numbers worked by hand."""
    a = np.array([[[1.0, 0, 0], [0.5, 0.5, 0], [0.25, 0.25, 0.5]],
                  [[1.0, 0, 0], [0.9, 0.1, 0], [0.8, 0.0, 0.1]]], dtype=np.float32)  # last row: 0.1 discarded
    allowed = np.tril(np.ones((3, 3), bool))
    summary = LayerSummary(2, 3, 3, ["<s>", ",", "x"])
    summary.add(0, torch.from_numpy(a[:, :1]), torch.from_numpy(allowed[:1]))
    summary.add(1, torch.from_numpy(a[:, 1:]), torch.from_numpy(allowed[1:]))
    out = summary.result()
    np.testing.assert_allclose(out["alpha"][0], [(1 + 0.5 + 0.25) / 3, (0.5 + 0.25) / 2, np.nan], equal_nan=True)
    np.testing.assert_allclose(out["alpha"][1, :2], [(1 + 0.9 + 0.8) / 3, 0.1 / 2], rtol=1e-6)
    np.testing.assert_allclose(out["discarded"][1], [0, 0, 0.1], atol=1e-6)
    np.testing.assert_allclose(out["entropy"][0, 1], 1.0, rtol=1e-6)  # uniform over its two keys
    # allocation of head 0, query 2: first 0.25, delimiter ',' 0.25, diagonal 0.5, other 0
    np.testing.assert_allclose(out["allocation"][0, 2], [0.25, 0.25, 0.5, 0.0, 0.0], atol=1e-6)
