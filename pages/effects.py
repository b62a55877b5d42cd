"""Effects: what a mask does to the model — perplexity, streaming with a KV cache, KV-cache compression,
the embedding k-sweep and cached generation (docs/methods.md#evaluation, docs/methods.md#cache-policies, docs/methods.md#kv-cache-compression)."""

import pandas as pd
import streamlit as st

from attnviz import corpus, defaults, options
from attnviz.effects import embedding, generate, linformer, streaming
from attnviz.figures import export
from attnviz.core.engine import residual
from attnviz.core.spec.arch import parse, with_k
from attnviz.recipe import Recipe
from attnviz.errors import AttnvizError
from attnviz.effects.evaluate import evaluate, token_ids
from attnviz.figures import (compression_curves, generation_view, k_sweep, kept_keys, linformer_errors,
                             linformer_map, perplexity_bars, residual_table_figure, streaming_curves)
from attnviz.kv import compress, presses
from attnviz.core.loading.models import cache_dir
from attnviz.reports import reproduce as repro
from ui import jobs, shared
from ui.export import figure_downloads
from ui.cache import full_maps_limit
from ui.sidebar import own_kind_only, page_context
from ui.docs import definitions

settings, loaded = page_context()
st.title("Effects: what a mask does to the model")
definitions("evaluation", "cache-policies", "kv-cache-compression", "residual-variants", "linformer-what-if")
SECTIONS = ["Perplexity", "Streaming (KV cache)", "KV compression", "Embedding k-sweep", "Generation",
            "Linformer what-if", "Residual methods", "Paper reproductions"]
own_kind_only(settings, "This page")
SOURCES = {"Python reference docs (all topics)": "stdlib", "Python docs: special method names": "stdlib:specialnames",
           "The sidebar text": None, "A text file on the server": "file"}


def split(text: str) -> list[str]:
    return [s.strip() for s in text.split(";") if s.strip()]


def source(key: str) -> tuple[str, corpus.Corpus] | None:
    choice = st.selectbox("Text", list(SOURCES), key=key,
                          help="Offline: Python's own reference documentation (pydoc_data), read at run time")
    try:
        if SOURCES[choice] is None:
            return "sidebar", corpus.from_text(settings.text, "the sidebar text")
        if SOURCES[choice] == "file":
            path = st.text_input("Text file (UTF-8) on the server", key=f"{key}_file",
                                 help="paragraphs separated by blank lines are the documents")
            if not path.strip():
                st.info("Type the path of a text file on the server.")
                return None
            return path, corpus.from_file(shared.access().readable(path, "text file"))
        return SOURCES[choice], corpus.load(SOURCES[choice])
    except AttnvizError as err:
        st.error(str(err))
        return None


def meta(**extra) -> dict:
    return {"tool": "attnviz", "model": loaded.model_id, **extra}


def checked(specs: list[str], causal: str | None = None) -> list[str] | None:
    """Canonical architecture strings, or None after showing what is wrong with one."""
    try:
        out = []
        for spec in specs:
            architecture = parse(spec, loaded.n_layers)
            out.append((architecture.require_causal(causal) if causal else architecture).spec)
        return out
    except AttnvizError as err:
        st.error(str(err))
        return None


def perplexity_section() -> None:
    st.markdown("Perplexity and next-token accuracy under each architecture ([definition](definitions#evaluation), the windows of "
                "transformers' perplexity guide). Only causal-compatible architectures have one: under BACK or "
                "BIDIR a query reads the token it predicts.")
    c1, c2, c3 = st.columns([3, 1, 1])
    specs = split(c1.text_input("Architectures, separated by ';'", "fwd; nosink-fwd", key="fx_ppl_archs"))
    run = defaults.of(evaluate)
    window = int(c2.number_input("Window W", 2, loaded.max_tokens, run["window"], key="fx_ppl_window"))
    max_tokens = int(c3.number_input("Max tokens", 2, 100_000, run["max_tokens"], step=256, key="fx_ppl_tokens"))
    picked = source("fx_ppl_source")
    if not specs:
        st.error("Give at least one architecture.")
        return
    archs = checked(specs, "compute a perplexity")
    if not archs or picked is None:
        return
    name, text = picked[0], picked[1].text
    keys = [("eval", loaded.model_id, name, text if name == "sidebar" else "", a, window, max_tokens,
             settings.residual) for a in archs]
    if not all(jobs.cached(k) for k in keys) and not st.button("Compute perplexity", key="fx_ppl_run", type="primary"):
        st.caption(f"{len(archs)} architecture(s) × up to {max_tokens} tokens; "
                   f"{jobs.eta('eval', len(archs) * max_tokens)}.")
        return
    try:
        ids = token_ids(loaded, text, max_tokens)
    except AttnvizError as err:
        st.error(str(err))
        return
    results = [jobs.run(key, f"Perplexity under {a}", lambda progress, a=a: evaluate(
        loaded, ids, Recipe.of(loaded, a, residual=settings.residual), window=min(window, len(ids)),
        on_window=progress),
        units=len(ids)) for key, a in zip(keys, archs)]
    if all(results):
        fig = perplexity_bars(results)
        st.plotly_chart(fig, width="stretch", key="fx_ppl_chart")
        st.dataframe([r.as_json() for r in results], hide_index=True)
        figure_downloads(fig, meta(arch=" vs ".join(archs), figure="perplexity", corpus=name,
                                   window=window, tokens=len(ids)), key="fx_ppl_x")


