"""Sweeps: a results folder of `attnviz sweep` as a table and figures; a small sweep on the local Ray."""

from pathlib import Path

import streamlit as st

from attnviz.figures import export
from attnviz.errors import AttnvizError
from attnviz.figures.sweeps import compression, recall_by_k, sink_rates, summary_table
from attnviz.core.loading.models import cache_dir
from attnviz.sweep import spec as spec_mod
from attnviz.sweep import store
from ui import jobs, shared
from ui.export import figure_downloads
from ui.cache import sweep_room
from ui.sidebar import page_context
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
            grid = spec_mod.parse(text)
        except AttnvizError as err:
            st.error(str(err))
        else:
            cells = grid.cells()
            refused = sweep_room(grid.models)
            if refused:
                st.error(f"Not run: {refused}.")
            elif len(cells) > max_cells:
                st.error(f"{len(cells)} cells: the page runs at most {max_cells} (each loads a model in a Ray worker "
                         "beside this server's memory budget). Run bigger grids with `attnviz sweep`.")
            elif shared.checked(rules.writable, folder, "results folder") is None:
                pass  # refused before anything is created
            elif any(shared.checked(rules.model, m) is None for m in grid.models):
                pass  # a model this server does not load for visitors
            else:
                from attnviz.sweep import run

                def compute(progress):
                    progress(0, len(cells))
                    summary = run.sweep(grid, folder, workers=1, on_cell=lambda done, total, _: progress(done, total))
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
