"""The one list of what ``attnviz doctor`` runs, in order (:data:`FAMILIES`), and :func:`run`, which runs it into a
:class:`~attnviz.doctor.report.Report`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from attnviz.core.loading.models import LoadedModel
from attnviz.doctor import fused, routes
from attnviz.doctor.compare import EQUIVALENCE_TOKENS, text_of, tolerance
from attnviz.doctor.layers import layer_count
from attnviz.doctor.machine import environment
from attnviz.doctor.pages import capabilities
from attnviz.doctor.report import Check, Report
from attnviz.doctor.timing import speed


def equivalence(loaded: LoadedModel, text: str) -> list[Check]:
    """Every route that can run here, layer by layer with the same layer input, against stock eager attention
    or the statistics' definitions; and the whole forward in float32 (see :mod:`attnviz.doctor`)."""
    model = loaded.model
    if layer_count(model) != loaded.n_layers:  # the anatomy's probe forward, made before any layer input is fed
        return [Check("equivalence", "SKIP", detail=f"cannot find the {loaded.n_layers} decoder layers of "
                                                    f"{type(model).__name__} to feed them the same input")]
    limit, why = tolerance(model.dtype)
    checks, cap, ours = routes.block_engine(loaded, text, limit, why)
    checks += routes.top_layer(loaded, text, limit, why)
    checks += routes.block_statistics(loaded, text, cap, ours, limit, why)
    checks += fused.fused_kernel(loaded, limit, why)
    checks.append(routes.float32_end_to_end(loaded, text))  # last: the model is cast for it
    return checks


@dataclass(frozen=True)
class Family:
    """One family of checks: what the progress line says (``{n}``: the tokens), how many tokens of text it reads
    (from the model and the ``tokens`` asked of :func:`run`), and the checks, from the model and that text."""

    say: str
    tokens: Callable[[LoadedModel, int], int]
    checks: Callable[[LoadedModel, str], list[Check]]


def _short(loaded: LoadedModel, asked: int) -> int:
    return EQUIVALENCE_TOKENS


def _long(loaded: LoadedModel, asked: int) -> int:
    return min(asked, loaded.max_tokens)


def _speed(loaded: LoadedModel, text: str) -> list[Check]:
    return speed(loaded, text, loaded.model.device.type)


FAMILIES: tuple[Family, ...] = (
    Family("equivalence on {n} tokens", _short, equivalence),
    Family("score attribution, patch and routes", _short, capabilities),
    Family("speed on {n} tokens", _long, _speed),
)


def run(loaded: LoadedModel, tokens: int = 4096, progress=None) -> Report:
    """The whole report (see :mod:`attnviz.doctor`) for a loaded model on its device: every family of
    :data:`FAMILIES` in order, the speed on a ``tokens``-long text (at most the model's own limit)."""
    say = progress or (lambda message: None)
    report = Report(environment(loaded))
    for family in FAMILIES:
        n = family.tokens(loaded, tokens)
        say(family.say.format(n=n))
        report.checks += family.checks(loaded, text_of(loaded, n))
    return report