def streaming_section() -> None:
    st.markdown("Token-by-token decoding with a real KV cache (StreamingLLM, [definition](definitions#cache-policies)). **window** keeps the last W "
                "entries, **sink** also keeps the first S: once the first tokens leave the cache the window policy "
                "breaks, while keeping a few sink tokens holds the model close to the dense cache.")
    c1, c2, c3 = st.columns([3, 1, 1])
    policies_text = c1.text_input("Cache policies, separated by ';'", "dense; window(w=64); sink(s=4, w=60)",
                                  key="fx_st_policies")
    tokens = int(c2.number_input("Tokens", 16, loaded.max_tokens, min(streaming.MAX_TOKENS, loaded.max_tokens),
                                 step=100, key="fx_st_tokens"))
    arch = c3.text_input("Architecture", "fwd", key="fx_st_arch", help="causal-compatible: fwd, nosink-fwd, ...")
    picked = source("fx_st_source")
    archs = checked([arch], "decode with a KV cache")
    try:
        policies = [streaming.parse_policy(p) for p in split(policies_text)]
        if not policies:
            raise AttnvizError("give at least one cache policy: dense, window(w=W) or sink(s=S, w=W)")
        ids = token_ids(loaded, picked[1].text, tokens) if picked else None
        for policy in policies if ids else []:
            policy.check(loaded, len(ids))
    except AttnvizError as err:
        st.error(str(err))
        return
    if not archs or ids is None:
        return
    keys = [("stream", loaded.model_id, picked[0], tuple(ids), archs[0], p.spec) for p in policies]
    if not all(jobs.cached(k) for k in keys) and not st.button("Stream", key="fx_st_run", type="primary"):
        st.caption(f"{len(policies)} policies × {len(ids)} tokens, one token at a time: "
                   f"{jobs.eta('stream', len(policies) * len(ids))}.")
        return
    results = [jobs.run(key, f"Streaming {p.spec}", lambda progress, p=p: streaming.stream(
        loaded, ids, p, archs[0], on_step=progress), units=len(ids)) for key, p in zip(keys, policies)]
    if all(results):
        fig = streaming_curves(results)
        st.plotly_chart(fig, width="stretch", key="fx_st_chart")
        st.dataframe([r.as_json() for r in results], hide_index=True)
        figure_downloads(fig, meta(arch=archs[0], figure="streaming", corpus=picked[0], tokens=len(ids),
                                   policies=[p.spec for p in policies]), key="fx_st_x")


