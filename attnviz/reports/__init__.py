"""Files a researcher sends or files: the self-contained HTML report (:mod:`.html`) and the
one-command paper reproductions (:mod:`.reproduce`)."""

from __future__ import annotations

from attnviz.figures.export import write_atomic  # noqa: F401 - where the reports have always found it
