"""Files a researcher sends or files: the self-contained HTML report (:mod:`.html`) and the
one-command paper reproductions (:mod:`.reproduce`)."""

from __future__ import annotations

from pathlib import Path


def write_atomic(path: str | Path, data: bytes) -> Path:
    """``data`` to ``path`` through a temporary name beside it: never a half-written file."""
    path = Path(path)
    partial = path.with_name(path.name + ".part")
    partial.write_bytes(data)
    partial.replace(path)
    return path