def sweep_section() -> None:
    st.markdown("Is the converted model a better text encoder (seed 000)? Each document's first M tokens must find "
                "its next M tokens among all documents' by the cosine of mean-pooled last hidden states ([definition](definitions#evaluation)). "
                "k counts the converted top layers.")
    c1, c2 = st.columns([3, 2])
    specs = split(c1.text_input("Named architectures, separated by ';'", "mask0-bidir; inplace-bidir",
                                key="fx_sw_archs"))
    L, probe, default_ks = loaded.n_layers, defaults.of(embedding.probe), defaults.one(embedding.sweep, "ks")
    ks_text = c2.text_input("k values (or 'all')", "all" if default_ks is None else ", ".join(map(str, default_ks)),
                            key="fx_sw_ks")
    c3, c4, c5 = st.columns(3)
    m = int(c3.number_input("M tokens per half", 4, 256, probe["m"], key="fx_sw_m"))
    docs = c4.number_input("Documents", 2, 500, probe["max_docs"], key="fx_sw_docs", placeholder="all")
    metric = c5.radio("Score", ["recall_at_1", "mrr"], horizontal=True, key="fx_sw_metric",
                      format_func={"recall_at_1": "recall@1", "mrr": "MRR"}.get)
    picked = source("fx_sw_source")
    try:
        ks = embedding.parse_ks(ks_text, L)
        templates = [with_k(s, L, L) and s.lower().replace(" ", "") for s in specs]  # checks each template
        if not templates:
            raise AttnvizError("give at least one named architecture, e.g. mask0-bidir")
    except AttnvizError as err:
        st.error(str(err))
        return
    if picked is None:
        return
    keys = [("sweep", loaded.model_id, picked[0], picked[1].documents if picked[0] == "sidebar" else (), t,
             tuple(ks), m, docs) for t in templates]
    if not all(jobs.cached(k) for k in keys) and not st.button("Run the sweep", key="fx_sw_run", type="primary"):
        halves = "both halves of every document" if docs is None else f"{2 * docs} sequences"
        st.caption(f"{len(templates)} architecture(s) × {len(ks)} values of k × {halves} of {m} tokens.")
        return
    rows = {t: jobs.run(key, f"k-sweep of {t}", lambda progress, t=t: embedding.sweep(
        loaded, picked[1].documents, t, ks, m=m, max_docs=docs, on_progress=progress))
        for key, t in zip(keys, templates)}
    if all(rows.values()):
        fig = k_sweep(rows, metric)
        st.plotly_chart(fig, width="stretch", key="fx_sw_chart")
        figure_downloads(fig, meta(arch=" vs ".join(templates), figure=f"k-sweep-{metric}", corpus=picked[0], m=m,
                                   docs=docs), key="fx_sw_x")


def generation_section() -> None:
    st.markdown("Greedy generation with the KV cache, from the sidebar text. Each row is one step: the new token's "
                "attention over what the cache holds; shaded positions were evicted by the policy.")
    c1, c2, c3 = st.columns([2, 2, 1])
    default_arch = settings.arch if parse(settings.arch, loaded.n_layers).causal_compatible else "fwd"
    arch = c1.text_input("Architecture", default_arch, key="fx_gen_arch")
    run = defaults.of(generate.generate)
    policy_text = c2.text_input("Cache policy", run["policy"], key="fx_gen_policy")
    new = int(c3.number_input("New tokens", 1, generate.MAX_NEW_TOKENS, run["max_new_tokens"], key="fx_gen_new"))
    archs = checked([arch], "generate")
    try:
        policy = streaming.parse_policy(policy_text).check(loaded)
    except AttnvizError as err:
        st.error(str(err))
        return
    if not archs or not settings.text.strip():
        if not settings.text.strip():
            st.warning("The text is empty: type something in the sidebar.")
        return
    key = ("generate", loaded.model_id, settings.text, archs[0], policy.spec, new)
    if not jobs.cached(key) and not st.button("Generate", key="fx_gen_run", type="primary"):
        return
    gen = jobs.run(key, "Generating", lambda progress: generate.generate(
        loaded, settings.text, archs[0], policy, new, on_step=progress, max_bytes=full_maps_limit()))
    if gen is None:
        return
    st.markdown(f"**Continuation:** {gen.text!r}")
    c1, c2, c3 = st.columns([3, 2, 2])
    layer = c1.slider("Layer", 0, loaded.n_layers - 1, loaded.n_layers - 1, key="fx_gen_layer")
    heads = ["mean"] + list(range(loaded.n_heads))
    head = c2.select_slider("Head", heads, key="fx_gen_head")
    shown = c3.slider("Steps shown", 1, len(gen.steps), len(gen.steps), key="fx_gen_steps",
                      help="replay the cache: rows are added one decoding step at a time")
    tokens = [loaded.tokenizer.decode([i]) for i in gen.prompt_ids + gen.new_ids]
    fig = generation_view(gen, layer, None if head == "mean" else int(head), tokens, steps=shown)
    st.plotly_chart(fig, width="stretch", key="fx_gen_chart")
    figure_downloads(fig, meta(arch=gen.arch, figure="generation", policy=gen.policy, layer=layer, head=head,
                               text=settings.text), key="fx_gen_x")


