"""Score attribution (docs/methods.md#score-attribution) against direct computations that do not use the
attnviz engine: stock transformers with hooks on q_proj / k_proj and on each block's output, the rotary
rotation applied with the model's own apply_rotary_pos_emb."""

import importlib

import numpy as np
import pytest
import torch

from attnviz.effects.explain import explain
from attnviz.recipe import Recipe
from attnviz.errors import InputError

from tiny import build, loaded

TEXT = "The keeper lit the lamp, and ships passed the rocks."


def stock_scores(kind, layer, ids):
    """(H, n, n) scaled pre-softmax scores of ``layer`` from stock eager hooks (before any soft-capping),
    and the stock residual stream's parts: embeddings, each earlier block's attention and MLP outputs
    (Gemma 2's after their post-norms: what the block adds to the stream)."""
    model = build(kind)
    module = importlib.import_module(type(model).__module__)
    got, parts = {}, {}
    keep = lambda name: (lambda m, a, o: got.__setitem__(name, o))  # noqa: E731
    row = lambda name: (lambda m, a, o: parts.__setitem__(name, (o[0] if isinstance(o, tuple) else o)[0]))  # noqa: E731
    if kind == "gpt2":
        blocks = model.transformer.h
        attn = blocks[layer].attn
        hooks = [attn.c_attn.register_forward_hook(keep("qkv"))]
    else:
        blocks = model.model.layers
        attn = blocks[layer].self_attn
        hooks = ([attn.qkv_proj.register_forward_hook(keep("qkv"))] if kind == "phi3" else
                 [attn.q_proj.register_forward_hook(keep("q")), attn.k_proj.register_forward_hook(keep("k"))])
    for l in range(layer):
        block = blocks[l]
        a, m = ((block.post_attention_layernorm, block.post_feedforward_layernorm) if kind == "gemma2" else
                (block.attn, block.mlp) if kind == "gpt2" else (block.self_attn, block.mlp))
        hooks += [a.register_forward_hook(row(f"attn.{l}")), m.register_forward_hook(row(f"mlp.{l}"))]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        n, d = len(ids), attn.head_dim
        heads = model.config.n_head if kind == "gpt2" else model.config.num_attention_heads
        if "qkv" in got:
            width = heads * d
            got["q"], got["k"] = got["qkv"][..., :width], got["qkv"][..., width:width + (
                width if kind == "gpt2" else model.config.num_key_value_heads * d)]
        q = got["q"].view(1, n, -1, d).transpose(1, 2)
        k = got["k"].view(1, n, -1, d).transpose(1, 2)
        if kind != "gpt2":
            cos, sin = model.model.rotary_emb(out.hidden_states[layer], torch.arange(n)[None])
            q, k = module.apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scale = d ** -0.5 if kind == "gpt2" else attn.scaling
        scores = (q @ k.transpose(-1, -2))[0] * scale
    for hook in hooks:
        hook.remove()
    return scores, out.hidden_states, parts


