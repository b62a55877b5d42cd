"""Sinks across a dataset (Gu et al.'s protocol), value norms, massive activations, pre-softmax scores
and rollout, each against a direct computation."""

import numpy as np
import pytest
import torch

from attnviz.effects import dataset
from attnviz.stats import metrics
from attnviz.capture import Capture, capture
from attnviz.plan import Keep
from attnviz.errors import AttnvizError, InputError, ModelLoadError

from tiny import loaded, pair

DOCS = ["a long document about sinks and attention that runs past the sample length",
        "another long enough text, with commas; and semicolons, to make it long",
        "short one", "x", "line one\nline two is here\n\nline three"]


def test_dataset_statistics_equal_a_loop_over_single_captures():
    lm = loaded("llama")
    result = dataset.sinks(lm, DOCS, "nosink-fwd", unit="doc", max_len=20)
    assert result.skipped == 1  # "x" has one token: no alpha
    assert result.n_samples == 4 and result.short_samples == 1  # "short one" has 9 tokens: used as it is
    singles = [capture(lm, d[:20], "nosink-fwd", Keep(storage_dtype=torch.float32)) for d in DOCS if len(d) >= 2]
    for s, cap in enumerate(singles):
        n = cap.n_tokens
        for layer in range(3):
            expected = metrics.alpha(cap.layer_probs(layer), cap.allowed[layer])
            np.testing.assert_allclose(result.alpha[s, layer, :, :n], expected, atol=1e-5, equal_nan=True)
            assert np.isnan(result.alpha[s, layer, :, n:]).all()
    full = [c for c in singles if c.n_tokens == 20]
    for layer in range(3):
        stack = np.stack([c.layer_probs(layer) for c in full])
        np.testing.assert_allclose(result.mean_maps()[layer], stack.mean(0), atol=1e-5)
        np.testing.assert_allclose(result.var_maps()[layer], stack.var(0), atol=1e-5)
    rates = result.rates(key=1, eps=0.05)
    for s, cap in enumerate(singles):
        for layer in range(3):
            assert rates[s, layer] == pytest.approx(metrics.sink_rate(result.alpha[s, layer, :, 1], 0.05))
    doc = result.as_json(key=1, eps=0.05)
    assert doc["samples"] == 4 and "shorter than 20 tokens" in doc["note"]
    layer0 = rates[:, 0]
    assert doc["layers"][0]["sink_rate"]["mean"] == pytest.approx(layer0.mean(), abs=1e-6)
    half = 1.96 * layer0.std(ddof=1) / 2
    assert doc["layers"][0]["sink_rate"]["ci95"] == pytest.approx([layer0.mean() - half, layer0.mean() + half], abs=1e-6)
    assert doc["layers"][0]["sink_rate"]["n"] == 4


def test_nosink_alpha_0_is_undefined_across_the_dataset():
    result = dataset.sinks(loaded("llama"), DOCS, "nosink-fwd", max_len=12)
    assert np.isnan(result.alpha[..., 0]).all()
    assert result.as_json(key=0)["model_rate"]["mean"] is None  # null where alpha_0 is defined for no head


def test_line_samples_and_limits():
    lm = loaded("llama")
    ids, skipped = dataset.samples(lm, DOCS, "line", max_len=8, n_samples=3)
    assert [len(x) for x in ids] == [8, 8, 8] and skipped == 0
    ids, _ = dataset.samples(lm, ["line one\nline two is here"], "line", max_len=64)
    assert [len(x) for x in ids] == [8, 16]
    with pytest.raises(InputError, match="must be positive"):
        dataset.samples(lm, DOCS, "doc", n_samples=0)
    with pytest.raises(InputError, match="no sample"):
        dataset.samples(lm, ["x", "y"], "doc")
    with pytest.raises(InputError, match="unknown sample unit"):
        dataset.samples(lm, DOCS, "sentence")


