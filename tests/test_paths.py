"""Path patching between blocks (docs/methods.md#path-patching): a path's effect equals a stock forward with
hand-written hooks that remove the sender's write from that receiver's input alone (tiny Gemma 3 and the default
model); removing a sender from every receiver above it at once equals the causal scan's removal of it (several
families, zero and mean); bad input in one line; the CLI's contract; the Why page's section."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

import tiny
from attnviz.cli import main
from attnviz.core.model import anatomy
from attnviz.effects import causal
from attnviz.effects.paths import paths, receivers_of, removal
from attnviz.errors import InputError

TEXT = "The keeper lit the lamp. The ships passed the rocks, and the keeper slept."


def _get(module, path):
    for part in path.split("."):
        module = getattr(module, part)
    return module


@torch.no_grad()
def _by_hand(model, ids, write_module, receiver, sink, layers, norms):
    """The sink's attention per layer (stock eager maps: the mean over heads of the mean of key ``sink``'s column over
    the queries that see it, a sliding window's included) and the perplexity, with the sender's write (read by a hook on ``write_module``'s
    output) removed at the sink token from the receiver's input alone: a pre-hook on the block's pre-norm, or for
    keys and queries on the projection, fed norm(stream − write) at the token; the head: the last layer's output."""
    seen = {}
    handles = [write_module.register_forward_hook(
        lambda m, args, out: seen.__setitem__("write", (out[0] if isinstance(out, tuple) else out)[0, sink].clone()))]
    kind, layer = ("head", len(layers) - 1) if receiver == "head" else receiver.split(".")
    block = layers[int(layer)]
    if kind in ("attn", "mlp"):
        def minus(m, args):
            x = args[0].clone()
            x[0, sink] -= seen["write"]
            return (x, *args[1:])
        handles.append(_get(block, norms[kind]).register_forward_pre_hook(minus))
    elif kind == "head":
        def out_minus(m, args, out):
            x = (out[0] if isinstance(out, tuple) else out).clone()
            x[0, sink] -= seen["write"]
            return (x, *out[1:]) if isinstance(out, tuple) else x
        handles.append(block.register_forward_hook(out_minus))
    else:
        norm = _get(block, norms["attn"])
        handles.append(block.register_forward_pre_hook(lambda m, args: seen.__setitem__("stream", args[0])))

        def proj(m, args):
            x = args[0].clone()
            x[0, sink] = norm(seen["stream"][0, sink][None] - seen["write"])[0]
            return (x, *args[1:])
        handles.append(_get(block, f"self_attn.{kind[0]}_proj").register_forward_pre_hook(proj))
    try:
        out = model(ids, output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    config = model.config
    windows = [config.sliding_window if kind == "sliding_attention" else None
               for kind in getattr(config, "layer_types", None) or [None] * len(layers)]
    attention = [float(a[0, :, sink:sink + (w or a.shape[-1]), sink].mean(-1).mean())  # the queries that see it
                 for a, w in zip(out.attentions, windows)]
    nll = torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), ids[0, 1:])
    return attention, float(torch.exp(nll))


GEMMA_NORMS = {"attn": "input_layernorm", "mlp": "pre_feedforward_layernorm"}


@pytest.mark.parametrize("receiver", ["attn.1", "mlp.1", "keys.1", "keys.2", "queries.2", "head"])
def test_a_path_equals_hand_written_hooks_on_stock_transformers(receiver):
    """Tiny Gemma 3 (pre- and post-norms, a scaled embedding, q/k norms): MLP 0's write at the sink token removed from
    one receiver; the effect is measurable (above the tolerance) except through the sink token's own query, which
    under a causal mask sees key 0 alone: that path changes nothing, exactly."""
    lm = tiny.loaded("gemma3_text")
    stock = tiny.build("gemma3_text", "eager")
    found = paths(lm, TEXT, "fwd", "mlp.0", receiver)
    sink = found.before.keys[0]
    ids = torch.tensor([lm.tokenizer(TEXT)["input_ids"]])
    layers = stock.model.layers
    attention, ppl = _by_hand(stock, ids, layers[0].post_feedforward_layernorm, receiver, sink, layers, GEMMA_NORMS)
    after = found.after["mlp.0", receiver]
    np.testing.assert_allclose(after.attention, attention, atol=1e-4)
    assert after.perplexity == pytest.approx(ppl, rel=1e-4)
    moved = max(abs(a - b) for a, b in zip(after.attention, found.before.attention))
    if receiver.startswith("queries."):
        assert moved == 0 and after.perplexity == found.before.perplexity
    elif receiver != "head":  # the head reads the top layer's output: no attention above it
        assert moved > 1e-3


