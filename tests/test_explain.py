"""Score attribution (docs/methods.md#score-attribution) against direct computations that do not use the
attnviz engine: stock transformers with hooks on q_proj / k_proj and on each block's output, the rotary
rotation applied with the model's own apply_rotary_pos_emb."""

import importlib

import numpy as np
import pytest
import torch

from attnviz.effects.explain import explain
from attnviz.errors import InputError

from tiny import build, loaded

TEXT = "The keeper lit the lamp, and ships passed the rocks."


def stock_scores(kind, layer, ids):
    """(H, n, n) scaled pre-softmax scores of ``layer`` from stock eager hooks, and the stock residual
    stream's parts: embeddings, each earlier block's attention and MLP outputs."""
    model = build(kind)
    module = importlib.import_module(type(model).__module__)
    attn = model.model.layers[layer].self_attn
    got, parts = {}, {}
    hooks = [attn.q_proj.register_forward_hook(lambda m, a, o: got.__setitem__("q", o)),
             attn.k_proj.register_forward_hook(lambda m, a, o: got.__setitem__("k", o))]
    for l in range(layer):
        block = model.model.layers[l]
        hooks.append(block.self_attn.register_forward_hook(lambda m, a, o, l=l: parts.__setitem__(f"attn.{l}", o[0][0])))
        hooks.append(block.mlp.register_forward_hook(lambda m, a, o, l=l: parts.__setitem__(f"mlp.{l}", o[0])))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        n, d = len(ids), attn.head_dim
        q = got["q"].view(1, n, -1, d).transpose(1, 2)
        k = got["k"].view(1, n, -1, d).transpose(1, 2)
        cos, sin = model.model.rotary_emb(out.hidden_states[layer], torch.arange(n)[None])
        q, k = module.apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores = (q @ k.transpose(-1, -2))[0] * attn.scaling
    for hook in hooks:
        hook.remove()
    return scores, out.hidden_states, parts


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_the_score_and_its_parts_match_stock_transformers(kind):
    lm = loaded(kind)
    ids = lm.tokenizer(TEXT)["input_ids"]
    layer, head, i, j = 2, 3, 17, 4
    scores, _, _ = stock_scores(kind, layer, ids)
    e = explain(lm, TEXT, "fwd", layer=layer, head=head, query=i, key=j)
    assert e.score == pytest.approx(float(scores[head, i, j]), abs=1e-4)
    assert sum(e.by_pair) == pytest.approx(e.score, abs=1e-4) and sum(e.by_dim) == pytest.approx(e.score, abs=1e-4)
    assert len(e.by_pair) * 2 == len(e.by_dim) == lm.model.model.layers[0].self_attn.head_dim
    assert sum(e.key_sources.values()) == pytest.approx(e.score, abs=1e-4)
    assert sum(e.query_sources.values()) == pytest.approx(e.score, abs=1e-4)
    assert set(e.key_sources) >= {"embed", "attn.0", "mlp.0", "attn.1", "mlp.1"}
    assert ("bias" in e.key_sources) == (kind == "qwen2")  # Qwen2's q/k projections carry a bias


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
    acted = explain(lm, TEXT, "fwd", intervene="temperature(t=3)@0-1", layer=2, head=0, query=10, key=1)
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
    with pytest.raises(InputError, match="gpt2, whose norm"):
        explain(loaded("gpt2"), TEXT, "fwd", layer=0, head=0, query=5, key=1)


def test_the_figure_draws_pairs_and_sources():
    e = explain(loaded("llama"), TEXT, "fwd", layer=2, head=0, query=10, key=0)
    fig = e.figure()
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
    from attnviz.effects.explain import Residual, diagnose, query_key_view
    from attnviz.figures.why import diagnosis_figure, query_key_figure

    lm = loaded("llama")
    run = Residual(lm, TEXT, "fwd")
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
    assert not at.exception and any("query 5 → key 0" in str(f["layout"].get("title", {}).get("text", ""))
                                    for f in charts(at))


def test_the_sweep_s_explain_measure_names_each_layer_s_leading_source():
    from attnviz.effects.explain import Residual, diagnose
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
    d = diagnose(Residual(lm, text, "fwd"), 2)
    assert rows[2]["top_source"] == d.leading()[0] and rows[2]["top_heads"] == d.leading()[1]
