"""The package's layout shows its flow (docs/layout.md): no import circle among attnviz's modules, ``stats/`` is the
pure definitions (it imports nothing from ``core/``), and no file of the engine (``core/``) is much above 300 lines."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "attnviz"
MOST_LINES = 320  # "about 300": the engine's files are read whole, one seam each


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
    long = {p.name: n for p in (PACKAGE / "core").glob("*.py") if (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert not long, long
