"""Every default a page shows is the library's: each widget whose value feeds a library function's parameter starts
at that function's default (:func:`attnviz.defaults.of`), on every page and in the shared sidebar, through AppTest
on a tiny random-weight model (one token per character).

Not compared, on purpose: a value the app starts at to show an effect where the library's default is the one that
changes nothing (the library's is the right default for a caller who asks for nothing):

the sidebar's sinkscale beta 0.3 (the library's beta=1 keeps the sink's weight), temperature t 2 (t=1 changes
nothing), patch at tokens "sink" (the library's tokens="0") and the intervention's layers, the top ten (the library's:
every layer).

Widgets with no library default (the page's own example texts and architectures, sizes the library takes as
required parameters) are not listed here."""

import pytest

from attnviz import defaults, flow
from attnviz.core.spec import arch, interventions, masks
from attnviz.effects import causal, dataset, embedding, evaluate, generate, heads, linformer, streaming
from attnviz.effects import patching as patching_mod
from attnviz.effects import walkthrough as W
from attnviz.effects.explain import query_key_view
from attnviz.figures import architecture_masks, heatmap, key_profile, panels, sink_map, stablemask_pseudo
from attnviz.kv import compress, presses
from attnviz.recipe import Recipe
from attnviz.sweep import spec as sweep_spec

from test_app import app_test, on_page, texts
from tiny import build, char_tokenizer

D = defaults.of


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    where = tmp_path_factory.mktemp("tiny-model")
    build("llama").save_pretrained(where)
    char_tokenizer().save_pretrained(where)
    return where


@pytest.fixture
def at(model_cache, tiny_dir, tmp_path):
    at = app_test(tmp_path)
    at.session_state["model"] = str(tiny_dir)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def visit(at, page: str):
    on_page(at, f"pages/{page}.py")
    assert not at.error, texts(at.error)
    return at


def value(at, kind: str, key: str):
    return getattr(at, kind)(key=key).value


def test_the_sidebar_starts_at_the_librarys_defaults(at):
    visit(at, "designer")  # the cheapest page: each pick below reruns it

    def side(kind: str, key: str):  # the sidebar as the last run drew it
        return getattr(at.sidebar, kind)(key=key)

    def pick(key: str, choice: str) -> None:
        side("selectbox", key).set_value(choice).run()
        assert not at.exception and not at.error, texts(at.error)

    recipe = D(Recipe.of)
    assert side("selectbox", "arch_pick").value.lower() == recipe["arch"]
    assert (None if side("selectbox", "iv_pick").value == "none" else "?") == recipe["intervene"]
    assert (None if not side("toggle", "bos").value else "bos") == recipe["prepend"]
    assert (None if side("selectbox", "residual").value == "none" else "?") == recipe["residual"]
    for choice, name in (("NoSink-FWD", "nosink-fwd"), ("NoSink-BIDIR", "nosink-bidir")):
        pick("arch_pick", choice)
        assert side("slider", "arch_m").value == arch.MASKS.defaults(name)["m"], choice
    pick("arch_pick", "StableMask")
    assert side("slider", "arch_gamma").value == pytest.approx(masks.stablemask().stable)  # its gamma when none given
    assert side("number_input", "arch_T").value == 0 and arch.MASKS.defaults("stablemask")["t"] is None  # 0: none
    pick("arch_pick", "Global + sliding")
    assert side("number_input", "arch_g").value == arch.MASKS.defaults("global")["g"]
    pick("arch_pick", "FWD")
    kinds = interventions.INTERVENTIONS
    pick("iv_pick", "sinkscale (ACT)")
    assert side("number_input", "iv_key").value == kinds.defaults("sinkscale")["key"]
    pick("iv_pick", "sinklogit")
    assert side("number_input", "iv_b").value == kinds.defaults("sinklogit")["b"]
    pick("iv_pick", "patch a block")
    assert side("radio", "iv_block").value == kinds.defaults("patch")["block"]
    assert side("radio", "iv_value").value == kinds.defaults("patch")["value"]
    pick("iv_pick", "ablate heads")
    assert side("radio", "iv_how").value == kinds.defaults("ablate")["how"]


def test_heatmaps_sinks_and_compare(at):
    visit(at, "heatmaps")  # app_test shows the server-side view, whose controls are these
    shown = D(heatmap)
    assert value(at, "radio", "hm_mode") == shown["mode"]
    assert value(at, "toggle", "hm_log") == shown["log"]  # a short text: the page's log rule does not apply
    assert value(at, "toggle", "hm_rownorm") == shown["row_normalise"]

    visit(at, "sinks")
    eps = value(at, "slider", "sk_eps")
    assert eps == pytest.approx(D(sink_map)["eps"]) and eps == pytest.approx(D(dataset.DatasetSinks.as_json)["eps"])
    assert value(at, "number_input", "sk_key") == D(key_profile)["key"]  # the auto key: 0 under fwd
    at.radio(key="sk_view").set_value("a dataset").run()
    assert not at.exception and not at.error, texts(at.error)
    run, report = D(dataset.sinks), D(dataset.DatasetSinks.as_json)
    assert value(at, "number_input", "sk_maxlen") == run["max_len"]
    assert value(at, "number_input", "sk_samples") == run["n_samples"]
    assert value(at, "radio", "sk_ds_unit") == run["unit"]
    assert value(at, "text_input", "sk_ds_arch") == run["recipe"]
    assert value(at, "selectbox", "sk_ds_key") == report["key"]

    visit(at, "compare")
    head = value(at, "selectbox", "cmp_head")
    assert (None if head == "mean" else head) == D(panels)["head"]


