"""Routes (docs/methods.md#routes): the graph on a hand-made flow, the sink's share, the CLI's contract against a
direct computation from stock hooks on the default model, the logit lens against the model's own logits, and the
sweep measure."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from attnviz import flow
from attnviz.errors import InputError
from attnviz.flow.trace import Flow, LayerFlow

TEXT = "The capital of France is Paris. The capital of Italy is"


def _layer(residual, entries, mlp, mlp_residual, parallel=False):
    index = np.array([[i, j, h] for i, j, h, _ in entries], np.int32).reshape(-1, 3)
    weight = np.array([w for *_, w in entries], np.float32)
    summed: dict = {}
    for i, j, _, w in entries:
        summed[i, j] = summed.get((i, j), 0.0) + w
    return LayerFlow(np.array(residual, np.float32), index, weight,
                     np.array(list(summed), np.int32).reshape(-1, 2), np.array(list(summed.values()), np.float32),
                     np.array(mlp, np.float32), np.array(mlp_residual, np.float32), parallel)


def hand_made() -> Flow:
    """Three tokens, two layers, two heads. Layer 1 (top): token 2 reads token 0 through head 0 (0.5) and token 1
    through head 1 (0.03, below τ); layer 0: token 0 only its residual, token 2 reads token 0 through head 1."""
    top = _layer([0.9, 0.8, 0.47], [(2, 0, 0, 0.5), (2, 1, 1, 0.03), (1, 0, 0, 0.2)], [0.1, 0.3, 0.6], [0.9, 0.7, 0.4])
    bottom = _layer([1.0, 0.6, 0.5], [(1, 0, 1, 0.4), (2, 0, 1, 0.3), (2, 2, 0, 0.2)], [0.02, 0.5, 0.05],
                    [0.98, 0.5, 0.95])
    return Flow(["a", "b", "c"], [1, 2, 3], None, "fwd", 2, [0, 0], [bottom, top], np.zeros((5, 3, 4), np.float32))


def test_the_graph_of_a_hand_made_flow():
    g = flow.graph(hand_made(), -1, 0.04)
    got = {(e.layer, e.via, e.block, e.head, e.source, e.target, round(e.weight, 4)) for e in g.edges}
    assert got == {
        (1, "mlp", "mlp", None, 2, 2, 0.6), (1, "residual", "mlp", None, 2, 2, 0.4),
        (1, "attn", "attn", 0, 0, 2, 0.5), (1, "residual", "attn", None, 2, 2, 0.47),  # head 1's 0.03 is below τ
        # layer 0: the nodes kept below layer 1's attention are tokens 0 and 2
        (0, "residual", "mlp", None, 0, 0, 0.98), (0, "residual", "mlp", None, 2, 2, 0.95), (0, "mlp", "mlp", None, 2, 2, 0.05),
        (0, "residual", "attn", None, 0, 0, 1.0), (0, "residual", "attn", None, 2, 2, 0.5),
        (0, "attn", "attn", 1, 0, 2, 0.3), (0, "attn", "attn", 0, 2, 2, 0.2),
    }
    assert g.sink_share() == pytest.approx([0.3 / 0.5, 1.0])
    assert (0, "mlp", 1) not in g.nodes() and (-1, "mlp", 0) in g.nodes()
    # every query, not only the graph's: layer 1 keeps 0.5 and 0.2 (both from key 0); layer 0 0.4 + 0.3 of 0.9
    assert flow.sink_share_all(g.flow, 0.04) == pytest.approx([0.7 / 0.9, 1.0])
    summed = flow.graph(hand_made(), 2, 0.04, heads="sum")
    assert {(e.layer, e.head, e.source, round(e.weight, 4)) for e in summed.edges if e.via == "attn"} == {
        (1, None, 0, 0.5), (0, None, 0, 0.3), (0, None, 2, 0.2)}
    high = flow.graph(hand_made(), -1, 0.55)
    assert [(e.layer, e.via) for e in high.edges] == [(1, "mlp")] and high.sink_share() == [None, None]


def test_a_parallel_blocks_mlp_edge_starts_below_its_attention():
    f = hand_made()
    f.layers[1].parallel = True
    g = flow.graph(f, -1, 0.04)
    mlp = next(e for e in g.edges if e.layer == 1 and e.via == "mlp")
    assert mlp.levels == ((0, "mlp"), (1, "mlp"))
    assert (0, "mlp", 2) in g.nodes()


def test_renormalising_matches_the_llm_transparency_tools_own_test():
    """The LLM Transparency Tool's renormalising-threshold test, rebuilt by hand: two representations (here one
    layer's attention into tokens 0 and 1), two blocks each (here two heads reading token 0) with contributions
    0.05, 0.15 and 0.05, 0.05, residuals 0.8 and 0.9; at τ = 0.1 it expects 0.157894 and 0.842105 for the first, 1.0
    for the second's residual, every other entry 0 (cut)."""
    layer = _layer([0.8, 0.9], [(0, 0, 0, 0.05), (0, 0, 1, 0.15), (1, 0, 0, 0.05), (1, 0, 1, 0.05)], [0.0, 0.0],
                   [1.0, 1.0])
    made = Flow(["a", "b"], [1, 2], None, "fwd", 2, [0], [layer], np.zeros((3, 2, 4), np.float32))

    def attention(token, renormalise):
        g = flow.graph(made, token, 0.1, renormalise=renormalise)
        return {(e.via, e.head): e.weight for e in g.edges if e.block == "attn"}

    assert attention(0, True) == {("attn", 1): pytest.approx(0.157894, abs=1e-6),
                                  ("residual", None): pytest.approx(0.842105, abs=1e-6)}
    assert attention(1, True) == {("residual", None): pytest.approx(1.0)}
    assert attention(0, False) == {("attn", 1): pytest.approx(0.15), ("residual", None): pytest.approx(0.8)}
    assert attention(1, False) == {("residual", None): pytest.approx(0.9)}