FAMILIES = ["llama", "qwen2", "mistral", "phi3", "gemma2", "gpt_oss", "gpt2"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_score_and_its_parts_match_stock_transformers(kind):
    lm = loaded(kind)
    ids = lm.tokenizer(TEXT)["input_ids"]
    layer, head, i, j = 2, 3, 17, 15  # inside every tiny family's sliding window (4 or 5)
    scores, hidden, parts = stock_scores(kind, layer, ids)
    e = explain(lm, TEXT, "fwd", layer=layer, head=head, query=i, key=j)
    assert e.score == pytest.approx(float(scores[head, i, j]), abs=1e-4)
    assert sum(e.by_dim) == pytest.approx(e.score, abs=1e-4)
    assert len(e.by_dim) == (lm.model.config.n_embd // lm.n_heads if kind == "gpt2" else
                             lm.model.model.layers[0].self_attn.head_dim)
    assert sum(e.key_sources.values()) == pytest.approx(e.score, abs=1e-4)
    assert sum(e.query_sources.values()) == pytest.approx(e.score, abs=1e-4)
    assert set(e.key_sources) >= {"embed", "attn.0", "mlp.0", "attn.1", "mlp.1"}
    assert ("bias" in e.key_sources) == (kind in ("qwen2", "gpt_oss", "gpt2"))  # q/k bias (GPT-2: and LayerNorm's β)
    # the stream's parts are the stock model's: the sources (and the embeddings) sum to its hidden state
    total = sum(parts[f"{b}.{l}"] for l in range(layer) for b in ("attn", "mlp")) + hidden[0][0]
    torch.testing.assert_close(total, hidden[layer][0], atol=1e-4, rtol=1e-4)
    if kind == "gpt2":  # learned positions: no rotary pairs; the position embedding is a source of its own
        assert e.by_pair == [] and e.frequencies == [] and "pos" in e.key_sources and e.position == "learned absolute"
    else:
        assert sum(e.by_pair) == pytest.approx(e.score, abs=1e-4) and len(e.by_pair) * 2 == len(e.by_dim)
    if kind == "gemma2":  # the softmax sees cap · tanh(s / cap), as the stock eager forward computes it
        cap = lm.model.config.attn_logit_softcapping
        assert e.softcapped_score == pytest.approx(cap * float(torch.tanh(scores[head, i, j] / cap)), abs=1e-5)
    else:
        assert e.softcapped_score is None


def test_gpt2_s_counterfactual_is_the_score_without_the_position_embedding():
    lm = loaded("gpt2")
    model = lm.model
    ids = lm.tokenizer(TEXT)["input_ids"]
    layer, head, i, j = 1, 2, 14, 3
    _, hidden, _ = stock_scores("gpt2", layer, ids)
    block = model.transformer.h[layer]
    x = hidden[layer][0]
    pos = model.transformer.wpe(torch.arange(len(ids)))
    with torch.no_grad():
        centred = x - x.mean(-1, keepdim=True)
        sigma = torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + block.ln_1.eps)  # frozen at the run's value
        y = x - pos
        normed = block.ln_1.weight * (y - y.mean(-1, keepdim=True)) / sigma + block.ln_1.bias
        qkv = block.attn.c_attn(normed)
        d, width = block.attn.head_dim, model.config.n_embd
        q, k = qkv[:, head * d:(head + 1) * d], qkv[:, width + head * d:width + (head + 1) * d]
    e = explain(lm, TEXT, "fwd", layer=layer, head=head, query=i, key=j)
    assert e.nope_score == pytest.approx(float(q[i] @ k[j]) / d ** 0.5, abs=1e-5)
    assert e.as_json()["nope_means"] == "the score without the position embedding in the sources"


def test_gpt_oss_s_sink_key_counts_its_learned_sink():
    from attnviz.effects.explain import KeptForward

    lm = loaded("gpt_oss")
    run = KeptForward(lm, TEXT)
    probs = run.probabilities(1, 2)
    sink = float(lm.model.model.layers[1].self_attn.sinks[2].detach())
    part = run.head(1, 2)
    logits = ((part["q"] @ part["k"].T) * part["scale"]).masked_fill(~run.allowed(1), float("-inf"))
    expected = torch.exp(logits) / (torch.exp(logits).sum(-1, keepdim=True) + np.exp(sink))
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)
    assert float(probs.sum(-1).max()) < 1  # the learned sink takes its share of every row


def test_a_latent_attention_is_refused_in_one_line():
    """DeepSeek's multi-head latent attention normalises inside its low-rank projections: its queries and keys are
    not a linear map of the layer input with frozen norms, and the check against the module says so."""
    lm = loaded("deepseek_v3")
    with pytest.raises(InputError, match="deepseek_v3 layer 0's queries and keys are not a linear map") as err:
        explain(lm, TEXT, "fwd", layer=0, head=0, query=5, key=1)
    assert "\n" not in str(err.value)


