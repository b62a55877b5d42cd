"""Results on disk: a Parquet dataset, one file per cell, written atomically.

``OUT/<measure>/<cell id>.parquet`` holds a finished cell's rows (one per layer where the measure
has layers); ``OUT/<measure>/<cell id>.failed.parquet`` a failed cell's one row with its error (a
later run tries it again, and removes it once the cell succeeds). Every row carries the cell's
parameters (``measure``, ``model``, ``arch``, ``intervention``, ``corpus``, ``options`` as JSON), the
``versions``, the ``elapsed_s`` of the cell, the ``worker`` that ran it and when it ``finished``.
Paths go through ``pyarrow.fs``, so OUT may be a local folder or an object-store URI
(``s3://bucket/sweep``, ``gs://...``) that every worker of a cluster writes to.

A trained run's rows (docs/sweeps.md#training-cells) carry its ``run`` id, its ``setup`` (JSON), the keys its
``[train]`` table named (``axes``, JSON) and, as a column each, those keys' values: a column the schema has already
(``kind``, ``arch``, ``seed``, ``heads``) keeps the measure's own value and takes the run's where the measure left
it empty. :func:`read` unites the files' columns.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import uuid

import pandas as pd

from attnviz.sweep.spec import Cell


def _fs(out: str):
    """(filesystem, base path) of a local folder or a URI."""
    from pyarrow import fs

    if "://" in str(out):
        return fs.FileSystem.from_uri(str(out))
    return fs.LocalFileSystem(), os.path.abspath(os.path.expanduser(str(out)))


def versions() -> dict:
    from attnviz import __version__
    from attnviz.capture import versions as library_versions

    return {"attnviz": __version__, **library_versions()}


def write_cell(out: str, cell: Cell, rows: list[dict], elapsed: float, error: str | None = None,
               recipe=None) -> str:
    """The cell's rows as one Parquet file (to a temporary name, then moved: never half written); ``recipe``
    (:class:`attnviz.recipe.Recipe`, when the model loaded) goes in every row as its key and its dict."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyarrow import fs

    filesystem, base = _fs(out)
    folder = f"{base}/{cell.measure}"
    filesystem.create_dir(folder, recursive=True)
    common = {"cell": cell.id, "measure": cell.measure, "model": cell.model, "arch": cell.arch,
              "intervention": cell.intervention, "corpus": cell.corpus,
              "options": json.dumps(cell.options, sort_keys=True), "status": "failed" if error else "ok",
              "recipe": recipe.key if recipe is not None else None,
              "recipe_json": json.dumps(recipe.to_dict(), sort_keys=True) if recipe is not None else None,
              "error": error or "", "elapsed_s": round(elapsed, 4), "versions": json.dumps(versions(), sort_keys=True),
              "worker": f"{socket.gethostname()}:{os.getpid()}",
              "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    from attnviz.sweep.measures import COLUMNS, schema

    unexpected = {k for row in rows for k in row} - set(COLUMNS[cell.measure])
    if unexpected:
        raise ValueError(f"{cell.measure} rows carry columns outside its schema: {sorted(unexpected)}")
    full = schema()
    if cell.train:
        common.update({"run": cell.train["run"], "setup": json.dumps(cell.train["setup"], sort_keys=True),
                       "axes": json.dumps(cell.train["axes"])})
        for key, value in cell.train["values"].items():
            if full.get_field_index(key) < 0:
                full = full.append(pa.field(key, pa.scalar(value).type))
    rows = [{**common, **row} for row in (rows or [{}])]
    for row in rows:  # the run's values beside the measure's own, where it has none
        for key, value in (cell.train or {}).get("values", {}).items():
            if row.get(key) is None:
                row[key] = value
    table = pa.Table.from_pylist(rows, schema=full)
    name = f"{folder}/{cell.id}{'.failed' if error else ''}.parquet"
    partial = f"{folder}/.{cell.id}.{uuid.uuid4().hex}.part"
    with filesystem.open_output_stream(partial) as stream:
        pq.write_table(table, stream)
    filesystem.move(partial, name)
    if not error:  # a success replaces an earlier failure of the same cell
        failed = f"{folder}/{cell.id}.failed.parquet"
        if filesystem.get_file_info(failed).type != fs.FileType.NotFound:
            filesystem.delete_file(failed)
    return name


def _cell_files(out: str):
    """(filesystem, the cells' files under ``out`` by path: finished and failed, never a temporary one)."""
    from pyarrow import fs

    filesystem, base = _fs(out)
    if filesystem.get_file_info(base).type == fs.FileType.NotFound:
        return filesystem, []
    infos = filesystem.get_file_info(fs.FileSelector(base, recursive=True))
    return filesystem, sorted((i for i in infos if i.base_name.endswith(".parquet") and not i.base_name.startswith(".")),
                              key=lambda i: i.path)


def done(out: str) -> set[str]:
    """The ids of the cells that finished (a failed cell is not done: it runs again)."""
    _, files = _cell_files(out)
    return {i.base_name[:-len(".parquet")] for i in files if not i.base_name.endswith(".failed.parquet")}


def read(out: str, measure: str | None = None) -> pd.DataFrame:
    """Every row of a results folder (or of one measure), failed cells included (``status``): one
    ``pyarrow.dataset`` over the cells' files, all in the one schema (:func:`.measures.schema`)."""
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    from attnviz.sweep.measures import schema

    filesystem, files = _cell_files(out)
    paths = [i.path for i in files if not measure or i.path.rsplit("/", 2)[-2] == measure]
    if not paths:
        return pd.DataFrame()
    united = schema()
    trained = [p for p in paths if not re.fullmatch(r"[0-9a-f]{16}(\.failed)?\.parquet", p.rsplit("/", 1)[-1])]
    if trained:  # a trained run's files carry its keys' columns too
        united = pa.unify_schemas([united] + [pq.read_schema(p, filesystem=filesystem) for p in trained],
                                  promote_options="permissive")
    table = ds.dataset(paths, schema=united, format="parquet", filesystem=filesystem).to_table()
    frame = table.to_pandas()
    return frame.sort_values(["measure", "cell"], kind="stable").reset_index(drop=True) if len(frame) else frame