@pytest.mark.parametrize("receiver", ["mlp.11", "keys.12", "attn.12"])
def test_a_path_on_the_default_model_equals_hand_written_hooks(default_model, receiver):
    """SmolLM2: MLP 0's write removed from MLP 11's input alone, from layer 12's keys alone, from its attention's
    input alone, against stock eager with hooks written here."""
    from pydoc_data.topics import topics

    text = topics["specialnames"][:400]
    found = paths(default_model, text, "fwd", "mlp.0", receiver)
    model = default_model.model
    ids = torch.tensor([default_model.tokenizer(text)["input_ids"]])
    norms = {"attn": "input_layernorm", "mlp": "post_attention_layernorm"}
    model.set_attn_implementation("eager")
    try:
        attention, ppl = _by_hand(model, ids, model.model.layers[0].mlp, receiver, found.before.keys[0],
                                  model.model.layers, norms)
    finally:
        model.set_attn_implementation("attnviz")
    after = found.after["mlp.0", receiver]
    np.testing.assert_allclose(after.attention, attention, atol=1e-4)
    assert after.perplexity == pytest.approx(ppl, rel=1e-4)


@pytest.mark.parametrize("value", ["zero", "mean"])
@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "gpt_neox", "granite", "olmo2", "phi", "gpt2"])
def test_removing_a_sender_from_every_receiver_is_the_scan_s_removal(kind, value):
    lm = tiny.loaded(kind)
    found = causal.scan(lm, TEXT, "fwd", value, leaders=False)
    parallel = kind in ("gpt_neox", "phi")
    for sender in ("embed", "attn.0", "mlp.1"):
        every = [r for r in receivers_of(sender, lm.n_layers, parallel) if not r.startswith(("keys.", "queries."))]
        together = removal(lm, TEXT, sender, every, value=value)
        assert removal(lm, TEXT, sender, "all", value=value) == together
        scanned = next(c for c in found.checks if c.source == sender)
        np.testing.assert_allclose(together.attention, scanned.after.attention, atol=1e-5, err_msg=sender)
        assert together.perplexity == pytest.approx(scanned.after.perplexity, rel=1e-5), sender


@pytest.mark.parametrize("arch,intervene", [("nosink-fwd", None), ("fwd", "temperature(t=2)@1; ablate(heads=1)@0"),
                                             ("mask0-fwd(k=1)", "sinkscale(beta=0.3)@2")])