def test_renormalising_keeps_the_same_edges_and_each_nodes_sum_to_one():
    plain, renormalised = flow.graph(hand_made(), -1, 0.04), flow.graph(hand_made(), -1, 0.04, renormalise=True)
    assert not plain.renormalise and renormalised.renormalise
    node = lambda e: (e.layer, e.block, e.target)  # noqa: E731
    totals: dict = {}
    for e in plain.edges:
        totals[node(e)] = totals.get(node(e), 0.0) + e.weight
    assert [(e.layer, e.via, e.head, e.source, e.target) for e in renormalised.edges] == \
        [(e.layer, e.via, e.head, e.source, e.target) for e in plain.edges]
    for p, r in zip(plain.edges, renormalised.edges):
        assert r.weight == pytest.approx(p.weight / totals[node(p)])
    # layer 1's attention into token 2: head 0 from token 0 (0.5) and the residual (0.47); head 1's 0.03 is cut
    top = {(e.via, e.head): e.weight for e in renormalised.edges if (e.layer, e.block) == (1, "attn")}
    assert top == pytest.approx({("attn", 0): 0.5 / 0.97, ("residual", None): 0.47 / 0.97})
    # the heads summed, then cut at τ = 0.25, then divided: layer 0 into token 2 keeps 0.3 from token 0 (0.2 from
    # token 2 is cut) and its residual 0.5
    summed = flow.graph(hand_made(), -1, 0.25, heads="sum", renormalise=True)
    bottom = {(e.via, e.source): e.weight for e in summed.edges if (e.layer, e.block, e.target) == (0, "attn", 2)}
    assert bottom == pytest.approx({("attn", 0): 0.3 / 0.8, ("residual", 2): 0.5 / 0.8})