def test_a_source_s_contribution_is_its_hand_computation():
    lm = loaded("llama")
    ids = lm.tokenizer(TEXT)["input_ids"]
    layer, head, i, j = 2, 1, 12, 0
    _, hidden, parts = stock_scores("llama", layer, ids)
    model = lm.model
    attn, norm = model.model.layers[layer].self_attn, model.model.layers[layer].input_layernorm
    d, kv = attn.head_dim, head // (lm.n_heads // lm.n_kv_heads)
    x = hidden[layer][0]
    inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    cos, sin = model.model.rotary_emb(x[None], torch.arange(len(ids))[None])
    module = importlib.import_module(type(model).__module__)

    def rotated(vec, pos):  # R_pos vec with the model's own rotation
        v = vec.view(1, 1, 1, d)
        out, _ = module.apply_rotary_pos_emb(v, v, cos[:, pos:pos + 1], sin[:, pos:pos + 1])
        return out.flatten()

    with torch.no_grad():
        q = rotated(attn.q_proj(norm(x))[i, head * d:(head + 1) * d], i)
        for name, source in [("embed", hidden[0][0]), ("attn.0", parts["attn.0"]), ("mlp.1", parts["mlp.1"])]:
            k_s = rotated((norm.weight * source[j] * inv_rms[j]) @ attn.k_proj.weight[kv * d:(kv + 1) * d].T, j)
            expected = float(q @ k_s * attn.scaling)
            e = explain(lm, TEXT, "fwd", layer=layer, head=head, query=i, key=j)
            assert e.key_sources[name] == pytest.approx(expected, abs=1e-5), name


def test_the_counterfactual_is_the_unrotated_product_and_all_averages_the_queries():
    lm = loaded("llama")
    ids = lm.tokenizer(TEXT)["input_ids"]
    layer, head, j = 1, 0, 3
    model = lm.model
    attn, norm = model.model.layers[layer].self_attn, model.model.layers[layer].input_layernorm
    _, hidden, _ = stock_scores("llama", layer, ids)
    d, kv = attn.head_dim, head // (lm.n_heads // lm.n_kv_heads)
    with torch.no_grad():
        normed = norm(hidden[layer][0])
        q = attn.q_proj(normed)[:, head * d:(head + 1) * d]
        k = attn.k_proj(normed)[:, kv * d:(kv + 1) * d]
    e = explain(lm, TEXT, "fwd", layer=layer, head=head, query=9, key=j)
    assert e.nope_score == pytest.approx(float(q[9] @ k[j] * attn.scaling), abs=1e-5)
    scores, _, _ = stock_scores("llama", layer, ids)
    every = explain(lm, TEXT, "fwd", layer=layer, head=head, query="all", key=j)
    assert every.queries == len(ids) - j  # FWD: queries j .. n-1 see key j
    assert every.score == pytest.approx(float(scores[head, j:, j].mean()), abs=1e-4)
    assert sum(every.key_sources.values()) == pytest.approx(every.score, abs=1e-4)


def test_the_run_s_own_architecture_and_intervention():
    lm = loaded("llama")
    plain = explain(lm, TEXT, "fwd", layer=2, head=0, query=10, key=1)
    nosink = explain(lm, TEXT, "nosink-fwd", layer=2, head=0, query=10, key=1)
    acted = explain(lm, TEXT, Recipe.of(lm, "fwd", "temperature(t=3)@0-1"), layer=2, head=0, query=10, key=1)
    assert abs(plain.score - nosink.score) > 1e-6 and abs(plain.score - acted.score) > 1e-6
    # layer 0's residual stream is the embeddings under every architecture: the same score
    assert explain(lm, TEXT, "nosink-fwd", layer=0, head=0, query=10, key=1).score == pytest.approx(
        explain(lm, TEXT, "fwd", layer=0, head=0, query=10, key=1).score, abs=1e-6)
    assert nosink.recipe["arch"] == "nosink-fwd" and acted.recipe["intervene"] == "temperature(t=3)@0-1"


@pytest.mark.parametrize("kwargs,message", [
    (dict(layer=3, head=0, query=5, key=1), "layer 3 does not exist"),
    (dict(layer=0, head=4, query=5, key=1), "head 4 does not exist"),
    (dict(layer=0, head=0, query=99, key=1), "query 99 is outside"),
    (dict(layer=0, head=0, query=1, key=5), "is masked"),
])
def test_bad_cells_are_refused(kwargs, message):
    with pytest.raises(InputError, match=message):
        explain(loaded("llama"), TEXT, "fwd", **kwargs)


