"""Activation patching: put a clean run's activation into a corrupted run, every layer and position (or head), under
the sidebar's architecture and intervention (docs/methods.md#activation-patching)."""

import json

import streamlit as st

from attnviz import defaults
from attnviz.effects.patching import EXAMPLE, METRICS, SITES, patching
from attnviz.errors import AttnvizError
from attnviz.figures.why import patching_figure
from ui import cache, jobs
from ui.docs import definitions
from ui.export import figure_downloads
from ui.sidebar import page_context

settings, loaded = page_context()
st.title("Activation patching")
definitions("activation-patching")
st.markdown("Two texts of the same length: the **clean** one and a **corrupted** one that changes what matters. Each "
            "cell puts the clean run's activation at one layer and position (or one head's output) into the "
            "corrupted run: 1 restores the clean answer, 0 changes nothing.")

METRIC_NAMES = {"logit_diff": "logit(answer) − logit(wrong)", "kl": "KL from the clean next-token distribution",
                "sink": "the last query's attention on the sink key"}

if loaded is None:
    st.warning("Load a model in the sidebar.")
else:
    run = defaults.of(patching)
    c1, c2 = st.columns(2)
    clean = c1.text_input("Clean text", EXAMPLE["clean"], key="pt_clean")
    corrupted = c2.text_input("Corrupted text", EXAMPLE["corrupted"], key="pt_corrupted")
    s1, s2, s3, s4 = st.columns([2, 3, 2, 2])
    site = s1.selectbox("Site", SITES, SITES.index(run["site"]), key="pt_site",
                        help="resid: the stream entering the layer; attn / mlp: the block's write; heads: each "
                             "head's output at every position")
    metric = s2.selectbox("Metric", METRICS, METRICS.index(run["metric"]), format_func=METRIC_NAMES.get,
                          key="pt_metric")
    answer = s3.text_input("Answer token", EXAMPLE["answer"], key="pt_answer", disabled=metric != "logit_diff")
    wrong = s4.text_input("Wrong token", EXAMPLE["wrong"], key="pt_wrong", disabled=metric != "logit_diff")
    recipe = settings.recipe(loaded)
    if recipe is not None:
        key = ("patching", recipe.key, clean, corrupted, site, metric, answer, wrong)
        if st.button("Patch", key="pt_run", type="primary") or jobs.cached(key):
            try:
                result = jobs.run(key, f"Patching {site}, layer by layer", lambda progress: patching(
                    loaded, clean, corrupted, answer, wrong, site, metric, recipe, on_layer=progress,
                    budget=cache.analysis_budget(), on_plan=cache.room_for))
            except AttnvizError as err:
                st.error(str(err))
                result = None
            if result is not None:
                fig = patching_figure(result)
                st.plotly_chart(fig, width="stretch", key="pt_grid")
                meta = {"model": loaded.model_id, "arch": recipe.arch, "figure": f"patching-{site}",
                        "metric": metric, "clean": clean, "corrupted": corrupted}
                figure_downloads(fig, meta, key="pt_grid_x")
                st.download_button("The grid (.json)", json.dumps(result.as_json()), file_name=f"patching-{site}.json",
                                   mime="application/json", key="pt_data")
        else:
            st.caption(f"One click runs both texts, then one batched forward per layer ({loaded.n_layers}), each "
                       "resumed from that layer's input.")
