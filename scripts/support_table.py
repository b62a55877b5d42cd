"""Write docs/support.md: which capability works on which decoder family, asked of the code on tiny random
configs of every family (tests/tiny.py). tests/test_docs.py checks that the file matches the code.

Usage: .venv/bin/python scripts/support_table.py
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

HEAD = """# Which capability works on which model family

Made by `scripts/support_table.py` from the code itself (`attnviz/support.py`), on tiny random configs of every
decoder family transformers builds that the conformance tests cover (`tests/tiny.py`); `tests/test_docs.py` fails
when this file and the code disagree. ✓: the capability runs and equals stock transformers with hand-written
hooks (`tests/test_conformance.py`); otherwise the one line it refuses the family with. The model anatomy
(`attnviz/core/model/anatomy.py`, [docs/methods.md](methods.md#the-model-anatomy)) is where a family is taught: nothing
here is a list of family names. Heads, streaming, compression, evaluation, generation and sweeps read the maps,
so they work wherever the maps do.

"""


def families() -> dict:
    import tiny

    return {kind: tiny.loaded(kind) for kind in tiny.FAMILIES}


def text() -> str:
    from attnviz.support import table

    return HEAD + table(families())


if __name__ == "__main__":
    (ROOT / "docs" / "support.md").write_text(text())
    print("wrote docs/support.md")