def test_the_figure_draws_pairs_and_sources():
    from attnviz.figures.why import attribution_figure

    e = explain(loaded("llama"), TEXT, "fwd", layer=2, head=0, query=10, key=0)
    fig = attribution_figure(e)
    assert len(fig.data) == 3 and list(fig.data[0].y) == pytest.approx(e.by_pair)
    assert 0 < e.top_pairs_share(1) <= e.top_pairs_share(4) <= 1
    assert np.isfinite(e.frequencies).all() and e.frequencies[0] > e.frequencies[-1]  # pair 0 turns fastest


def test_cli_explain_contract_and_bad_input(default_model, capsys):
    import json

    from attnviz.cli import main

    args = ["explain", "--text", "The cat sat on the mat.", "--layer", "29", "--head", "3", "--key", "0", "--json"]
    assert main(args + ["--query", "all"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"score", "nope_score", "by_pair", "by_dim", "key_sources", "query_sources", "layer", "head", "query", "key",
            "recipe"} <= set(doc)
    assert doc["query"] == "all" and doc["queries_averaged"] > 1 and len(doc["by_pair"]) * 2 == len(doc["by_dim"]) == 64
    assert sum(doc["by_pair"]) == pytest.approx(doc["score"], abs=1e-3)
    assert sum(doc["key_sources"].values()) == pytest.approx(doc["score"], abs=1e-3)
    assert set(doc["key_sources"]) == {"embed", *(f"{b}.{l}" for l in range(29) for b in ("attn", "mlp"))}
    for bad, message in [(["--layer", "40"], "layer 40 does not exist"), (["--query", "1", "--key", "3"], "masked")]:
        assert main(args[:2] + args[2:] + bad) == 2
        assert message in capsys.readouterr().err


def test_attentionviz_leaves_every_softmax_unchanged_and_equalises_the_norms():
    from attnviz.effects.explain import attentionviz

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(20, 16, generator=gen) * 3 + 1, torch.randn(20, 16, generator=gen) * 0.5 - 2
    q2, k2, c = attentionviz(q, k)
    before, after = torch.softmax(q @ k.T, -1), torch.softmax(q2 @ k2.T, -1)
    assert (before - after).abs().max() < 1e-5 and c > 0
    assert float(q2.norm(dim=-1).mean()) == pytest.approx(float(k2.norm(dim=-1).mean()), rel=1e-5)


def test_the_diagnosis_and_the_query_key_view_of_a_layer():
    from attnviz.effects.explain import KeptForward, diagnose, query_key_view
    from attnviz.figures.why import diagnosis_figure, query_key_figure

    lm = loaded("llama")
    run = KeptForward(lm, TEXT, "fwd")
    d = diagnose(run, 2)
    assert len(d.heads) == lm.n_heads and len(d.key_side) == lm.n_heads and len(d.sources) == 5  # embed + 2 × 2
    for h in d.heads:
        probs = run.probabilities(2, h["head"]).numpy()
        assert h["key"] == int(probs.mean(0).argmax())
        e = run.explain(2, h["head"], "all", h["key"])
        assert h["score"] == pytest.approx(e.score, abs=1e-5)
        assert sum(h["key_split"].values()) == pytest.approx(e.score, abs=1e-4)
        assert h["pair_share"]["1"] <= h["pair_share"]["4"] <= h["pair_share"]["8"] <= 1
    name, count = d.leading()
    assert name in d.sources and 1 <= count <= lm.n_heads
    assert diagnosis_figure(d).data[0].z.shape == (lm.n_heads, 5)
    view = query_key_view(run, 2, 1)
    assert len(view.points) == 2 * run.n_tokens and 0 <= view.sink_key < run.n_tokens
    fig = query_key_figure(view)
    assert [t.type for t in fig.data] == ["scatter", "scatter", "scatter"]  # SVG below 2,000 points
    assert [t.name for t in fig.data[:2]] == ["queries", "keys"]  # the legend's words


def test_the_query_key_view_pools_several_texts_and_keeps_every_softmax():
    from attnviz.effects.explain import KeptForward, attentionviz, corpus_samples, query_key_view
    from attnviz.figures.why import query_key_figure

    lm = loaded("llama")
    samples = corpus_samples(lm, 2, tokens=20)
    assert len(samples) == 2 and all(samples)
    runs = [KeptForward(lm, TEXT)] + [KeptForward(lm, t) for t in samples]
    view = query_key_view(runs, 1, 2)
    sizes = [r.n_tokens for r in runs]
    assert view.n == sum(sizes) and len(view.points) == 2 * view.n and view.samples.count(2) == sizes[2]
    for s, run in enumerate(runs):  # each text's sink key, as an index into the pooled tokens
        kind, sample, position = view.where(view.n + view.sink_keys[s])
        assert (kind, sample, position) == ("key", s, run.sink_key(1, 2))
    assert view.where(sizes[0] + 3) == ("query", 1, 3)
    # the pooled transform keeps each text's rows: the translation uses the pooled means
    q = torch.cat([r.head(1, 2)["q"] for r in runs])
    k = torch.cat([r.head(1, 2)["k"] for r in runs])
    q2, k2, _ = attentionviz(q, k)
    assert (torch.softmax(q @ k.T, -1) - torch.softmax(q2 @ k2.T, -1)).abs().max() < 1e-5
    fig = query_key_figure(view)
    assert "3 texts pooled" in fig.layout.title.text and len(fig.data[2].x) == 3  # three sink keys ringed


def test_t_sne_is_an_option_and_a_missing_projection_library_is_one_line(monkeypatch):
    from attnviz.effects.explain import KeptForward, project, query_key_view

    run = KeptForward(loaded("llama"), TEXT)
    pytest.importorskip("sklearn")
    view = query_key_view(run, 2, 1, "tsne")
    again = query_key_view(run, 2, 1, "tsne")
    assert view.method == "tsne" and len(view.points) == 2 * run.n_tokens and view.points == again.points  # seeded
    with pytest.raises(InputError, match="unknown projection 'mds'"):
        project(torch.zeros(4, 3), "mds")
    import builtins

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "umap" else real(name, *a, **k))
    with pytest.raises(InputError, match="needs umap-learn, which is not installed"):
        query_key_view(run, 2, 1, "umap")


