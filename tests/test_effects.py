"""What a mask does to the model (docs/methods.md#evaluation): perplexity windows, streaming with a KV cache,
cached generation and the embedding probe, against hand-written computations with stock transformers."""

import numpy as np
import pytest
import torch

from attnviz import corpus
from attnviz.effects import embedding
from attnviz.core import engine
from attnviz.core.spec.arch import parse, with_k
from attnviz.errors import ArchitectureError, InputError
from attnviz.effects.evaluate import evaluate, windows
from attnviz.effects.generate import generate
from attnviz.effects.streaming import CachedDecoder, parse_policy, stream

from tiny import VOCAB, loaded, pair


def _ids(n, seed=3):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def stock_nll(model, ids, spans):
    """Hand-written docs/methods.md#evaluation scoring with a stock eager model: -log p(token | window prefix)."""
    out = []
    for start, end, first in spans:
        with torch.no_grad():
            logits = model(torch.tensor([ids[start:end]])).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        out += [-float(logp[p - 1 - start, ids[p]]) for p in range(first, end)]
    return np.array(out)


# --- windows (docs/methods.md#evaluation) -------------------------------------------------------------------------

def test_windows_follow_the_perplexity_guide():
    # S = W: every window's first token goes unscored
    assert windows(10, 4, 4) == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]
    # S < W: each window predicts what no earlier window did, the last one reaches n
    assert windows(10, 4, 2) == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    assert windows(5, 8, 8) == [(0, 5, 1)]


@pytest.mark.parametrize("window,stride", [(8, 8), (8, 3), (30, 30)])
def test_eval_equals_a_hand_computation_with_stock_transformers(window, stride):
    stock, _ = pair("llama")
    lm = loaded("llama")
    ids = _ids(30)
    result = evaluate(lm, ids, "fwd", window=window, stride=stride)
    expected = stock_nll(stock, ids, windows(30, window, stride))
    np.testing.assert_allclose(result.token_nll, expected, atol=1e-5)
    assert result.tokens == len(expected) == len(set(result.positions.tolist()))
    assert result.perplexity == pytest.approx(np.exp(expected.mean()), rel=1e-5)


def test_eval_matches_hf_loss_on_the_same_windows():
    """transformers' perplexity guide: labels with -100 outside each window's new targets."""
    stock, _ = pair("qwen2")
    ids = _ids(40)
    nll_sum, count = 0.0, 0
    for start, end, first in windows(40, 16, 8):
        labels = torch.tensor([ids[start:end]])
        labels[0, : first - start] = -100
        with torch.no_grad():
            loss = stock(torch.tensor([ids[start:end]]), labels=labels).loss
        nll_sum += float(loss) * (end - first)
        count += end - first
    ours = evaluate(loaded("qwen2"), ids, "fwd", window=16, stride=8)
    assert ours.nll == pytest.approx(nll_sum / count, rel=5e-3)


def test_eval_accuracy_counts_argmax_hits():
    stock, _ = pair("llama")
    ids = _ids(20)
    with torch.no_grad():
        predicted = stock(torch.tensor([ids])).logits[0].argmax(-1)
    hits = [int(predicted[p - 1]) == ids[p] for p in range(1, 20)]
    assert evaluate(loaded("llama"), ids, "fwd", window=20).accuracy == pytest.approx(np.mean(hits))


def test_nosink_changes_the_perplexity():
    lm = loaded("llama")
    ids = _ids(24)
    assert evaluate(lm, ids, "nosink-fwd", window=24).nll != pytest.approx(evaluate(lm, ids, "fwd", window=24).nll, abs=1e-4)


@pytest.mark.parametrize("spec", ["bidir", "back", "inplace-bidir(k=1)", "mask0-bidir(k=2)", "stablemask(gamma=0.5)"])
def test_eval_refuses_architectures_that_see_later_keys(spec):
    with pytest.raises(ArchitectureError, match="read the token it predicts"):
        evaluate(loaded("llama"), _ids(10), spec, window=10)


