"""Sweeps: a results folder of `attnviz sweep` as a table and figures; a small sweep on the local Ray."""

from pathlib import Path

import streamlit as st

from attnviz.figures import export
from attnviz.errors import AttnvizError
from attnviz.figures.sweeps import compression, grid_figure, recall_by_k, sink_rates, summary_table
from attnviz.core.loading.models import cache_dir
from attnviz.sweep import grid
from attnviz.sweep import spec as spec_mod
from attnviz.sweep import store
from ui import jobs, shared
from ui.export import figure_downloads
from ui.cache import sweep_room
from ui.sidebar import page_context, switch_page
from ui.docs import definitions

MAX_CELLS = shared.CAPS["max_cells"]  # a sweep started from the page: a few cells here; bigger: `attnviz sweep`
rules = shared.access()
max_cells = shared.cap("max_cells") if rules.shared else MAX_CELLS  # a shared server's own cap (secrets.toml)

settings, loaded = page_context()
st.title("Sweeps")
definitions("sink-rate", "auto-key", "evaluation", "kv-cache-compression", "head-classes")
st.markdown("A grid of models × architectures × interventions × corpora × measures, one Ray task per cell "
            "(`attnviz sweep spec.toml --out DIR`, docs/sweeps.md). Point this page at a results folder.")
folder = st.text_input("Results folder", str(cache_dir() / "sweeps" / "example"), key="sw_folder")

with st.expander("Run a small sweep here (local Ray)", expanded=False):
    text = st.text_area("Spec (TOML)", spec_mod.EXAMPLE, height=170, key="sw_spec")
    if st.button("Run", key="sw_run", type="primary"):
        try:
            asked = spec_mod.parse(text)
        except AttnvizError as err:
            st.error(str(err))
        else:
            cells = asked.cells()
            refused = sweep_room(asked.models) if asked.models else None
            if asked.train:
                st.error("Training grids ([train]) run with `attnviz sweep spec.toml --out DIR`; this page draws "
                         "their results.")
            elif refused:
                st.error(f"Not run: {refused}.")
            elif len(cells) > max_cells:
                st.error(f"{len(cells)} cells: the page runs at most {max_cells} (each loads a model in a Ray worker "
                         "beside this server's memory budget). Run bigger grids with `attnviz sweep`.")
            elif shared.checked(rules.writable, folder, "results folder") is None:
                pass  # refused before anything is created
            elif any(shared.checked(rules.model, m) is None for m in asked.models):
                pass  # a model this server does not load for visitors
            else:
                from attnviz.sweep import run

                def compute(progress):
                    progress(0, len(cells))
                    summary = run.sweep(asked, folder, workers=1, on_cell=lambda done, total, _: progress(done, total))
                    return summary.as_json(folder)

                result = jobs.run(("sweep", folder, text), f"Sweep of {len(cells)} cells", compute)
                if result is not None:
                    st.success(f"{result['ok']} cells done, {result['skipped']} already on disk, {result['failed']} "
                               f"failed ({result['elapsed_s']:.0f} s)")

if folder.strip() and shared.checked(rules.readable, folder, "results folder") is None:
    st.stop()  # outside the server's roots: nothing is read or listed
try:
    frame = store.read(folder) if folder.strip() else None
except (OSError, ValueError) as err:
    st.error(f"cannot read the results in '{folder}': {err}")
    st.stop()
if frame is None or frame.empty:
    st.info(f"No results in '{folder}' yet: run a sweep into it (above, or `attnviz sweep spec.toml --out {folder}`).")
    st.stop()

table = summary_table(frame)
st.subheader(f"{len(table)} cells")
st.dataframe(table, hide_index=True)
failed = table[table["status"] == "failed"]
if len(failed):
    st.warning(f"{len(failed)} cells failed; their errors are in the table (a rerun of the sweep tries them again).")
meta = {"tool": "attnviz", "figure": "sweep", "folder": str(Path(folder).name)}
st.download_button("All rows (.csv)", export.csv_bytes(frame), file_name="attnviz_sweep.csv", mime="text/csv",
                   key="sw_csv")

for measure, make, title in (("sinks", sink_rates, "Sink rate per layer"), ("compress", compression, "KV compression"),
                             ("embed", recall_by_k, "Embedding recall against k")):
    rows = frame[(frame["measure"] == measure) & (frame["status"] == "ok")]
    if rows.empty:
        continue
    st.subheader(title)
    fig = make(frame)
    st.plotly_chart(fig, width="stretch", key=f"sw_{measure}")
    figure_downloads(fig, {**meta, "measure": measure}, key=f"sw_{measure}_x")
    st.download_button(f"{measure} rows (.csv)", export.csv_bytes(rows), file_name=f"attnviz_sweep_{measure}.csv",
                       mime="text/csv", key=f"sw_{measure}_csv")

trained = grid.runs(frame)
if len(trained):
    st.subheader(f"A grid of {len(trained)} trained runs")
    st.caption(f"Each cell: the runs of its two keys' values (seeds and any other key together), the mean and min–max "
               f"over them. The sink forms at the first checkpoint where the quiet queries put more than "
               f"{grid.FORMED:g} of their attention on the first token (mean over layers and heads).")
    keys, (first, second) = grid.axes(frame), grid.default_axes(frame)
    g1, g2, g3 = st.columns(3)
    rows_key = g1.selectbox("Rows", keys, index=keys.index(first), key="sw_grid_rows")
    others = [k for k in keys if k != rows_key]
    cols_key = g2.selectbox("Columns", others, index=others.index(second) if second in others else 0,
                            key="sw_grid_cols")
    shown = g3.radio("Value", grid.VALUES, format_func=grid.LABELS.get, key="sw_grid_value")
    cells = grid.grid(frame, rows_key, cols_key)
    fig = grid_figure(cells, rows_key, cols_key, shown)
    st.plotly_chart(fig, width="stretch", key="sw_grid")
    figure_downloads(fig, {**meta, "measure": "grid", "rows": rows_key, "columns": cols_key}, key="sw_grid_x")
    st.dataframe(cells.drop(columns=["runs_folder"]), hide_index=True, key="sw_grid_table")
    labels = [f"{rows_key} {r[rows_key]} · {cols_key} {r[cols_key]} ({r['runs']} runs)" for _, r in cells.iterrows()]
    o1, o2 = st.columns([3, 1])
    picked = o1.selectbox("A cell's runs", range(len(labels)), format_func=labels.__getitem__, key="sw_grid_cell")
    if o2.button("Open in Emergence", key="sw_grid_open"):
        chosen = cells.iloc[picked]
        if chosen["runs_folder"] is None:
            st.error("This cell's runs are in several folders: open them in the Emergence page one folder at a time.")
        else:  # the Emergence page takes its runs folder and runs from this before it draws them
            st.session_state["em_open"] = {"folder": chosen["runs_folder"], "runs": list(chosen["names"])}
            switch_page(Path(__file__).resolve().parent / "emergence.py")
