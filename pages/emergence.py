"""Emergence: watch a sink form during training. Runs of the lab's trainer (docs/lab.md), one checkpoint at a time
(its attention map on the run's probe) and over all of them (the measures of Guo et al. 2024, several runs side by
side), and the order in which head classes form (docs/methods.md#order-of-formation); a small run trained here as a
job in the server's queue."""

import streamlit as st

from attnviz.errors import AttnvizError
from attnviz.figures.emergence import LABELS, SINKS, checkpoint_map, curves_figure, layers_figure, runs_figure
from attnviz.figures.heatmaps import head_label
from attnviz.lab import formation
from ui import emergence as em
from ui import jobs
from ui.docs import definitions
from ui.export import figure_downloads
from ui.sidebar import page_context

page_context()
st.title("Emergence: watch a sink form during training")
definitions("alpha", "sink-rate", "entropy", "value-weighted-attention", "order-of-formation")
st.markdown("A small decoder trained from scratch on Bigram-Backcopy (docs/lab.md) saves a checkpoint at steps 0, 1, "
            "2, 4, … and every 500 after. Move through them: the attention map of one checkpoint on a sequence of "
            "the run's task, and the first token's share, the value drain, the residual peak and the loss over "
            "training (Guo et al. 2024, arXiv 2410.13835).")

opened = st.session_state.pop("em_open", None)  # a cell of the Sweeps page's grid of trained runs: its runs
if opened:
    st.session_state.update(em_folder=opened["folder"], em_runs=opened["runs"])
folder = st.text_input("Runs folder", str(em.default_folder()), key="em_folder",
                       help="a run (a folder of step-N checkpoints) or a folder of runs")

with st.expander("Train a small run", expanded=False):
    t1, t2, t3, t4 = st.columns(4)  # no form: the estimate below follows what is typed at once
    kind = t1.text_input("Attention kind", em.DEFAULT_KIND, key="em_kind",
                         help=f"the call syntax's attention kind: {em.KINDS}")
    mask = t2.text_input("Mask", em.DEFAULT_MASK, key="em_mask",
                         help="the call syntax's mask (docs/methods.md#the-call-syntax): fwd is causal")
    n_steps = t3.number_input("Steps", 1, 20_000, 400, key="em_steps")
    seed = t4.number_input("Seed", 0, 10_000, 0, key="em_seed")
    train_go = st.button("Train", type="primary", key="em_train")
    st.caption("One layer of attention, four heads (the lab's default); the run lands in the runs folder above, as "
               "<kind>-<mask>-seed<seed>-<steps>steps. " + jobs.eta("lab-train", n_steps, "a step"))
    if train_go:
        last = em.train_run(folder, kind, mask, n_steps, seed)
        if last is not None:
            st.success(f"Trained: {last.parent.name}, last checkpoint {last.name}.")
            kept = [n for n in st.session_state.get("em_runs", []) if n != last.parent.name]
            st.session_state.update(em_runs=[last.parent.name, *kept][:4])  # the new run, shown step by step
            st.session_state.pop("em_step", None)  # at its last checkpoint

runs = em.found(folder)
if runs is None:
    st.stop()
if not runs:
    st.info(f"No runs in {folder} yet: train one above, or give a folder of runs "
            "(`scripts/lab_sink.py` writes them to runs/).")
    st.stop()
names = [r.name for r in runs]
if any(n not in names for n in st.session_state.get("em_runs", [])):  # another folder: its own runs
    del st.session_state["em_runs"]
chosen = st.multiselect("Runs", names, default=names[:4], key="em_runs",
                        help="the first is shown step by step; all of them side by side below")
if not chosen:
    st.info("Pick a run.")
    st.stop()
run = runs[names.index(chosen[0])]
steps = list(run.steps)
asked = st.query_params.get("step")
if asked is not None and st.session_state.get("em_asked") != asked:  # ?step=N: opened at that checkpoint
    st.session_state["em_asked"] = asked
    try:
        run.checkpoint(int(asked) if asked.lstrip("-").isdigit() else -1)
        st.session_state["em_step"] = int(asked)
    except AttnvizError as err:
        st.error(f"Step: {err}")
if st.session_state.get("em_step") not in steps:  # a first visit, or another run picked
    st.session_state["em_step"] = steps[-1]
step = st.select_slider("Step", steps, key="em_step", help="the run's checkpoints (log-spaced early)")
meta = em.export_meta(run, step)