def test_heads_routes_why_and_patching(at):
    # the sidebar text: a character tokenizer's decoded corpus text would come back twice as long (spaces between)
    at.session_state["hd_source"] = "The sidebar text"
    visit(at, "heads")
    tax = D(heads.taxonomy)
    assert value(at, "number_input", "hd_s") == tax["s"] and value(at, "number_input", "hd_w") == tax["w"]
    for key, name in (("hd_eps", "eps"), ("hd_tau_stream", "tau_stream"), ("hd_tau_inactive", "tau_inactive")):
        assert value(at, "slider", key) == pytest.approx(tax[name]), key

    visit(at, "routes")
    graph = D(flow.graph)
    token = at.selectbox(key="rt_token")
    assert token.value == len(token.options) + graph["token"]  # negative: counted from the end
    assert value(at, "slider", "rt_threshold") == pytest.approx(graph["threshold"])
    assert value(at, "radio", "rt_heads") == graph["heads"]
    assert value(at, "checkbox", "rt_renormalise") == graph["renormalise"]

    visit(at, "why")
    assert value(at, "radio", "why_method") == D(query_key_view)["method"]
    assert value(at, "radio", "why_test_value") == D(causal.check)["value"]

    visit(at, "patching")
    run = D(patching_mod.patching)
    assert value(at, "selectbox", "pt_site") == run["site"] and value(at, "selectbox", "pt_metric") == run["metric"]
    assert {k: value(at, "text_input", f"pt_{k}") for k in patching_mod.EXAMPLE} == patching_mod.EXAMPLE


def test_pages_without_a_model(at):
    visit(at, "walkthrough")
    assert value(at, "selectbox", "wt_mask") == D(W.steps)["mask_name"]
    assert value(at, "radio", "wt_lin_projection") == D(W.linformer_steps)["method"]
    assert value(at, "text_area", "wt_q") == "\n".join(", ".join(f"{x:g}" for x in row) for row in W.Q)

    visit(at, "designer")
    assert value(at, "slider", "md_n") == D(architecture_masks)["n"] == D(stablemask_pseudo)["n"]
    assert value(at, "slider", "md_gamma") == pytest.approx(D(stablemask_pseudo)["gamma"])

    visit(at, "sweeps")
    assert value(at, "text_area", "sw_spec") == sweep_spec.EXAMPLE


def test_effects(at):
    visit(at, "effects")

    def section(name: str) -> None:
        at.radio(key="fx_section").set_value(name).run()
        assert not at.exception and not at.error, texts(at.error)

    section("Perplexity")
    run = D(evaluate.evaluate)
    assert value(at, "number_input", "fx_ppl_window") == run["window"]
    assert value(at, "number_input", "fx_ppl_tokens") == run["max_tokens"]

    section("KV compression")
    kv = D(compress.compress)
    assert value(at, "text_input", "fx_kv_ratios") == ", ".join(f"{r:g}" for r in kv["ratios"])
    assert value(at, "number_input", "fx_kv_context") == kv["context"]
    assert value(at, "multiselect", "fx_kv_presses") == list(presses.DEFAULTS)

    longest = at.session_state["loaded"].max_tokens  # a token count starts at the library's, within the model's
    section("Streaming (KV cache)")
    assert value(at, "number_input", "fx_st_tokens") == min(streaming.MAX_TOKENS, longest)
    assert value(at, "text_input", "fx_st_arch") == D(streaming.stream)["recipe"]

    section("KV compression")
    assert value(at, "number_input", "fx_kv_tokens") == min(compress.MAX_TOKENS, longest)

    section("Embedding k-sweep")
    sweep = D(embedding.sweep)
    assert value(at, "number_input", "fx_sw_m") == sweep["m"]
    assert value(at, "number_input", "fx_sw_docs") == sweep["max_docs"]  # None: every document
    assert value(at, "text_input", "fx_sw_ks") == ("all" if sweep["ks"] is None else ", ".join(map(str, sweep["ks"])))

    section("Generation")
    run = D(generate.generate)
    assert value(at, "number_input", "fx_gen_new") == run["max_new_tokens"]
    assert value(at, "text_input", "fx_gen_policy") == run["policy"]

    section("Linformer what-if")
    ks = value(at, "text_input", "fx_lin_ks")
    assert tuple(int(k) for k in ks.replace(",", " ").split()) == tuple(linformer.KS)
    assert value(at, "radio", "fx_lin_projection") == D(linformer.whatif)["method"]