def test_the_paths_run_under_a_recipe(arch, intervene):
    """Under an architecture and interventions: the sink key is the recipe's, and every receiver at once is the
    scan's removal under the same recipe."""
    from attnviz.recipe import Recipe

    lm = tiny.loaded("gemma3_text")
    recipe = Recipe.of(lm, arch, intervene)
    found = paths(lm, TEXT, recipe, "mlp.0", "attn.1,keys.2,all")
    scanned = next(c for c in causal.scan(lm, TEXT, recipe, leaders=False).checks if c.source == "mlp.0")
    assert found.before.keys == scanned.before.keys
    np.testing.assert_allclose(found.after["mlp.0", "all"].attention, scanned.after.attention, atol=1e-5)
    if arch == "nosink-fwd":  # NoSink-FWD's sink key in the full layer (the windowed ones have none: NaN)
        assert found.before.keys[2] == 1 and np.isnan(found.before.attention[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_paths_in_half_precision_follow_float32(dtype):
    lm, half = tiny.loaded("gemma3_text"), tiny.loaded("gemma3_text")
    half.model.to(dtype)
    low = paths(half, TEXT, "fwd", "mlp.0", "attn.1,keys.2,mlp.1,head,all")
    full = paths(lm, TEXT, "fwd", "mlp.0", "attn.1,keys.2,mlp.1,head,all")
    for key, profile in full.after.items():
        np.testing.assert_allclose(low.after[key].attention, profile.attention, atol=2e-2, err_msg=str(key))
        assert low.after[key].perplexity == pytest.approx(profile.perplexity, rel=5e-2)


def test_default_senders_are_the_scan_s_necessary_writers_and_fused_projections_are_said(default_model):
    lm = tiny.loaded("gpt_neox")  # one query_key_value projection: keys and queries are not receivers
    found = paths(lm, TEXT, "fwd", "mlp.0", None)
    assert not any(r.startswith(("keys.", "queries.")) for r in found.receivers("mlp.0"))
    assert "query_key_value" in found.skipped
    with pytest.raises(InputError, match="no projection of the keys alone"):
        paths(lm, TEXT, "fwd", "mlp.0", "keys.1")
    text = "The old lighthouse keeper climbed the stairs every evening. He lit the lamp."
    steps = []
    traced = paths(default_model, text, "fwd", None, "head", on_step=lambda d, t: steps.append((d, t)))
    assert traced.senders == causal.scan(default_model, text, "fwd", leaders=False).necessary
    assert steps[-1][0] == steps[-1][1]


def test_bad_input_is_one_line():
    lm = tiny.loaded("llama")
    with pytest.raises(InputError, match="attn.0 is not above mlp.1"):
        paths(lm, TEXT, "fwd", "mlp.1", "attn.0")
    with pytest.raises(InputError, match="unknown receiver 'ffn.2'"):
        paths(lm, TEXT, "fwd", "mlp.0", "ffn.2")
    with pytest.raises(InputError, match="unknown sender 'keys.0'"):
        paths(lm, TEXT, "fwd", "keys.0", "attn.2")
    with pytest.raises(InputError, match="does not exist"):
        paths(lm, TEXT, "fwd", "mlp.40", "head")
    with pytest.raises(InputError, match="top layer"):
        paths(lm, TEXT, "fwd", "mlp.2", "head")
    with pytest.raises(InputError, match="zero or mean"):
        paths(lm, TEXT, "fwd", "mlp.0", "head", value="resample")


def test_the_cli_prints_every_path(capsys, monkeypatch):
    lm = tiny.loaded("llama")
    monkeypatch.setattr("attnviz.cli.common.load", lambda args: lm)
    assert main(["paths", "--text", TEXT, "--senders", "mlp.0", "--receivers", "attn.1,keys.2,head", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["receiver"] for p in doc["paths"]] == ["attn.1", "keys.2", "head"]
    assert all(p["sender"] == "mlp.0" and len(p["attention_after"]) == lm.n_layers for p in doc["paths"])
    assert len(doc["sink_before"]) == lm.n_layers and doc["value"] == "zero"
    for bad, said in ((["--senders", "mlp.1", "--receivers", "attn.1"], "not above mlp.1"),
                      (["--senders", "mlp.0", "--receivers", "nope.1"], "unknown receiver")):
        assert main(["paths", "--text", TEXT, *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0]


def test_the_figure_has_a_panel_per_sender_and_every_cell_measured():
    from attnviz.figures.why import paths_figure

    lm = tiny.loaded("gemma3_text")
    found = paths(lm, TEXT, "fwd", "embed,mlp.0", None)
    fig = paths_figure(found)
    assert len(fig.data) == 2
    for trace, sender in zip(fig.data, found.senders):
        z = np.array(trace.z, dtype=float)
        reaching = [r for r in found.receivers(sender, single=True) if found.reaches(sender, r)]
        assert np.isfinite(z).sum() == len(reaching) > 0  # not the head, nor the top MLP: no layer above them
        assert np.nanmax(np.abs(z)) > 0


def test_the_why_page_traces_the_paths_and_refuses_a_bad_sender(default_model, tmp_path):
    from test_app import app_test, charts, on_page, texts

    at = app_test(tmp_path)
    at.run()
    at.query_params.update({"layer": "29", "head": "3", "query": "all", "key": "0"})
    on_page(at, "pages/why.py")
    at.text_input(key="why_senders").set_value("mlp.0").run()
    at.button(key="why_paths").click().run()
    assert not at.exception and not at.error, texts(at.error)
    titles = [str(f["layout"]["title"]["text"]) for f in charts(at)]
    figure = next(f for f in charts(at) if "through which receiver" in str(f["layout"]["title"]["text"]))
    assert len(figure["data"]) == 1 and any("the sink's fall when a write is removed" in t for t in titles)
    assert any("**mlp.0** makes the sink most through" in m.value for m in at.markdown)
    # the heatmap's colour bar reads in %, as its hover, bars and sentences do (before: a -1..1 fraction)
    assert figure["data"][0]["colorbar"]["tickformat"] == ".0%" and "%" in figure["data"][0]["hovertemplate"]
    qk = next(f for f in charts(at) if "queries and keys" in str(f["layout"]["title"]["text"]))
    assert {"queries", "keys"} <= {t.get("name") for t in qk["data"]}  # before: "querys"
    at.text_input(key="why_senders").set_value("mlp.99").run()
    at.button(key="why_paths").click().run()
    assert not at.exception and any("does not exist" in e.value for e in at.error)


@pytest.mark.parametrize("kind", tiny.FAMILIES)
def test_the_paths_run_on_every_family_the_anatomy_maps(kind):
    """Every tiny family: the embedding traced to every receiver above it; each path's numbers defined; keys and
    queries receivers wherever the family has their projections of their own, else said why not."""
    lm = tiny.loaded(kind)
    windows = [layer.window for layer in anatomy.of(lm.model).layers]
    # every layer windowed (tiny windows of 4 or 5): a text inside one window has a key every query sees
    text = TEXT[:min(windows) - 1] if all(windows) else TEXT * 3
    found = paths(lm, text, "fwd", "embed", None)
    got = found.receivers("embed", single=True)
    separate = not found.skipped
    groups = ["attn.*", "keys.*", "queries.*", "mlp.*", "all"]
    assert found.receivers("embed", single=False) == [g for g in groups if separate or g[0] in "am"]
    layers = anatomy.of(lm.model).layers
    parallel = any(layer.parallel for layer in layers)
    expected = [r for r in receivers_of("embed", lm.n_layers, parallel)
                if separate or not r.startswith(("keys.", "queries."))]
    assert sorted(got) == sorted(expected)
    assert all(np.isfinite(p.perplexity) for p in found.after.values())
    assert separate == all(hasattr(layer.attn, "k_proj") and hasattr(layer.attn, "q_proj") for layer in layers)


def test_the_sweep_measure_gives_a_row_per_path_and_layer():
    from attnviz.sweep import measures
    from attnviz.sweep.spec import Cell, measure_options

    options = {name: default for name, (_, default) in measure_options()["paths"].items()}
    options.update(senders="embed,mlp.0", max_tokens=60)
    rows = measures.paths(tiny.loaded("gemma3_text"), Cell("paths", "tiny", "fwd", "", "stdlib:specialnames", options))
    assert all(set(r) == set(measures.COLUMNS["paths"]) for r in rows)
    assert {(r["sender"], r["receiver"]) for r in rows} == {(s, g) for s in ("embed", "mlp.0")
                                                             for g in ("attn.*", "keys.*", "queries.*", "mlp.*", "all")}
    assert len(rows) == 2 * 5 * 3
    every = [r for r in rows if r["receiver"] == "all" and r["sender"] == "mlp.0"]
    assert every[0]["sink_drop"] == pytest.approx(
        next(c for c in causal.scan(tiny.loaded("gemma3_text"), _first_tokens(60), "fwd", leaders=False).checks
             if c.source == "mlp.0").drop(), abs=1e-5)


def _first_tokens(n):
    from attnviz.corpus import load, text_of
    from attnviz.effects.evaluate import token_ids

    lm = tiny.loaded("gemma3_text")
    return text_of(lm.tokenizer, token_ids(lm, load("stdlib:specialnames").text, n))


def _stdlib(lm, n=256):
    from attnviz.corpus import load, text_of
    from attnviz.effects.evaluate import token_ids

    return text_of(lm.tokenizer, token_ids(lm, load("stdlib").text, n))


def test_the_readme_s_paths_on_the_default_model(default_model):
    """SmolLM2, the first 256 stdlib tokens: MLP 0 does not act through MLP 11 (the chain's reading); it acts through
    layers 1-10, two ways each enough alone (every attention input, and MLPs 1-2)."""
    found = paths(default_model, _stdlib(default_model), "fwd", "mlp.0",
                  "mlp.11,attn.*,mlp.*,attn.*+mlp.1-2,attn.1-10+mlp.1-10,all")
    drop = {r: found.drop("mlp.0", r) for r in found.receivers("mlp.0")}
    assert abs(drop["mlp.11"]) < 0.02 and drop["attn.*"] < 0.1 and drop["mlp.*"] < 0.15
    assert drop["attn.*+mlp.1-2"] > 0.85 and drop["attn.1-10+mlp.1-10"] > 0.85 and drop["all"] > 0.85


def test_the_readme_s_paths_on_gemma3(gemma3_model):
    """Gemma 3 270M, the same tokens: MLP 1 acts through MLP 2 and MLP 3 together, either enough alone."""
    found = paths(gemma3_model, _stdlib(gemma3_model), "fwd", "mlp.1", "mlp.2,mlp.3,mlp.2-3,attn.*")
    drop = {r: found.drop("mlp.1", r) for r in found.receivers("mlp.1")}
    assert drop["mlp.2"] < 0.05 and drop["mlp.3"] < 0.05 and drop["attn.*"] < 0.15 and drop["mlp.2-3"] > 0.75


def test_the_group_bars_mark_the_scan_s_removal_and_both_figures_read_in_percent():
    from attnviz.figures.why import paths_bars_figure, paths_figure

    found = paths(tiny.loaded("gemma3_text"), TEXT, "fwd", "embed,mlp.0", "mlp.*,attn.*,all")
    fig = paths_bars_figure(found)
    assert len(fig.data) == 2
    for trace, sender in zip(fig.data, found.senders):
        assert list(trace.y) == ["mlp.*", "attn.*", "all"]
        np.testing.assert_allclose(trace.x, [found.drop(sender, r) for r in trace.y])
        assert trace.marker.color[-1] != trace.marker.color[0]  # the scan's removal stands out
    # the heatmap reads in % as the bars and the sentences do: its colour bar, its hover, its scale -100 % .. 100 %
    heat = [t for t in paths_figure(found).data if t.type == "heatmap"]
    assert heat and all(t.zmin == -1 and t.zmax == 1 for t in heat)
    assert heat[0].colorbar.tickformat == ".0%" and all("%{z:.0%}" in t.hovertemplate for t in heat)


@pytest.mark.browser
@pytest.mark.skipif(not shutil.which("chromium") and not os.environ.get("ATTNVIZ_REQUIRE_BROWSER"),
                    reason="needs chromium (bash scripts/setup.sh dev)")
def test_both_figures_render_in_chromium():
    from attnviz.figures import export
    from attnviz.figures.why import paths_bars_figure, paths_figure

    found = paths(tiny.loaded("gemma3_text"), TEXT, "fwd", "embed,mlp.0", None)
    for fig in (paths_figure(found), paths_bars_figure(found)):
        data = export.figure_bytes(fig, "png", {"tool": "attnviz", "figure": "paths"})
        assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_a_sender_one_layer_below_the_top_draws_and_its_groups_stay_groups():
    """mlp.1 of a three-layer model: each group holds one receiver, and is still a group (not drawn as a cell)."""
    from attnviz.figures.why import paths_bars_figure, paths_figure

    lm = tiny.loaded("gemma3_text")
    found = paths(lm, TEXT, "fwd", "mlp.1", None)
    assert found.receivers("mlp.1", single=False) == ["attn.*", "keys.*", "queries.*", "mlp.*", "all"]
    assert found.cut["mlp.1", "attn.*"] == ["attn.2"]
    assert found.after["mlp.1", "attn.*"].attention == found.after["mlp.1", "attn.2"].attention
    assert len(paths_figure(found).data) == 1 and len(paths_bars_figure(found).data) == 1


def test_ranges_run_upwards_and_the_scan_s_senders_skip_what_is_below_them(monkeypatch):
    lm = tiny.loaded("llama")
    with pytest.raises(InputError, match="a range runs upwards"):
        paths(lm, TEXT, "fwd", "embed", "keys.2-1")

    class Scanned:
        necessary = ["mlp.1"]

    monkeypatch.setattr(causal, "scan", lambda *a, **k: Scanned())
    found = paths(lm, TEXT, "fwd", None, "attn.1,mlp.2,head")  # attn.1 is below the scan's mlp.1: left out for it
    assert found.senders == ["mlp.1"] and found.receivers("mlp.1") == ["mlp.2", "head"]
    with pytest.raises(InputError, match="not above mlp.1"):  # a sender the caller names: refused
        paths(lm, TEXT, "fwd", "mlp.1", "attn.1,head")


def test_the_groups_keyword_leaves_out_what_a_fused_family_lacks():
    lm = tiny.loaded("gpt_neox")
    found = paths(lm, TEXT, "fwd", "mlp.0", "groups")
    assert found.receivers("mlp.0") == ["attn.*", "mlp.*", "all"] and "query_key_value" in found.skipped
    with pytest.raises(InputError, match="no projection of the keys alone"):
        paths(lm, TEXT, "fwd", "mlp.0", "keys.*")