def test_the_token_labels_of_two_graphs_of_48_tokens_can_be_read():
    """Measured on the figure: in a 700 px figure (Streamlit's narrowest column), neighbouring slanted labels sit at
    least one label's footprint apart (its font size over the sine of its angle), none is blank (whitespace as
    escapes), none is long, and the legend sits at the figure's foot, below them."""
    import math

    from attnviz.figures import routes_figure

    n = 48
    tokens = ["\n"] + [" the", "\t", " ", "Paris", " supercalifragilistic"] * 9 + ["."] * 2
    layer = _layer([0.5] * n, [(n - 1, 0, 0, 0.5)], [0.5] * n, [0.5] * n)
    made = Flow(tokens, list(range(n)), None, "fwd", 1, [0], [layer], np.zeros((3, n, 4), np.float32))
    g = flow.graph(made, -1, 0.04)
    fig = routes_figure([g, g], ["fwd", "nosink-fwd"])
    width = 700 - fig.layout.margin.l - fig.layout.margin.r
    for axis in (fig.layout.xaxis, fig.layout.xaxis2):
        ticks, labels = list(axis.tickvals), list(axis.ticktext)
        panel = width * (axis.domain[1] - axis.domain[0])
        gap = panel * min(np.diff(ticks)) / (axis.range[1] - axis.range[0])
        footprint = axis.tickfont.size / math.sin(math.radians(abs(axis.tickangle)))
        assert gap >= footprint, (len(ticks), gap, footprint)
        assert all(label.strip() and len(label) <= 10 for label in labels), labels
        assert labels[0] == "0 \\n" and "8 ␣" in labels  # a newline and a space as escapes
    assert fig.layout.legend.yref == "container" and fig.layout.legend.y == 0


@pytest.mark.parametrize("threshold,heads,token,message", [
    (0.001, "split", -1, "between 0.005 and 1"), (0.04, "all", -1, "'split'"), (0.04, "split", 3, "tokens 0..2")])
def test_bad_graph_options_are_refused(threshold, heads, token, message):
    with pytest.raises(InputError, match=message):
        flow.graph(hand_made(), token, threshold, heads)


