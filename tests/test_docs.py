"""The definitions live in the repository (docs/): every docs link in the code, the pages, the README and
the docs resolves to a heading; every function and test that docs/methods.md names exists; nothing cites
a tracker number or the old reference document."""

import importlib
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"(docs/[a-z_-]+\.md|(?<![/\w])[a-z_-]+\.md)(#[a-z0-9-]+)?")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def headings(path: Path) -> set[str]:
    return {anchor(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def sources() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    return [ROOT / f for f in listed if f.endswith((".py", ".md", ".js", ".toml", ".sh")) and (ROOT / f).is_file()]


def test_every_docs_link_resolves_to_a_heading():
    broken, seen = [], 0
    for path in sources():
        text = path.read_text(errors="replace")
        for match in LINK.finditer(text):
            name, fragment = match.group(1), match.group(2)
            if name.startswith("docs/"):
                target = ROOT / name
            elif path.parent.name == "docs":
                target = path.parent / name
            else:
                continue
            if not target.exists():
                if name.startswith("docs/") or path.parent.name == "docs":
                    broken.append(f"{path.relative_to(ROOT)}: {name} does not exist")
                continue
            seen += 1
            if fragment and fragment[1:] not in headings(target):
                broken.append(f"{path.relative_to(ROOT)}: {name}{fragment} is no heading of {name}")
    assert seen > 100 and not broken, "\n".join(broken)


def test_methods_name_functions_and_tests_that_exist():
    text = (ROOT / "docs" / "methods.md").read_text()
    missing = []
    for path, name in set(re.findall(r"`(tests/test_\w+\.py)::(\w+)`", text)) | {
            (f"tests/{p}", n) for p, n in re.findall(r"`(?:tests/)?(test_\w+\.py)`?[^`\n]*?`::(\w+)`", text)}:
        if f"def {name}(" not in (ROOT / path).read_text():
            missing.append(f"{path}::{name}")
    for dotted in set(re.findall(r"`(attnviz(?:\.\w+)+)`", text)):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(dotted)
            break
    assert not missing, missing


@pytest.mark.parametrize("pattern", ["SPEC" + " §", r"\b[Ii]ssue" + r" #?\d+"])
def test_no_tracker_numbers_or_old_citations(pattern):
    hits = [f"{p.relative_to(ROOT)}:{i + 1}" for p in sources()
            for i, line in enumerate(p.read_text(errors="replace").splitlines()) if re.search(pattern, line)]
    assert not hits, hits


def test_each_page_links_its_definitions():
    from ui.docs import headings

    known = headings()
    for page in sorted((ROOT / "pages").glob("*.py")):
        if page.stem == "definitions":
            continue
        calls = re.findall(r"^definitions\((.*)\)$", page.read_text(), re.M)
        assert calls, f"{page.name} links no definitions"
        for name in re.findall(r'"([a-z0-9-]+)"', calls[0]) + re.findall(r"definitions#([a-z0-9-]+)", page.read_text()):
            assert name in known, f"{page.name}: no section '{name}' in docs/methods.md"


def test_the_definitions_page_renders_the_document(tmp_path):
    from test_app import app_test, on_page

    at = app_test(tmp_path)
    at.run()
    on_page(at, "pages/definitions.py")
    assert not at.exception
    text = " ".join(m.value for m in at.markdown)
    assert "## Sink metrics" in text and "### Auto key" in text and "tests/test_metrics.py" in text


def test_the_readme_says_what_is_true():
    """The number of commands it names, its screenshots shown once, and what each heatmap view sends."""
    from attnviz.cli import COMMANDS

    readme = (ROOT / "README.md").read_text()
    words = {14: "Fourteen", 15: "Fifteen", 16: "Sixteen", 17: "Seventeen", 18: "Eighteen", 19: "Nineteen", 20: "Twenty"}
    assert f"{words[len(COMMANDS)]} commands" in readme
    for shot in ("heatmaps", "shifting", "sinks", "effects"):
        assert readme.count(f"assets/screenshots/{shot}.png") == 1, shot
    assert readme.count("scripts/screenshots.py") == 1
    assert "instant viewer" in readme and "docs/viewer.md" in readme


def test_the_readme_lists_every_page():
    """Every page app.py registers has its row in the README's page table, and the table has no other."""
    pages = re.findall(r'st\.Page\([^\n]*title="([^"]+)"', (ROOT / "app.py").read_text())
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("| page | what it shows |") + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("| "):
            break
        rows.append(line.split("|")[1].strip())
    assert len(pages) == 13 and sorted(rows) == sorted(pages), (pages, rows)


def test_the_support_table_matches_the_code():
    """docs/support.md is what the code says of every family (scripts/support_table.py makes it)."""
    spec = importlib.util.spec_from_file_location("support_table", ROOT / "scripts" / "support_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "support.md").read_text() == module.text(), \
        "docs/support.md is out of date: run .venv/bin/python scripts/support_table.py"
