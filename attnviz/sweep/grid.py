"""The grid of trained runs (docs/sweeps.md#the-grid-of-trained-runs): a results folder's emergence rows of its
training cells, one line per run (when its sink formed, its first token's attention and its quiet rows' mass at its
last checkpoint), then the runs grouped by two of the keys their ``[train]`` tables named, each group's mean and
spread (min–max) over its runs (seeds). Pure pandas: the Sweeps page draws it (:func:`attnviz.figures.sweeps.grid_figure`).

A run's sink forms at its first checkpoint where the quiet queries' attention on the first token, the mean over its
layers and heads, passes :data:`attnviz.lab.emergence.FORMED` (one half), as ``bench/lab_sink.py`` reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from attnviz.errors import InputError
from attnviz.lab.emergence import FORMED

#: what a grid cell shows, and its label
VALUES = ("sink_step", "first_token", "row_mass")
LABELS = {"sink_step": "step the sink forms", "first_token": "first token's attention at the end",
          "row_mass": "quiet rows' mass at the end"}
ALWAYS = ("kind", "arch", "seed")  # in every run's emergence rows, named or not


def _trained(frame: pd.DataFrame) -> pd.DataFrame:
    if frame.empty or "run" not in frame:
        return frame.iloc[0:0]
    return frame[(frame["measure"] == "emergence") & (frame["status"] == "ok") & frame["run"].notna()]


def axes(frame: pd.DataFrame) -> list[str]:
    """The keys a grid can be drawn over: those the ``[train]`` tables named, then kind, arch and seed."""
    rows = _trained(frame)
    named = [k for v in rows["axes"].dropna().unique() for k in json.loads(v)] if len(rows) else []
    return [k for k in dict.fromkeys([*named, *ALWAYS]) if k in rows]


def default_axes(frame: pd.DataFrame) -> tuple[str, str]:
    """Two keys to start from: those whose values differ between the runs (seed last: it is what a cell spans), then
    kind and arch."""
    keys, rows = axes(frame), _trained(frame)
    varying = [k for k in keys if rows[k].nunique(dropna=False) > 1]
    ordered = [k for k in varying if k != "seed"] + [k for k in varying if k == "seed"] + \
        [k for k in ALWAYS if k not in varying] + [k for k in keys if k not in varying and k not in ALWAYS]
    return ordered[0], ordered[1]


def runs(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per trained run: its keys' values, ``run``, its ``folder``, its last measured ``step``, the
    ``sink_step`` (None: none formed) and, at its last step, ``first_token`` and ``row_mass`` (means over layers and
    heads)."""
    rows, keys = _trained(frame), axes(frame)
    out = []
    for run, group in rows.groupby("run", sort=True):
        by_step = group.groupby("step")[["first_token", "row_mass"]].mean().sort_index()
        over = by_step.index[by_step["first_token"] > FORMED]
        first = group.iloc[0]
        out.append({**{k: first[k] for k in keys}, "run": run, "folder": str(Path(first["checkpoint"]).parent),
                    "step": int(by_step.index[-1]), "sink_step": int(over[0]) if len(over) else None,
                    "first_token": float(by_step["first_token"].iloc[-1]),
                    "row_mass": float(by_step["row_mass"].iloc[-1])})
    return pd.DataFrame(out, columns=[*keys, "run", "folder", "step", "sink_step", "first_token", "row_mass"])


def grid(frame: pd.DataFrame, row: str, col: str) -> pd.DataFrame:
    """One row per (``row`` value, ``col`` value) of the trained runs: how many runs and in how many the sink formed,
    and for each of :data:`VALUES` the mean, min and max over its runs (the sink step over the runs where it
    formed); ``names`` the runs and ``runs_folder`` the folder they are in (what the Emergence page opens)."""
    keys = axes(frame)
    for key in (row, col):
        if key not in keys:
            raise InputError(f"'{key}' is not a key of these runs ({', '.join(keys) or 'none'})")
    if row == col:
        raise InputError(f"the grid's rows and columns are both '{row}': pick two keys")
    per = runs(frame)
    out = []
    for (r, c), group in per.groupby([row, col], sort=True, dropna=False):
        formed = group["sink_step"].dropna().astype(float)
        cell = {row: r, col: c, "runs": len(group), "formed": len(formed)}
        for value in VALUES:
            numbers = formed if value == "sink_step" else group[value].astype(float)
            cell.update({f"{value}_mean": numbers.mean() if len(numbers) else None,
                         f"{value}_min": numbers.min() if len(numbers) else None,
                         f"{value}_max": numbers.max() if len(numbers) else None})
        folders = {str(Path(f).parent) for f in group["folder"]}
        cell.update({"names": list(group["run"]), "runs_folder": folders.pop() if len(folders) == 1 else None})
        out.append(cell)
    return pd.DataFrame(out)