def run(*args):
    return subprocess.run([sys.executable, "-m", "attnviz", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=600)


def test_the_cli_prints_the_contract_and_its_edges_equal_stock_hooks(default_model):
    from transformers import AutoModelForCausalLM

    from test_flow import stock

    out = run("routes", "--text", TEXT, "--token", "-1", "--threshold", "0.04", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert set(doc) >= {"tokens", "token", "threshold", "edges", "sink_share", "recipe"}
    n, L = len(doc["tokens"]), default_model.n_layers
    assert doc["token"] == n - 1 and doc["threshold"] == 0.04 and len(doc["sink_share"]) == L
    assert doc["recipe"]["arch"] == "fwd"
    assert all(set(e) >= {"layer", "via", "head", "from", "to", "weight"} for e in doc["edges"])
    assert {e["via"] for e in doc["edges"]} == {"attn", "mlp", "residual"}
    model = AutoModelForCausalLM.from_config(default_model.model.config, attn_implementation="eager",
                                             dtype=torch.float32)
    model.load_state_dict(default_model.model.state_dict())
    ids = default_model.tokenizer(TEXT)["input_ids"]
    expected = stock(model.eval(), ids, "llama")
    attn = [e for e in doc["edges"] if e["via"] == "attn"]
    assert {e["layer"] for e in attn} and all(e["head"] is not None for e in attn)
    for e in attn:
        assert e["weight"] == pytest.approx(float(expected[e["layer"]][1][e["to"], e["from"], e["head"]]), abs=1e-4)
    for layer in range(L):  # complete: every stock contribution at or above τ into the layer's kept queries is there
        targets = {e["to"] for e in doc["edges"] if e["layer"] == layer and e["block"] == "attn"}
        heads = expected[layer][1].numpy()
        want = {(q, k, h) for q in targets for k, h in zip(*np.nonzero(heads[q] >= 0.04 + 1e-4))}
        have = {(e["to"], e["from"], e["head"]) for e in attn if e["layer"] == layer}
        assert want <= have, layer
    share = [s for s in doc["sink_share"] if s is not None]
    assert share and all(0 <= s <= 1 for s in share)
    assert doc["renormalise"] is False
    # --renormalise: the same edges, each node's divided by their sum
    again = run("routes", "--text", TEXT, "--token", "-1", "--threshold", "0.04", "--renormalise", "--json")
    assert again.returncode == 0, again.stderr
    renormalised = json.loads(again.stdout)
    assert renormalised["renormalise"] is True
    node = lambda e: (e["layer"], e["block"], e["to"])  # noqa: E731
    totals: dict = {}
    for e in doc["edges"]:
        totals[node(e)] = totals.get(node(e), 0.0) + e["weight"]
    assert len(renormalised["edges"]) == len(doc["edges"])
    for plain, r in zip(doc["edges"], renormalised["edges"]):
        assert {k: v for k, v in r.items() if k != "weight"} == {k: v for k, v in plain.items() if k != "weight"}
        assert r["weight"] == pytest.approx(plain["weight"] / totals[node(plain)], abs=1e-5)


@pytest.mark.parametrize("args,message", [
    (["--threshold", "0.001"], "between 0.005 and 1"), (["--token", "999"], "does not exist"),
    (["--intervene", "nosuch(x=1)"], "unknown intervention")])
def test_the_cli_refuses_bad_input_in_one_line(args, message, model_cache):
    out = run("routes", "--text", "Hello there", *args)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_a_token_the_text_lacks_is_refused_before_the_model_runs(monkeypatch):
    """``routes`` checks its token against the text's tokens before any layer runs (its progress would otherwise be
    printed before the refusal: two lines)."""
    import importlib

    import tiny

    trace_mod = importlib.import_module("attnviz.flow.trace")  # the module (attnviz.flow.trace is also its function)

    def no_forward(*args, **kwargs):
        raise AssertionError("the model ran")

    monkeypatch.setattr(trace_mod, "_Tracer", no_forward)
    with pytest.raises(InputError, match="token 999 does not exist: the text has tokens 0..") as refused:
        flow.routes(tiny.loaded("llama"), "Hello there", token=999)
    assert "the model ran" not in str(refused.value)


def test_the_lens_at_the_top_is_the_models_own_prediction(default_model):
    traced = flow.trace(default_model, TEXT)
    reading = flow.lens(default_model, traced, traced.n_layers - 1, "mlp", traced.n_tokens - 1)
    with torch.no_grad():
        logits = default_model.model(torch.tensor([traced.token_ids])).logits[0, -1]
    top = logits.topk(8).indices
    assert [t for t, _ in reading.promoted] == [default_model.tokenizer.decode([int(i)]) for i in top]
    np.testing.assert_allclose([v for _, v in reading.promoted], logits[top].numpy(), rtol=1e-4, atol=1e-3)
    assert reading.suppressed[0][1] == pytest.approx(float(logits.min()), rel=1e-4)
    write = flow.lens(default_model, traced, 5, "attn", 3, write=True)
    assert write.promoted[0][1] > write.suppressed[0][1] and "write" in write.what
    with pytest.raises(InputError, match="no node"):
        flow.lens(default_model, traced, -1, "attn", 0)


def test_the_sweep_measure_gives_the_sink_share_per_layer(default_model):
    from attnviz.sweep import measures
    from attnviz.sweep.spec import Cell

    rows = measures.routes(default_model, Cell("routes", "default", "fwd", "", "stdlib",
                                               {"max_tokens": 48, "threshold": 0.04}))
    assert len(rows) == default_model.n_layers and set(rows[0]) == set(measures.COLUMNS["routes"])
    assert all(r["key"] == 0 for r in rows)
    assert any(r["sink_share_all"] is not None and r["sink_share_all"] > 0 for r in rows)


def test_under_nosink_the_sink_key_moves_and_interventions_are_applied(default_model):
    plain = flow.trace(default_model, TEXT)
    nosink = flow.trace(default_model, TEXT, "nosink-fwd")
    assert set(nosink.sink_keys) == {1}
    # key 0 is masked for every later query in every layer: only token 0 itself reads it
    assert not any(((layer.attn_index[:, 1] == 0) & (layer.attn_index[:, 0] > 0)).any() for layer in nosink.layers)
    from attnviz.recipe import Recipe

    head = int(np.bincount(plain.layers[3].attn_index[:, 2]).argmax())  # the head with the most edges there
    ablated = flow.trace(default_model, TEXT, Recipe.of(default_model, "fwd", f"ablate(heads={head})@3"))
    assert ablated.layers[3].replaced == ablated.n_tokens  # its outputs at every query: no token edges
    assert not (ablated.layers[3].attn_index[:, 2] == head).any()
    assert ablated.layers[2].replaced == 0