def test_an_attention_row_figure_marks_the_explained_key():
    from attnviz.effects.explain import KeptForward
    from attnviz.figures.why import attention_row_figure

    run = KeptForward(loaded("llama"), TEXT)
    row = run.probabilities(2, 1)[12]
    fig = attention_row_figure(row.numpy(), list(run.tokens), 12, 0)
    assert list(fig.data[0].y) == pytest.approx(row.tolist()) and fig.data[0].marker.color[0] == "#c0392b"
    assert sum(fig.data[0].y) == pytest.approx(1.0, abs=1e-5) and fig.data[0].y[13] == 0  # causal: no later key


def test_the_why_page_opens_at_a_cell_and_a_query_click_updates_it(default_model, tmp_path):
    from test_app import app_test, charts, on_page, texts

    at = app_test(tmp_path)
    at.run()
    at.query_params.update({"layer": "29", "head": "3", "query": "all", "key": "0"})
    on_page(at, "pages/why.py")
    assert not at.exception and not at.error, texts(at.error)
    assert at.slider(key="why_layer").value == 29 and at.selectbox(key="why_head").value == 3
    figures = charts(at)
    titles = [str(f["layout"].get("title", {}).get("text", "")) for f in figures]
    assert any("layer 29 head 3, all" in t for t in titles) and any("sink-key score" in t for t in titles)
    assert any("AttentionViz" in t for t in titles)
    from attnviz.effects.explain import explain

    expected = explain(default_model, at.session_state["text"], "fwd", layer=29, head=3, query="all", key=0)
    bars = next(f for f in figures if "layer 29 head 3, all" in str(f["layout"]["title"]["text"]))["data"][0]
    np.testing.assert_allclose(bars["y"], expected.by_pair, atol=1e-5)
    at.selectbox(key="why_query").set_value(5).run()  # the same path as a click on query 5 in the picture
    titles = [str(f["layout"].get("title", {}).get("text", "")) for f in charts(at)]
    assert not at.exception and any("query 5 → key 0" in t for t in titles)
    assert any("the attention row of query 5" in t for t in titles)  # the picked query's row beside its attribution
    at.slider(key="why_pool").set_value(2).run()  # two corpus samples pooled into the query-key view
    assert not at.exception and not at.error, texts(at.error)
    assert any("3 texts pooled" in str(f["layout"].get("title", {}).get("text", "")) for f in charts(at))
    at.session_state["why_clicked"] = (1, 5)  # what a click on query 5 of the first pooled text leaves
    at.run()
    titles = [str(f["layout"].get("title", {}).get("text", "")) for f in charts(at)]
    assert not at.exception and any("the attention row of query 5 of pooled text 1" in t for t in titles)
    assert sum("head 3, query 5 →" in t for t in titles) == 2  # the page's text's query 5, and the pooled text's