def residual_section() -> None:
    st.markdown("Seed 003 replaces a residual of every layer by the sum of earlier layers recomputed on the token "
                "embeddings ([definition](definitions#residual-variants)), then fine-tunes. Fine-tune each method with the same command and settings, "
                "e.g. `attnviz finetune --residual method1 --steps 200 --out ~/.cache/attnviz/finetune/method1` "
                "(and `--out .../baseline` without `--residual`); their held-out metrics appear here beside the "
                "seed's reported numbers.")
    folder = st.text_input("Folder of fine-tuned directories", str(cache_dir() / "finetune"), key="fx_res_dir")
    if shared.checked(shared.access().readable, folder, "folder of fine-tuned directories") is None:
        return  # outside the server's roots: nothing is read or listed
    rows = residual.results_table(folder)
    st.dataframe(rows, hide_index=True)
    if not any(r["ours ppl"] is not None for r in rows):
        st.info(f"No fine-tuned directory with metrics.json under {folder} yet: the table shows the seed's numbers.")
    fig = residual_table_figure(rows)
    st.plotly_chart(fig, width="stretch", key="fx_res_chart")
    figure_downloads(fig, meta(figure="residual-methods", folder=folder), key="fx_res_x")
    st.download_button("Table (.csv)", export.csv_bytes(pd.DataFrame(rows)), key="fx_res_csv", mime="text/csv",
                       file_name=export.filename(meta(figure="residual-methods"), "csv"))