@pytest.mark.parametrize("kwargs,message", [
    (dict(window=0), "window must be positive"),
    (dict(window=11), "longer than the text"),
    (dict(window=8, stride=9), "stride must be between"),
])
def test_eval_bad_windows(kwargs, message):
    with pytest.raises(InputError, match=message):
        evaluate(loaded("llama"), _ids(10), "fwd", **kwargs)


def test_eval_needs_two_tokens():
    with pytest.raises(InputError, match="at least 2"):
        evaluate(loaded("llama"), [5], "fwd", window=1)
    with pytest.raises(InputError, match="empty"):
        evaluate(loaded("llama"), "   ", "fwd")


# --- streaming (docs/methods.md#cache-policies) -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_dense_streaming_equals_the_plain_forward(kind):
    stock, _ = pair(kind)
    ids = _ids(24)
    result = stream(loaded(kind), ids, "dense")
    np.testing.assert_allclose(result.token_nll, stock_nll(stock, ids, [(0, 24, 1)]), atol=1e-4)


@pytest.mark.parametrize("s,w", [(0, 5), (2, 5), (1, 8)])
def test_eviction_equals_a_sink_plus_window_mask(s, w):
    """Kept entries keep their positions, so sink(s, w) is exactly a forward under global(w=w+1, g=s):
    each query sees the first s keys and the last w before itself."""
    lm = loaded("llama")
    ids = _ids(26)
    policy = f"sink(s={s}, w={w})" if s else f"window(w={w})"
    mask = f"global(w={w + 1}, g={s})" if s else f"sliding(w={w + 1})"
    np.testing.assert_allclose(stream(lm, ids, policy).token_nll, evaluate(lm, ids, mask, window=26).token_nll,
                               atol=1e-4)


def test_sink_zero_equals_window():
    lm = loaded("llama")
    ids = _ids(20)
    np.testing.assert_array_equal(stream(lm, ids, "sink(s=0, w=6)").token_nll, stream(lm, ids, "window(w=6)").token_nll)


def test_the_cache_holds_the_first_s_and_the_last_w_entries():
    decoder = CachedDecoder(loaded("llama"), "fwd", "sink(s=2, w=3)")
    for token in _ids(9):
        decoder.step(token)
        assert decoder.cache.layers[0].keys.shape[-2] == len(decoder.positions) <= 5
    assert decoder.positions == [0, 1, 6, 7, 8]


@pytest.mark.parametrize("text,message", [
    ("sliding", "cannot read cache policy"), ("window(w=0)", "must be positive"), ("window(s=1)", "unknown parameter"),
    ("sink(w=4)", "needs s="), ("sink(s=-1, w=4)", "must be >= 0"),
])
def test_bad_policies(text, message):
    with pytest.raises(InputError, match=message):
        parse_policy(text)


def test_policy_sizes_are_checked_against_text_and_context():
    lm = loaded("llama")
    with pytest.raises(InputError, match="only 10 tokens"):
        stream(lm, _ids(10), "window(w=12)")
    with pytest.raises(InputError, match="context"):
        stream(lm, _ids(10), "sink(s=4, w=600)")
    with pytest.raises(ArchitectureError, match="cannot decode"):
        stream(lm, _ids(10), "dense", "bidir")
    assert parse_policy("sink( s=4 , w=124 )").spec == "sink(s=4, w=124)"


# --- generation with the cache ------------------------------------------------------------------

def test_cached_generation_matches_transformers_greedy():
    lm = loaded("qwen2")
    ids = lm.tokenizer("greedy")["input_ids"]
    lm.model.generation_config.eos_token_id = None
    result = generate(lm, "greedy", "fwd", max_new_tokens=6)
    with torch.no_grad():
        reference = lm.model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                      pad_token_id=0)[0, len(ids):].tolist()
    assert result.new_ids == reference


