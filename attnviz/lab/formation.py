"""Head classes over training (docs/methods.md#order-of-formation): each checkpoint's induction, previous-token and
duplicate-token scores on repeated random tokens and its dormant heads (:mod:`attnviz.effects.induction`), as the
emergence table's columns, and the first step each class holds per head: the order in which the classes form.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from attnviz.effects import induction
from attnviz.stats import metrics

SCORES = induction.SCORES
#: the emergence table's columns this module adds, in order (docs/methods.md#emergence-measures)
COLUMNS = (*(c for s in SCORES for c in (s, f"{s}_baseline")), "quiet_key0", "dormant_ratio", "sink_head",
           *(f"{s}_head" for s in SCORES), "dormant")
#: each class and the column that says it holds
CLASSES = {"sink": "sink_head", **{s: f"{s}_head" for s in SCORES}, "dormant": "dormant"}


def repeat_length(loaded, longest: int = induction.LENGTH) -> int:
    """L of the repeated tokens: ``longest``, or less where 2L + 1 tokens would pass the model's positions."""
    return max(2, min(longest, (loaded.max_tokens - 1) // 2))


def vocabulary(setup: dict | None):
    """The ids a checkpoint's repeated tokens draw from: its task's ordinary tokens (Bigram-Backcopy's leave the
    triggers out), else None (the tokenizer's ordinary vocabulary, :func:`attnviz.effects.induction.ordinary_ids`)."""
    if not (setup or {}).get("task"):
        return None
    from attnviz.lab.train import Setup

    task = Setup.from_dict(setup).task
    return task.ordinary.numpy() if hasattr(task, "ordinary") else None


def columns(loaded, probe, recipe="fwd", eps: float = metrics.SINK_EPS, setup: dict | None = None,
            samples: int = induction.SAMPLES) -> dict[tuple[int, int], dict]:
    """Per (layer, head) the columns of :data:`COLUMNS` but ``sink_head`` (the table's alpha0 decides it): the scores
    on repeated random tokens, and the dormancy on ``probe``'s queries that need no attention against those that do
    (the lab task's own), or, where the probe marks none as needing attention (a text), on the repeated tokens' first
    copy against their second."""
    scores = induction.repeated(loaded, recipe, repeat_length(loaded), samples, eps=eps, vocabulary=vocabulary(setup))
    quiet_key0, ratio = scores["quiet_key0"], scores["dormant_ratio"]
    quiet = probe.quiet.numpy().copy()
    quiet[:, 0] = False
    active = ~probe.quiet.numpy()
    active[:, 0] = False
    if quiet.any() and active.any():
        found = [induction.dormancy(probs, outputs, quiet, active)
                 for probs, _, outputs in induction.maps_and_outputs(loaded, probe.ids, recipe)]
        quiet_key0, ratio = np.array([f[0] for f in found]), np.array([f[1] for f in found])
        scores = replace(scores, values={**scores.values, "quiet_key0": quiet_key0, "dormant_ratio": ratio})
    dormant = scores.holds("dormant")
    out = {}
    for layer, head in np.ndindex(quiet_key0.shape):
        row = {name: float(scores[name][layer, head]) for name in COLUMNS[:len(SCORES) * 2]}
        row.update(quiet_key0=float(quiet_key0[layer, head]), dormant_ratio=float(ratio[layer, head]),
                   dormant=bool(dormant[layer, head]),
                   **{f"{s}_head": bool(scores.holds(s)[layer, head]) for s in SCORES})
        out[layer, head] = row
    return out


def holds(frame, tau: float = induction.TAU, eps: float = metrics.SINK_EPS, share: float = induction.SHARE):
    """The table's class columns (:data:`CLASSES`) again under other thresholds: sink alpha0 > eps, a score >= tau,
    dormant quiet_key0 > eps and dormant_ratio < share."""
    frame = frame.copy()
    frame["sink_head"] = frame["alpha0"].fillna(0.0) > eps
    for name in SCORES:
        frame[f"{name}_head"] = frame[name].fillna(-1.0) >= tau
    frame["dormant"] = (frame["quiet_key0"].fillna(0.0) > eps) & (frame["dormant_ratio"].fillna(np.inf) < share)
    return frame


def first_steps(frame, **thresholds):
    """(layer, head, class, step): the first checkpoint at which each class holds for each head (a head that never
    holds one has no row for it), under the table's thresholds or those given (:func:`holds`)."""
    import pandas as pd

    frame = holds(frame, **thresholds) if thresholds else frame
    rows = []
    for name, column in CLASSES.items():
        held = frame[frame[column].astype(bool)]
        for (layer, head), steps in held.groupby(["layer", "head"])["step"]:
            rows.append({"layer": int(layer), "head": int(head), "class": name, "step": int(steps.min())})
    return pd.DataFrame(rows, columns=["layer", "head", "class", "step"]).sort_values(
        ["step", "layer", "head"], ignore_index=True)


def order(frame, **thresholds):
    """(layer, class, step, head): per layer, the first step any of its heads holds each class and that head, in the
    order the classes form."""
    found = first_steps(frame, **thresholds)
    firsts = found.sort_values(["step", "head"]).groupby(["layer", "class"], as_index=False).first()
    return firsts[["layer", "class", "step", "head"]].sort_values(["layer", "step", "class"], ignore_index=True)
