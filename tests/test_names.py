"""Names the library keeps apart (docs/layout.md): no two public classes of ``attnviz`` share a name, no module of the
library, the pages or the app's glue reads another module's private name (``other._name`` where ``other`` is an
imported attnviz module or one of its names, or ``from attnviz.x import _name``), and the effects package's docstring
names every analysis it holds."""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "attnviz"
READERS = [*sorted(PACKAGE.rglob("*.py")), *sorted((ROOT / "pages").rglob("*.py")),
           *sorted((ROOT / "ui").rglob("*.py")), ROOT / "app.py"]

ALLOWED: set[tuple[str, str]] = set()  # (the reading file, the name): none


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_module(dotted: str) -> bool:
    path = ROOT / dotted.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def private_reads(path: Path) -> list[tuple[int, str, str]]:
    """(line, what was read, the private name) for every private name ``path`` reads from another attnviz module:
    imported by name, or an attribute of a name bound by an attnviz import. A package's own private module
    (``from attnviz.core.kernel import _triton_stats`` inside ``core/kernel/``) is its package's, not a read."""
    tree = ast.parse(path.read_text())
    here = ".".join(path.relative_to(ROOT).parts[:-1]) if path.is_relative_to(ROOT) else ""
    bound, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("attnviz")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("attnviz"):
            for alias in node.names:
                own_module = _is_module(f"{node.module}.{alias.name}") and node.module == here
                if _private(alias.name) and not own_module:
                    found.append((node.lineno, f"from {node.module} import {alias.name}", alias.name))
                bound.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                found.append((node.lineno, ".".join([base.id, *reversed(chain)]), node.attr))
    return found


def test_no_module_reads_another_modules_private_name():
    reads = [f"{path.relative_to(ROOT)}:{line}: {what}" for path in READERS
             for line, what, name in private_reads(path) if (str(path.relative_to(ROOT)), name) not in ALLOWED]
    assert not reads, "make public what is shared:\n" + "\n".join(reads)


def test_the_check_sees_a_private_read(tmp_path):
    """The check itself: the forms it must catch, written out (so an empty answer above means something)."""
    source = ("from attnviz import capture\nfrom attnviz.capture import _versions\nimport attnviz.stats.metrics as m\n"
              "from attnviz.core.model import anatomy\n"
              "x = capture._versions()\ny = m._f32(1)\nz = anatomy.of(1)._cached\nw = m.f32(1)\n")
    path = tmp_path / "reader.py"
    path.write_text(source)
    names = sorted(name for _, _, name in private_reads(path))
    assert names == ["_f32", "_versions", "_versions"]  # a method's result (anatomy.of(1)._cached) is no module's


def test_no_two_public_classes_share_a_name():
    where = defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not _private(node.name):
                where[node.name].append(str(path.relative_to(ROOT)))
    shared = {name: files for name, files in where.items() if len(files) > 1}
    assert not shared, shared


def test_the_effects_docstring_names_every_analysis():
    import attnviz.effects

    doc = attnviz.effects.__doc__
    missing = [p.stem for p in (PACKAGE / "effects").glob("*.py")
               if p.stem != "__init__" and f"``{p.stem}``" not in doc]
    assert not missing, missing


#: Where ``arch`` is an architecture alone, one part of a recipe being made (its interventions, BOS control and
#: residual variant given beside it): every other function that runs a model takes its recipe as ``recipe``.
ARCH_IS_A_PART = {"of", "build", "_canonical", "capture_seq2seq"}  # the last: an encoder's architecture, no recipe


def test_a_function_that_runs_a_model_takes_its_recipe_as_recipe():
    """One name for the recipe parameter across the API (docs/layout.md): a function whose first parameter is the
    loaded model names what it runs under ``recipe``, never ``arch``."""
    arch = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in ARCH_IS_A_PART:
                params = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
                params = params[1:] if params[:1] in (["self"], ["cls"]) else params
                if params[:1] == ["loaded"] and "arch" in params:
                    arch.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not arch, arch
