"""Head classes on repeated random tokens and dormant heads (docs/methods.md#induction-previous-token-and-duplicate-heads,
docs/methods.md#dormant-heads): hand-made maps, and TransformerLens's head detector fed the engine's own maps."""

import numpy as np
import pytest
import torch

from attnviz.effects import induction
from attnviz.errors import InputError

from tiny import loaded, pair

L = 6


def test_the_sequences_repeat_distinct_tokens_after_bos_and_are_seeded():
    ids = induction.repeated_tokens(np.arange(10, 30), L, samples=3, seed=5, bos=1)
    assert ids.shape == (3, 2 * L + 1) and (ids[:, 0] == 1).all()
    assert torch.equal(ids[:, 1:L + 1], ids[:, L + 1:])
    assert all(len(set(row[1:L + 1].tolist())) == L for row in ids) and ((ids[:, 1:] >= 10) & (ids[:, 1:] < 30)).all()
    assert torch.equal(ids, induction.repeated_tokens(np.arange(10, 30), L, samples=3, seed=5, bos=1))
    assert not torch.equal(ids, induction.repeated_tokens(np.arange(10, 30), L, samples=3, seed=6, bos=1))
    with pytest.raises(InputError, match="too few"):
        induction.repeated_tokens(np.arange(5), L)


def _causal_uniform(n):
    return np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]


def test_uniform_attention_scores_its_own_baseline_and_a_perfect_head_scores_one():
    n = 2 * L + 1
    allow = np.tril(np.ones((n, n), dtype=bool))
    found = induction.scores(_causal_uniform(n)[None, None], allow, L)
    for name in induction.SCORES:  # uniform over the prefix: the target gets what any other key gets
        np.testing.assert_allclose(found[name], found[f"{name}_baseline"], rtol=1e-12)
    second = np.arange(L + 1, n)
    np.testing.assert_allclose(found["induction"], np.mean(1.0 / (second + 1)))
    perfect = np.zeros((n, n))
    perfect[:, 0] = 1.0  # every query on BOS ...
    perfect[second, 0] = 0.0
    perfect[second, second - L + 1] = 1.0  # ... but the second copy's on the token after its first occurrence
    found = induction.scores(perfect[None, None], allow, L)
    assert found["induction"][0] == 1.0 and found["induction_baseline"][0] == 0.0
    assert found["duplicate"][0] == 0.0
    hits = sum(perfect[i, i - 1] for i in range(2, n))
    assert found["prev_token"][0] == pytest.approx(hits / (2 * L - 1))
    expected = np.mean([(perfect[i, :i + 1].sum() - perfect[i, i - 1]) / i for i in range(2, n)])
    assert found["prev_token_baseline"][0] == pytest.approx(expected)


def test_dormancy_by_hand():
    n = 5
    probs = np.zeros((1, 2, n, n))
    probs[0, :, :, 0] = 1.0  # both heads on key 0 everywhere ...
    probs[0, 1, 3:, 0], probs[0, 1, 3:, 2] = 0.0, 1.0  # ... but head 1's active queries (3, 4) on key 2
    outputs = np.array([[[9.0, 1.0, 1.0, 1.0, 1.0], [9.0, 0.1, 0.3, 2.0, 4.0]]])
    quiet = np.array([[True, True, True, False, False]])  # query 0 never counts
    sink, ratio = induction.dormancy(probs, outputs, quiet, ~quiet)
    np.testing.assert_allclose(sink, [1.0, 1.0])
    np.testing.assert_allclose(ratio, [1.0, 0.2 / 3.0])
    scores = induction.HeadScores("m", "fwd", L, 1, 0, {"quiet_key0": sink[None], "dormant_ratio": ratio[None],
                                                         **{s: np.zeros((1, 2)) for s in induction.SCORES}})
    assert scores.holds("dormant").tolist() == [[False, True]]
    assert scores.with_thresholds(share=0.05).holds("dormant").tolist() == [[False, False]]
    assert np.isnan(induction.dormancy(probs, outputs, quiet, np.zeros_like(quiet))[1]).all()