def test_per_step_maps_equal_the_rows_of_a_full_capture():
    lm = loaded("llama")
    result = generate(lm, "rows of a map", "nosink-fwd", max_new_tokens=5)
    fed = result.prompt_ids + result.new_ids[:-1]
    _, run = engine.forward(lm.model, torch.tensor([fed]), list(parse("nosink-fwd", 3).layers), engine.Record(storage_dtype=torch.float32))
    for layer in range(3):
        for step in result.steps:
            np.testing.assert_allclose(step.maps[layer], run.probs[layer][0, :, step.position, :step.position + 1],
                                       atol=1e-5)
    values, evicted = result.attention_rows(2)
    assert not evicted.any() and np.isnan(values[np.triu_indices(len(fed), 1)]).all()


def test_window_generation_marks_evicted_positions():
    result = generate(loaded("llama"), "evict the sink", "fwd", "window(w=4)", max_new_tokens=3)
    values, evicted = result.attention_rows(0, head=1)
    for row, step in enumerate(result.steps):
        assert np.flatnonzero(evicted[row]).tolist() == list(range(max(0, step.position - 4)))
        assert np.isfinite(values[row, step.kv_positions]).all()
        assert np.nansum(values[row]) == pytest.approx(1, abs=1e-5)


@pytest.mark.parametrize("spec", ["bidir", "mask0-bidir(k=1)", "back", "stablemask(gamma=0.5)"])
def test_generation_refuses_non_causal_architectures(spec):
    with pytest.raises(ArchitectureError, match="cannot decode"):
        generate(loaded("llama"), "no", spec)


def test_generation_bad_length():
    with pytest.raises(InputError, match="max_new_tokens"):
        generate(loaded("llama"), "no", "fwd", max_new_tokens=0)


# --- embedding probe (docs/methods.md#evaluation) -----------------------------------------------------------------

DOCS = ["the quick brown fox jumps over the lazy dog " * 2, "0123456789" * 4, "attention sinks everywhere ! " * 2,
        "zzzz yyyy xxxx wwww vvvv " * 2, "short"]


def test_retrieval_scores_on_known_embeddings():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    t = torch.tensor([[1.0, 0.1], [0.2, 1.0], [-1.0, -1.0]])
    recall, mrr, ranks = embedding.retrieval_scores(q, t)
    # query 0: own target cos 0.995 beats 0.196 and -0.707 -> rank 1; query 1: 0.981 beats 0.0995 -> rank 1;
    # query 2: its own target points the opposite way, both others score higher -> rank 3
    assert ranks.tolist() == [1, 1, 3]
    assert recall == pytest.approx(2 / 3) and mrr == pytest.approx((1 + 1 + 1 / 3) / 3)
    # a tie shares the best place: rank = 1 + the number of targets scoring strictly higher
    _, _, tied = embedding.retrieval_scores(torch.tensor([[1.0, 0.0]] * 2), torch.tensor([[1.0, 0.0]] * 2))
    assert tied.tolist() == [1, 1]


def test_probe_equals_a_hand_computation():
    m = 12
    stock, _ = pair("llama")
    lm = loaded("llama")
    result = embedding.probe(lm, DOCS, "fwd", m=m)
    usable = [lm.tokenizer(d)["input_ids"] for d in DOCS if len(lm.tokenizer(d)["input_ids"]) >= 2 * m]
    assert result.n_docs == len(usable) == 4  # "short" has fewer than 2m tokens

    def emb(ids):
        with torch.no_grad():
            return stock(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].mean(0)

    q = torch.stack([emb(ids[:m]) for ids in usable])
    t = torch.stack([emb(ids[m:2 * m]) for ids in usable])
    sim = torch.nn.functional.cosine_similarity(q[:, None], t[None], dim=-1)
    ranks = [1 + int((sim[i] > sim[i, i]).sum()) for i in range(4)]
    assert result.recall_at_1 == pytest.approx(np.mean([r == 1 for r in ranks]))
    assert result.mrr == pytest.approx(np.mean([1 / r for r in ranks]), rel=1e-5)