def test_the_sweep_s_explain_measure_names_each_layer_s_leading_source():
    from attnviz.effects.explain import KeptForward, diagnose
    from attnviz.sweep import measures
    from attnviz.sweep.spec import Cell, parse

    lm = loaded("llama")
    grid = parse('models = ["default"]\narchs = ["fwd"]\n[measures.explain]\nmax_tokens = 40\n')
    assert grid.cells()[0].options == {"max_tokens": 40}
    cell = Cell("explain", "tiny", "fwd", "", "stdlib:specialnames", {"max_tokens": 40})
    rows = measures.explain(lm, cell)
    assert [r["layer"] for r in rows] == [0, 1, 2] and set(rows[0]) == set(measures.COLUMNS["explain"])
    from attnviz.effects.evaluate import token_ids

    text = lm.tokenizer.decode(token_ids(lm, measures.documents(cell.corpus).text, 40))
    d = diagnose(KeptForward(lm, text, "fwd"), 2)
    assert rows[2]["top_source"] == d.leading()[0] and rows[2]["top_heads"] == d.leading()[1]


def test_the_why_page_tests_a_source(default_model, tmp_path):
    """"Test it" patches the source picked beside the head's attribution (by default the block adding most to the
    score on the key side) at the sink token: the page's chart and perplexity are the causal check's own numbers,
    and any other source can be tested the same way."""
    from test_app import app_test, charts, on_page, texts

    from attnviz.effects import causal

    at = app_test(tmp_path)
    at.run()
    at.query_params.update({"layer": "29", "head": "3", "query": "all", "key": "0"})
    on_page(at, "pages/why.py")
    assert not at.exception and not at.error, texts(at.error)
    picker = at.selectbox(key="why_test_source")
    expected = explain(default_model, at.session_state["text"], "fwd", layer=29, head=3, query="all", key=0)
    ranked = [s for s, _ in sorted(expected.key_sources.items(), key=lambda kv: -abs(kv[1])) if causal.patchable(s)]
    assert picker.value == ranked[0] and list(picker.options) == ranked
    at.button(key="why_test").click().run()
    assert not at.exception and not at.error, texts(at.error)
    [check] = causal.check(default_model, at.session_state["text"], "fwd", [ranked[0]])
    figure = next(f for f in charts(at) if "Attention on the sink key" in str(f["layout"]["title"]["text"]))
    np.testing.assert_allclose(figure["data"][0]["y"], check.before.attention, atol=1e-6)
    np.testing.assert_allclose(figure["data"][1]["y"], check.after.attention, atol=1e-6)
    assert f"{check.after.perplexity:.3f}" in [m.value for m in at.metric]
    other = ranked[1]
    at.selectbox(key="why_test_source").set_value(other).run()
    at.button(key="why_test").click().run()
    titles = [str(f["layout"].get("title", {}).get("text", "")) for f in charts(at)]
    assert not at.exception and any(f"with {other}'s write at the sink token removed" in t for t in titles)