def test_query_outputs_by_hand():
    probs = np.array([[[[1.0, 0.0], [0.5, 0.5]], [[1.0, 0.0], [0.0, 1.0]]]])  # 1 sequence, 2 heads, 2 tokens
    values = np.array([[[[3.0, 0.0], [0.0, 4.0]]]])  # 1 KV head shared by both, d = 2
    out = induction.query_outputs(probs, values, 2 * np.eye(4))
    np.testing.assert_allclose(out, [[[6.0, 2 * np.hypot(1.5, 2.0)], [6.0, 8.0]]])


def _reference(patterns: torch.Tensor, ids: torch.Tensor, length: int) -> dict[str, np.ndarray]:
    """TransformerLens's head detector ("mul": the pattern's mass on the detection pattern over the pattern's whole
    mass, every query counted) converted to attnviz's means over the queries that have a target: induction and
    duplicate x A.sum() / L (the L second-copy queries); previous-token (x A.sum() - A[1, 0]) / (2L - 1), since
    attnviz leaves out query 1, whose previous token is BOS. Patterns (B, H, n, n), ids (B, n)."""
    from transformer_lens import head_detector as hd

    makers = {"induction": hd.get_induction_head_detection_pattern,
              "prev_token": hd.get_previous_token_head_detection_pattern,
              "duplicate": hd.get_duplicate_token_head_detection_pattern}
    out = {name: [] for name in induction.SCORES}
    for pattern, tokens in zip(patterns.double(), ids):
        for name, make in makers.items():
            detection = make(tokens[None]).double()
            per_head = []
            for a in pattern:
                tl = hd.compute_head_attention_similarity_score(a, detection, exclude_bos=False,
                                                                exclude_current_token=False, error_measure="mul")
                total = float(a.sum())
                per_head.append(tl * total / length if name != "prev_token"
                                else (tl * total - float(a[1, 0])) / (2 * length - 1))
            out[name].append(per_head)
    return {name: np.mean(value, axis=0) for name, value in out.items()}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_scores_equal_transformer_lens_head_detector(family):
    """The engine's maps of the repeated tokens, fed to TransformerLens's scoring, give attnviz's scores to 1e-6; the
    engine's maps equal stock eager's (``output_attentions``) to 1e-5, so the reference reads the model's patterns."""
    stock, _ = pair(family)
    lm = loaded(family)
    ids = induction.repeated_tokens(induction.ordinary_ids(lm), L, samples=2, seed=3, bos=0)
    found = induction.maps_and_outputs(lm, ids)
    ours = induction.repeated(lm, length=L, samples=2, seed=3, bos=0)
    with torch.no_grad():
        eager = stock(ids, output_attentions=True).attentions
    for layer, (probs, _, _) in enumerate(found):
        np.testing.assert_allclose(probs, eager[layer].numpy(), atol=1e-5)
        reference = _reference(torch.from_numpy(probs), ids, L)
        for name in induction.SCORES:
            np.testing.assert_allclose(ours[name][layer], reference[name], atol=1e-6, err_msg=f"{name}@{layer}")


def test_the_figure_letters_each_head_with_its_classes():
    from attnviz.figures.heads import repeated_scores

    values = {"induction": np.array([[0.9, 0.1]]), "prev_token": np.array([[0.5, 0.2]]),
              "duplicate": np.array([[0.0, 0.45]]), "quiet_key0": np.array([[0.8, 0.1]]),
              "dormant_ratio": np.array([[0.1, 0.1]]),
              **{f"{s}_baseline": np.full((1, 2), 0.05) for s in induction.SCORES}}
    scores = induction.HeadScores("m", "fwd", L, 2, 0, values)
    fig = repeated_scores(scores)
    heat = fig.data[0]
    assert np.asarray(heat.z).tolist() == [[0.9, 0.1]] and np.asarray(heat.text).tolist() == [["IPz", "D"]]
    assert "induction 1, prev_token 1, duplicate 1, dormant 1" in fig.layout.title.text
    assert np.asarray(repeated_scores(scores.with_thresholds(tau=0.95), "duplicate").data[0].text).tolist() == [["z", ""]]
    with pytest.raises(InputError, match="unknown score"):
        repeated_scores(scores, "copying")