def test_probe_needs_two_documents():
    with pytest.raises(InputError, match="too small for the probe"):
        embedding.probe(loaded("llama"), ["only one document that is long enough " * 3], "fwd", m=8)


def test_k_sweep_rows_and_shared_k0():
    lm = loaded("llama")
    rows = embedding.sweep(lm, DOCS, "inplace-bidir", [0, 1, 3], m=10)
    assert [r.k for r in rows] == [0, 1, 3] and rows[0].arch == "inplace-bidir(k=0)"
    plain = embedding.probe(lm, DOCS, "fwd", m=10)
    assert (rows[0].recall_at_1, rows[0].mrr) == (plain.recall_at_1, plain.mrr)  # k = 0 is FWD
    top = embedding.probe(lm, DOCS, "bidir", m=10)
    assert rows[2].mrr == pytest.approx(top.mrr)  # k = L converts every layer
    assert [r.k for r in embedding.sweep(lm, DOCS, "mask0&bidir(k0=2)", None, m=10)] == [2, 3]


def test_with_k_fills_in_k():
    assert with_k("mask0-bidir", 3, 30).spec == "mask0-bidir(k=3)"
    assert with_k("MASK0&BIDIR(k0=2)", 4, 30).spec == "mask0&bidir(k=4, k0=2)"
    assert with_k("inplace-back(k=9)", 2, 30).spec == "inplace-back(k=2)"
    with pytest.raises(ArchitectureError, match="needs a named architecture"):
        with_k("fwd", 2, 30)
    with pytest.raises(InputError, match="k=31"):
        embedding.parse_ks("0,31", 30)


# --- the offline corpus ------------------------------------------------------------------------

def test_stdlib_corpus_is_read_at_run_time():
    from pydoc_data.topics import topics

    full = corpus.load("stdlib")
    assert len(full.documents) == len(topics) and full.documents[0] == topics[sorted(topics)[0]].strip()
    one = corpus.load("stdlib:specialnames")
    assert one.documents == (topics["specialnames"].strip(),)
    with pytest.raises(InputError, match="no topic 'specialname'.*specialnames"):
        corpus.load("stdlib:specialname")
    with pytest.raises(InputError, match="unknown corpus"):
        corpus.load("wikitext")


def test_text_files_split_at_blank_lines(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text("first doc\nstill first\n\n\nsecond doc\n  \nthird\n")
    assert corpus.load(text_file=path).documents == ("first doc\nstill first", "second doc", "third")
    path.write_text(" \n\n ")
    with pytest.raises(InputError, match="empty"):
        corpus.load(text_file=path)
    with pytest.raises(InputError, match="cannot read"):
        corpus.load(text_file=tmp_path / "missing.txt")


@pytest.mark.parametrize("policy", ["dense", "window(w=4)"])
def test_generation_estimate_counts_the_recorded_rows_and_refuses_past_a_limit(policy):
    from attnviz.effects.generate import ROW_OVERHEAD, estimate_bytes
    from attnviz.effects.streaming import parse_policy

    lm = loaded("llama")
    result = generate(lm, "how much does a generation keep in memory", "fwd", policy, max_new_tokens=4)
    kept = sum(m.nbytes for step in result.steps for m in step.maps.values())
    positions = sum(len(step.kv_positions) for step in result.steps)
    assert estimate_bytes(lm, len(result.steps), parse_policy(policy)) == kept + positions * ROW_OVERHEAD
    assert sum(step.logprobs is not None for step in result.steps) == 1  # only the newest distribution stays
    with pytest.raises(InputError, match=r"a prompt of at most ~\d+ tokens fits"):
        generate(lm, "how much does a generation keep in memory", "fwd", policy, max_new_tokens=4,
                 max_bytes=kept // 2)