def compression_section() -> None:
    st.markdown("What does compressing the KV cache cost ([definition](definitions#kv-cache-compression), the kvpress protocol)? The text's first C tokens "
                "are prefilled; every press scores each context key of every layer and KV head, and the continuation "
                "sees only the top (1 − r)·C of them. Which methods keep the sink (key 0)?")
    c1, c2, c3 = st.columns([3, 2, 1])
    chosen = c1.multiselect("Presses", presses.DEFAULTS, presses.DEFAULTS, key="fx_kv_presses")
    kv = defaults.of(compress.compress)
    ratios_text = c2.text_input("Ratios r", ", ".join(f"{r:g}" for r in kv["ratios"]), key="fx_kv_ratios")
    context = int(c3.number_input("Context C", 8, loaded.max_tokens, kv["context"], step=64, key="fx_kv_context"))
    picked = source("fx_kv_source")
    tokens = int(st.number_input("Tokens in all (context + continuation)", 16, loaded.max_tokens,
                                 min(compress.MAX_TOKENS, loaded.max_tokens), step=64, key="fx_kv_tokens"))
    archs = checked([settings.arch], "compress a KV cache")
    try:
        if not chosen:
            raise AttnvizError("pick at least one press")
        ratios = sorted(set(options.ratios(ratios_text, "Ratios r")))  # the CLI's --ratios reader
        ids = token_ids(loaded, picked[1].text, tokens) if picked else None
        if ids is not None:
            compress.check(loaded, len(ids), context, ratios, [presses.parse(p) for p in chosen])
    except AttnvizError as err:
        st.error(str(err))
        return
    if not archs or ids is None:
        return
    key = ("compress", loaded.model_id, picked[0], tuple(ids), archs[0], context, tuple(chosen), tuple(ratios))
    if not jobs.cached(key) and not st.button("Compress", key="fx_kv_run", type="primary"):
        st.caption(f"{len(chosen)} presses × {len(ratios)} ratios, one forward of {len(ids)} tokens each: "
                   f"{jobs.eta('compress', len(chosen) * len(ratios), 'a forward')}.")
        return
    result = jobs.run(key, "KV compression", lambda progress: compress.compress(
        loaded, ids, context, chosen, ratios, archs[0], on_step=progress), units=len(chosen) * len(ratios))
    if result is None:
        return
    fig = compression_curves(result)
    st.plotly_chart(fig, width="stretch", key="fx_kv_curves")
    st.dataframe([{"press": "dense", "ratio": 0.0, "perplexity": result.dense.perplexity,
                   "accuracy": result.dense.accuracy}] + [r.as_json() for r in result.rows], hide_index=True)
    figure_downloads(fig, meta(arch=result.arch, figure="kv-compression", context=context, tokens=len(ids)),
                     key="fx_kv_x")
    c1, c2, c3 = st.columns(3)
    ratio = c1.select_slider("Kept keys at r", ratios, value=ratios[len(ratios) // 2], key="fx_kv_ratio")
    layer = c2.slider("Layer", 0, loaded.n_layers - 1, loaded.n_layers - 1, key="fx_kv_layer")
    kv_head = c3.selectbox("KV head", list(range(loaded.n_kv_heads)), key="fx_kv_head")
    fig_kept = kept_keys(result, ratio, layer, kv_head)
    st.plotly_chart(fig_kept, width="stretch", key="fx_kv_kept")
    figure_downloads(fig_kept, meta(arch=result.arch, figure="kv-kept", layer=layer, kv_head=kv_head, ratio=ratio),
                     key="fx_kv_kx")


def linformer_section() -> None:
    st.markdown("What if this layer were a Linformer ([definition](definitions#linformer-what-if))? K and V of the sidebar text are projected to k "
                "slots (segment means or a seeded Gaussian); the map is n × k, and the error of the output is measured "
                "against full softmax attention and against the layer's real, masked output.")
    c1, c2, c3 = st.columns([2, 2, 1])
    layer = c1.slider("Layer", 0, loaded.n_layers - 1, loaded.n_layers - 1, key="fx_lin_layer")
    ks_text = c2.text_input("k values", ", ".join(map(str, linformer.KS)), key="fx_lin_ks")
    method = c3.radio("Projection", linformer.PROJECTIONS, key="fx_lin_projection",
                      index=linformer.PROJECTIONS.index(defaults.one(linformer.whatif, "method")))
    if not settings.text.strip():
        st.warning("The text is empty: type something in the sidebar.")
        return
    try:  # the CLI's --ks reader and its what-if (attnviz linformer), every refusal before anything runs
        prepared = linformer.prepare(loaded, settings.text, settings.arch, layer,
                                     sorted(set(options.ks(ks_text, "k values"))), method)
    except AttnvizError as err:
        st.error(str(err))
        return
    ks = list(prepared.ks)
    job = ("linformer", loaded.model_id, settings.text, settings.arch, layer, tuple(ks), method)
    curve = jobs.run(job, f"Linformer on layer {layer}", lambda progress: prepared.run())
    if curve is None:
        return
    results = curve.rows
    chosen = st.select_slider("Map at k", ks, value=ks[len(ks) // 2], key="fx_lin_show")
    fig_map = linformer_map(next(r for r in results if r.k == chosen))
    fig_err = linformer_errors(results)
    left, right = st.columns(2)
    left.plotly_chart(fig_map, width="stretch", key="fx_lin_map")
    right.plotly_chart(fig_err, width="stretch", key="fx_lin_err")
    meta_lin = meta(arch=settings.arch, layer=layer, projection=method, text=settings.text)
    figure_downloads(fig_err, {**meta_lin, "figure": "linformer-error"}, key="fx_lin_x")


def reproduce_section() -> None:
    st.markdown("The papers' headline figures, regenerated on the loaded model as one PDF: each page a figure with "
                "its claim, the number measured here, the published one beside it and the command that makes it "
                "again (`attnviz reproduce`). The full run takes ~4 minutes on a 2-core CPU; quick runs the same "
                "protocols on less data in under a minute.")
    c1, c2, c3 = st.columns([4, 1, 1])
    names = c1.multiselect("Sections", repro.SECTIONS, default=list(repro.SECTIONS), key="fx_rep_only")
    quick = c2.toggle("Quick", False, key="fx_rep_quick")
    if not names:
        st.warning("Pick at least one section.")
        return
    job = ("reproduce", loaded.model_id, tuple(names), quick)
    if c3.button("Reproduce", key="fx_rep_go", type="primary"):
        st.session_state["fx_rep_job"] = job
    if st.session_state.get("fx_rep_job") != job:
        return

    def compute(progress):
        done = repro.sections(loaded, names, quick, settings.model, on_progress=lambda i, n, _: progress(i, n))
        data = repro.pdf_bytes(done, {"tool": "attnviz", "model": loaded.model_id, "quick": quick,
                                      "numbers": {s.name: s.numbers for s in done}})
        return data, [(s.title, s.caption()) for s in done]

    try:
        found = jobs.run(job, "Reproducing " + ", ".join(names), compute)
    except AttnvizError as err:
        st.error(str(err))
        return
    if found is None:
        return
    data, captions = found
    st.download_button("Download reproductions (.pdf)", data, file_name="attnviz_reproductions.pdf",
                       mime="application/pdf", key="fx_rep_pdf", type="primary")
    for title, caption in captions:
        st.markdown(f"**{title}**")
        st.markdown("  \n".join(caption.split("\n")))


if loaded is None:
    st.warning("Load a model in the sidebar.")
else:
    section = st.radio("Show", SECTIONS, horizontal=True, key="fx_section", label_visibility="collapsed")
    {"Perplexity": perplexity_section, "Streaming (KV cache)": streaming_section,
     "KV compression": compression_section,
     "Embedding k-sweep": sweep_section, "Generation": generation_section,
     "Linformer what-if": linformer_section, "Residual methods": residual_section,
     "Paper reproductions": reproduce_section}[section]()