def test_value_norms_equal_a_direct_computation():
    stock, _ = pair("llama")
    lm = loaded("llama")
    cap = capture(lm, "value norms, directly", "fwd", Keep(value_norms=True))
    ids = torch.tensor([cap.token_ids])
    with torch.no_grad():
        hidden = stock(ids, output_hidden_states=True).hidden_states
    for layer in range(3):
        attn = stock.model.layers[layer].self_attn
        x = stock.model.layers[layer].input_layernorm(hidden[layer])[0]  # (n, d_model)
        v = attn.v_proj(x).view(len(cap.token_ids), 2, 8)  # 2 KV heads of dim 8
        wo = attn.o_proj.weight  # (d_model, 4 * 8)
        expected = np.stack([(v[:, h // 2] @ wo[:, h * 8:(h + 1) * 8].T).norm(dim=-1).detach().numpy()
                             for h in range(4)])
        np.testing.assert_allclose(cap.layer_value_norms(layer), expected, rtol=1e-4, atol=1e-5)
        weighted = cap.value_weighted(layer)
        np.testing.assert_allclose(weighted, cap.layer_probs(layer) * expected[:, None, :], rtol=1e-3, atol=1e-6)


def test_scores_are_the_pre_softmax_logits():
    lm = loaded("llama")
    cap = capture(lm, "pre-softmax", "fwd", Keep(scores=True, storage_dtype=torch.float32))
    for layer in range(3):
        scores = cap.layer_scores(layer)
        masked = np.where(cap.allowed[layer], scores, -np.inf)
        expected = np.exp(masked - masked.max(-1, keepdims=True))
        np.testing.assert_allclose(expected / expected.sum(-1, keepdims=True), cap.layer_probs(layer), atol=1e-6)


def test_activations_equal_output_hidden_states():
    stock, _ = pair("qwen2")
    lm = loaded("qwen2")
    cap = capture(lm, "massive activations", "fwd", Keep(activations=True, layers=[0]))
    with torch.no_grad():
        hidden = torch.stack(stock(torch.tensor([cap.token_ids]), output_hidden_states=True).hidden_states)[:, 0]
    np.testing.assert_allclose(cap.activations.norms, hidden.norm(dim=-1).numpy(), rtol=1e-5)
    top = cap.activations
    for layer in range(4):
        assert top.top_values[layer, 0] == pytest.approx(hidden[layer].abs().max().item(), rel=1e-6)
        t, d = top.top_tokens[layer, 0], top.top_dims[layer, 0]
        assert abs(hidden[layer, t, d].item()) == pytest.approx(top.top_values[layer, 0], rel=1e-6)
        assert (np.diff(top.top_values[layer]) <= 0).all()


def test_extras_survive_save_and_load(tmp_path):
    cap = capture(loaded("llama"), "saved", "fwd", Keep(scores=True, value_norms=True, activations=True))
    back = Capture.load(cap.save(tmp_path / "c.npz"))
    np.testing.assert_array_equal(back.layer_scores(1), cap.layer_scores(1))
    np.testing.assert_array_equal(back.layer_value_norms(2), cap.layer_value_norms(2))
    np.testing.assert_array_equal(back.activations.top_dims, cap.activations.top_dims)
    plain = capture(loaded("llama"), "saved", "fwd")
    assert not plain.scores and not plain.value_norm and plain.activations is None  # only when asked
    with pytest.raises(AttnvizError, match=r"capture with Keep\(scores=True\)"):
        plain.layer_scores(0)


def test_value_norms_refused_where_the_output_projection_cannot_be_read():
    """An output projection that is neither a Linear nor GPT-2's Conv1D (whose value norms now work, against W_O·v in
    tests/test_conformance.py) is refused in one line before anything runs."""
    lm = loaded("llama")
    for layer in lm.model.model.layers:  # the same function, behind a module attnviz cannot read a W_O from
        layer.self_attn.o_proj = torch.nn.Sequential(layer.self_attn.o_proj)
    with pytest.raises(ModelLoadError, match="cannot read the output projection"):
        capture(lm, "no", "fwd", Keep(value_norms=True))
    assert capture(loaded("gpt2"), "yes", "fwd", Keep(value_norms=True)).layer_value_norms(0).shape[0] == 4


def test_rollout_on_a_hand_example():
    a1 = np.array([[1.0, 0.0], [0.5, 0.5]])
    a2 = np.array([[1.0, 0.0], [0.0, 1.0]])
    # layer 1 with residual: [[1, 0], [0.25, 0.75]]; layer 2 is the identity: unchanged
    np.testing.assert_allclose(metrics.rollout([a1, a2]), [[1, 0], [0.25, 0.75]])
    a3 = np.array([[1.0, 0.0], [1.0, 0.0]])  # [[1, 0], [0.5, 0.5]] after the residual
    np.testing.assert_allclose(metrics.rollout([a1, a3]), [[1, 0], [0.625, 0.375]])
    short = np.array([[0.5, 0.0], [0.2, 0.4]])  # rows below 1 (StableMask): renormalised with the identity
    np.testing.assert_allclose(metrics.rollout([short]).sum(-1), [1, 1])


def test_key_share_of_attention_and_of_output_norm():
    probs = np.array([[[1.0, 0, 0], [0.8, 0.2, 0], [0.6, 0.2, 0.2]]])
    allowed = np.tril(np.ones((3, 3), bool))
    np.testing.assert_allclose(metrics.key_share(probs, allowed, 0), [(1 + 0.8 + 0.6) / 3])
    norms = np.array([[0.1, 1.0, 1.0]])  # the sink carries a small value
    weighted = metrics.value_weighted(probs, norms)
    shares = [1.0, 0.08 / 0.28, 0.06 / 0.46]
    np.testing.assert_allclose(metrics.key_share(weighted, allowed, 0), [np.mean(shares)], rtol=1e-6)
    unseen = allowed.copy()
    unseen[:, 2] = False
    assert np.isnan(metrics.key_share(probs, unseen, 2)).all()  # no query sees key 2


def test_dataset_keeps_the_allow_set_of_full_samples():
    result = dataset.sinks(loaded("llama"), DOCS, "mask0-bidir(k=1)", max_len=10)
    i, j = np.indices((10, 10))
    np.testing.assert_array_equal(result.allowed[0], j <= i)
    np.testing.assert_array_equal(result.allowed[2], (j > 0) | (i == 0))  # NoSink-BIDIR: key 0 hidden


# --- Linformer what-if (docs/methods.md#linformer-what-if) ----------------------------------------------------------------

def test_linformer_error_is_zero_at_k_equal_n_with_identity_projections():
    from attnviz.effects import linformer

    cap = capture(loaded("llama"), "linformer what-if", "fwd", Keep(layers=[1], qkv=True))
    qkv, n = cap.layer_qkv(1), cap.n_tokens
    np.testing.assert_array_equal(linformer.projection(n, n, "segment"), np.eye(n))  # segments of one: identity
    exact = linformer.whatif(qkv, cap.allowed[1], n, "segment", layer=1)
    assert exact.error_full < 1e-6 and exact.error_masked > 0.01  # full attention exactly; not the causal output
    curve = linformer.error_curve(qkv, cap.allowed[1], [1, 4, n], "segment")
    assert curve[0].error_full > curve[-1].error_full
    assert curve[-1].error_masked == pytest.approx(exact.error_masked)  # references computed once = per k
    np.testing.assert_allclose(curve[1].probs.sum(-1), 1, atol=1e-9)  # (H, n, k) rows sum to 1
    assert curve[1].probs.shape == (4, n, 4)
    # the captured layer's real output: probs @ v (GQA), against the what-if's masked reference
    v = np.repeat(qkv.v, 2, axis=0)
    np.testing.assert_allclose(linformer.exact(qkv.q, np.repeat(qkv.k, 2, axis=0), v, cap.allowed[1], qkv.scaling),
                               cap.layer_probs(1) @ v, atol=2e-3)


def test_linformer_projections_and_limits():
    from attnviz.effects import linformer

    seg = linformer.projection(10, 4)
    np.testing.assert_allclose(seg.sum(1), 1)
    assert (seg > 0).sum(1).tolist() == [2, 3, 2, 3]  # floor(s * 10 / 4) edges: 0, 2, 5, 7, 10
    g1, g2 = linformer.projection(10, 4, "gaussian", seed=3), linformer.projection(10, 4, "gaussian", seed=3)
    np.testing.assert_array_equal(g1, g2)
    with pytest.raises(InputError, match="between 1 and n - 1 = 9"):
        linformer.check_k(10, 10)
    with pytest.raises(InputError, match="got 0"):
        linformer.check_k(0, 10)


def test_walkthrough_linformer_step_and_finite_entries():
    from attnviz.effects import walkthrough as W

    steps = W.linformer_steps(W.Q, W.K, W.V, 2)
    np.testing.assert_allclose(steps["K'"], steps["E"] @ np.array(W.K, float))
    np.testing.assert_allclose(steps["weights"].sum(1), 1)
    assert steps["weights"].shape == (3, 2) and steps["output"].shape == (3, 2)
    assert W.linformer_steps(W.Q, W.K, W.V, 3)["error"] < 1e-12  # k = n: the identity
    with pytest.raises(InputError, match="finite number"):
        W.parse_matrix("1, nan\n2, 3", "Q")
    with pytest.raises(InputError, match="finite number"):
        W.parse_matrix("1, inf", "K")


def test_byte_lru_evicts_by_bytes_not_count():
    from ui.lru import ByteLRU, nbytes

    cache = ByteLRU(budget=1000)
    cache.put("a", np.zeros(50, dtype=np.float64))  # 400 bytes
    cache.put("b", np.zeros(50, dtype=np.float64))
    assert cache.get("a") is not None  # "a" is now the most recently used
    cache.put("c", np.zeros(50, dtype=np.float64))  # 1200 > 1000: the least recently used ("b") leaves
    assert "b" not in cache and "a" in cache and "c" in cache and cache.used == 800
    assert not cache.put("huge", np.zeros(200, dtype=np.float64))  # over the whole budget: not kept
    assert "huge" not in cache and len(cache) == 2
    cap = capture(loaded("llama"), "how heavy is a capture?", "fwd")
    arrays = sum(a.nbytes for a in cap.probs.values()) + sum(a.nbytes for a in cap.allowed.values())
    assert arrays <= nbytes(cap) <= arrays + 64 * 1024 + cap.next_logprobs.nbytes


def test_capture_cache_budget_from_the_settings(use_settings):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from ui.cache import capture_budget

    use_settings(memory_mb=512)  # ATTNVIZ_MEMORY_MB, read by the app (tests/test_settings.py)
    assert capture_budget() == 512 * 2**20
    use_settings(memory_mb=0)
    import os

    assert capture_budget() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