st.subheader(f"{run.name} at step {step}")
setup = run.trained()
if st.session_state.get("em_layer", 0) >= setup.layers or st.session_state.get("em_head", "mean") not in (
        "mean", *range(setup.heads)):  # another run, smaller: its own top layer and the head mean
    for key in ("em_layer", "em_head"):
        st.session_state.pop(key, None)
c1, c2, c3 = st.columns([3, 1, 2])
if setup.layers > 1:
    layer = c1.slider("Layer", 0, setup.layers - 1, setup.layers - 1, key="em_layer")
else:
    layer = 0
    c1.caption(f"One layer, {setup.heads} heads, {setup.width} wide; trained {steps[-1]} steps.")
head = c2.selectbox("Head", ["mean", *range(setup.heads)], key="em_head")
loss = run.meta(step).get("loss")
c3.metric("Training loss at this step", "—" if loss is None or loss != loss else f"{loss:.4g}",
          help="the training batch's loss at this step (none before the first step)")
cap = em.capture_at(run, step)
if cap is not None:
    shown = None if head == "mean" else int(head)
    fig_h = checkpoint_map(cap, layer, shown,
                           title=f"{run.name} · step {step} · layer {layer} · {head_label(cap, shown)}")
    st.plotly_chart(fig_h, width="stretch", key="em_heatmap")
    figure_downloads(fig_h, {**meta, "layer": layer, "head": head, "figure": "emergence-heatmap"}, key="em_heatmap_x")
    st.caption(f"A fresh sequence of the run's task ({cap.n_tokens} tokens, written by "
               "the checkpoint's own tokenizer; T1… are triggers, whose next token copies the one before "
               "them: only those queries need attention).")

frames = {}
try:
    for name in chosen:
        frame = em.measured(runs[names.index(name)])
        if frame is None:
            st.stop()
        frames[name] = frame
except AttnvizError as err:
    st.error(f"Measuring the checkpoints: {err}")
    st.stop()

st.subheader("Over training")
o1, o2, o3 = st.columns(3)
sink = o1.radio("Sink measure", SINKS, format_func=LABELS.get, horizontal=True, key="em_sink")
per_head = o2.toggle("Each head", True, key="em_per_head", help="off: each layer's mean over heads")
log_steps = o3.toggle("Log step axis", True, key="em_log")
try:
    fig_c = curves_figure(frames[run.name], sink, per_head, at=step, log_steps=log_steps)
    fig_l = layers_figure(frames[run.name], step)
    fig_r = runs_figure([frames[n] for n in chosen], sink, log_steps=log_steps, names=chosen,
                        setups=[runs[names.index(n)].setup for n in chosen]) if len(chosen) > 1 else None
except AttnvizError as err:
    st.error(f"Drawing the table: {err}")
    st.stop()
st.plotly_chart(fig_c, width="stretch", key="em_curves")
figure_downloads(fig_c, {**meta, "figure": "emergence-curves", "sink": sink}, key="em_curves_x")
st.plotly_chart(fig_l, width="stretch", key="em_layers")
figure_downloads(fig_l, {**meta, "figure": "emergence-layers"}, key="em_layers_x")
if fig_r is not None:
    st.plotly_chart(fig_r, width="stretch", key="em_runs_fig")
    figure_downloads(fig_r, {**meta, "model": " vs ".join(chosen), "figure": "emergence-runs", "description": (
        f"lab runs {', '.join(t.name for t in fig_r.data)}: {LABELS[sink]} over training")}, key="em_runs_x")
else:
    st.caption("Pick two or more runs (other kinds, masks or seeds) to draw them side by side.")
st.download_button("The table (.csv)", frames[run.name].to_csv(index=False).encode(), key="em_csv", mime="text/csv",
                   file_name=f"attnviz_emergence_{run.name}.csv")

if set(formation.CLASSES.values()) <= set(frames[run.name].columns):  # a table measured with the head classes
    st.subheader("Order of formation")
    st.caption("Per layer, the first checkpoint at which any of its heads holds each class, and that head "
               "([definition](definitions#order-of-formation)): sink (alpha0 > eps), induction, previous-token and "
               "duplicate-token heads on repeated random tokens (score ≥ 0.4), dormant (quiet queries on key 0, "
               "writing under half of what the active ones write).")
    st.dataframe(formation.order(frames[run.name]), hide_index=True)
