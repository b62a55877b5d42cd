"""The package's layout shows its flow (docs/layout.md): no import circle among attnviz's modules, ``stats/`` is the
pure definitions (it imports nothing from ``core/``), ``core/``'s subsystems in import order, no file of the engine
(``core/engine/``) much above 300 lines and no file of the library, the pages or the app's glue above 400, and
docs/layout.md names every file."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "attnviz"
MOST_LINES = 320  # "about 300": the engine's files are read whole, one seam each
MOST_ANYWHERE = 400  # no file of attnviz/, pages/ or ui/ above it
# core/'s subsystems in import order: each imports only from itself and those before it (at module level)
CORE_ORDER = ("model", "kernel", "spec", "record", "sizing", "engine", "loading")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """attnviz modules ``path`` imports (at module level only, or anywhere)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attnviz"):
            modules = {f"{node.module}.{alias.name}" for alias in node.names  # "from attnviz.core import engine"
                       if (PACKAGE.parent / (node.module.replace(".", "/") + f"/{alias.name}.py")).exists()}
            found |= modules
            if len(modules) < len(node.names):  # a name the package itself defines
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("attnviz")}
    return found


def _graph(top_level_only: bool = True) -> dict[str, set[str]]:
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(path, top_level_only) if m in files and m != name} for name, path in files.items()}


def test_no_import_circle():
    """Not at module level, and not through an import inside a function either: such an import only hides a
    circle from the interpreter, not from the reader."""
    graph = _graph(top_level_only=False)
    state, circles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, circles


def test_stats_imports_nothing_from_core():
    for path in (PACKAGE / "stats").glob("*.py"):
        assert not {m for m in _imports(path, top_level_only=False) if m.startswith("attnviz.core")}, path


def test_the_engine_files_are_read_whole():
    long = {p.name: n for p in (PACKAGE / "core" / "engine").glob("*.py")
            if (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert not long, long


def test_no_file_is_above_400_lines():
    long = {str(p.relative_to(ROOT)): n for folder in ("attnviz", "pages", "ui") for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MOST_ANYWHERE}
    assert not long, long


def test_core_is_subpackages_in_import_order():
    """core/ holds no module of its own but its subsystems' packages, each with a docstring that says what it holds,
    and each imports (at module level) only from itself and the subsystems before it."""
    core = PACKAGE / "core"
    assert {p.name for p in core.glob("*.py")} == {"__init__.py"}
    assert {p.name for p in core.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(CORE_ORDER)
    graph = _graph(top_level_only=True)
    for rank, sub in enumerate(CORE_ORDER):
        package = core / sub
        assert ast.get_docstring(ast.parse((package / "__init__.py").read_text())), sub
        allowed = {f"attnviz.core.{s}" for s in CORE_ORDER[:rank + 1]}
        for path in package.glob("*.py"):
            upward = {m for m in graph[_module(path)] if m.startswith("attnviz.core.")
                      and not any(m == a or m.startswith(a + ".") for a in allowed)}
            assert not upward, (path.name, upward)


def test_docs_layout_names_every_file():
    text = (ROOT / "docs" / "layout.md").read_text()
    missing = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if p.name != "__init__.py" and str(p.relative_to(PACKAGE)) not in text and f"`{p.name}`" not in text]
    assert not missing, missing


# The package order of docs/layout.md: a module imports (anywhere, inside a function too) only from its own rank and
# the ranks before it. The modules the order leaves unnamed take the rank of what they are: the settings beside the
# errors, the access rules after core/ (what a visitor may load, from the cache directory), the capture's type beside
# the capture, the doctor and the support table beside the reports (they run every capability), ``python -m attnviz``
# beside the command line, and the package's one-line API (``attnviz/__init__.py``) above everything, as its front.
ORDER = (
    ("errors", "defaults", "options", "corpus", "settings"),
    ("stats",),
    ("core",),
    ("recipe", "access"),
    ("tokens",),
    ("plan",),
    ("capture", "captured", "kv"),
    ("regions", "seq2seq", "effects", "flow", "lab"),
    ("figures", "sweep"),
    ("viewer",),
    ("reports", "doctor", "support"),
    ("cli", "__main__"),
    ("attnviz",),
)
RANK = {package: rank for rank, packages in enumerate(ORDER) for package in packages}


def _package(module: str) -> str:
    """The package of the order a module belongs to: ``attnviz.core.engine.run`` → core, ``attnviz.plan`` → plan."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((module, imported) for module, imports in graph.items() for imported in imports
                  if RANK[_package(imported)] > RANK[_package(module)])


def _version_only(path: Path) -> bool:
    """Whether every import of the package's front (``attnviz/__init__.py``) in ``path`` takes its version alone:
    package metadata, not an import of what the front gathers."""
    nodes = [n for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.ImportFrom) and n.module == "attnviz"]
    return all({a.name for a in n.names} <= {"__version__"} | {p.stem for p in PACKAGE.iterdir()} for n in nodes)


def _package_graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = _graph(top_level_only=False)
    for name, imports in graph.items():
        if "attnviz" in imports and _version_only(files[name]):
            imports.discard("attnviz")
    return graph


def test_every_package_has_its_place_in_the_order():
    assert {_package(m) for m in _graph()} <= set(RANK), {_package(m) for m in _graph()} - set(RANK)
    layout = (ROOT / "docs" / "layout.md").read_text()
    named = [p for rank in ORDER[:-1] for p in rank if p != "__main__"]
    assert all(f"`{p}" in layout for p in named), [p for p in named if f"`{p}" not in layout]


def test_no_import_runs_up_the_package_order():
    """No module of a lower package imports a higher one, at module level or inside a function (docs/layout.md)."""
    upward = _upward(_package_graph())
    assert not upward, upward


def test_an_upward_import_is_caught_even_inside_a_function(tmp_path):
    """The check itself: a kernel module that imports flow/ inside a function is an upward import."""
    graph = {name: set(imports) for name, imports in _package_graph().items()}
    graph["attnviz.core.kernel.kernels"].add("attnviz.flow.contributions")
    assert ("attnviz.core.kernel.kernels", "attnviz.flow.contributions") in _upward(graph)
    source = tmp_path / "attnviz" / "core" / "kernel" / "planted.py"
    source.parent.mkdir(parents=True)
    source.write_text("def f():\n    from attnviz.flow import contributions\n    return contributions\n")
    assert "attnviz.flow.contributions" in _imports(source, top_level_only=False)


def test_the_library_reads_no_environment_but_its_settings():
    """The settings are read at the edge (attnviz/settings.py: the CLI, the app, the doctor) and passed down: no
    other library module reads ``os.environ`` or ``getenv``, and none under core/."""
    import re

    reads = re.compile(r"os\.environ|getenv|environ\.get|environ\[")
    found = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
             if p.name != "settings.py" and reads.search(p.read_text())]
    assert not found, found
