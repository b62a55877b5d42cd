"""The definitions live in the repository (docs/): every docs link in the code, the pages, the README and
the docs resolves to a heading; every function and test that docs/methods.md names exists; nothing cites
a tracker number or the old reference document."""

import importlib
import re
import subprocess
import sys
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


def section(text: str, heading: str) -> str:
    """The lines under a `## heading` of a Markdown text, up to the next `## `."""
    lines = text.splitlines()
    start = lines.index(f"## {heading}") + 1
    stop = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start:stop])


def table(text: str, header: str) -> list[list[str]]:
    """The cells of the Markdown table under ``header`` (its first line), one list a row."""
    lines = text.splitlines()
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("| "):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def registered_pages() -> dict[str, str]:
    """Each page app.py registers: its title -> its file's stem (pages/<stem>.py); every file in pages/ is one."""
    app = (ROOT / "app.py").read_text()
    found = dict(re.findall(r'st\.Page\([^\n]*?"(\w+)\.py"[^\n]*?title="([^"]+)"', app))
    assert sorted(found) == sorted(p.stem for p in (ROOT / "pages").glob("*.py")), found
    return {title: stem for stem, title in found.items()}


def test_every_command_is_documented_and_listed():
    """Each registered command has its row in docs/cli.md's table (and the table no other), and the README's
    command-line section names it."""
    from attnviz.cli import COMMANDS

    rows = table((ROOT / "docs" / "cli.md").read_text(), "| command | what it does | where it is described |")
    assert [row[0] for row in rows] == [f"`{name}`" for name in COMMANDS]
    assert all("](" in row[2] for row in rows), "each row links where the command is described"
    listed = section((ROOT / "README.md").read_text(), "Command line")
    assert not [name for name in COMMANDS if f"`{name}`" not in listed]


def test_the_readme_shows_every_page():
    """The README's page table has one row per registered page (and no other), each linking that page's
    screenshot, a PNG in assets/screenshots/ that scripts/screenshots.py makes; docs/app.md describes each."""
    spec = importlib.util.spec_from_file_location("screenshots", ROOT / "scripts" / "screenshots.py")
    shots = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec.loader.exec_module(shots)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    pages = registered_pages()
    readme = (ROOT / "README.md").read_text()
    rows = table(readme, "| page | what it answers | screenshot |")
    assert sorted(row[0] for row in rows) == sorted(pages)
    for title, _, shot in rows:
        stem = pages[title]
        assert shot == f"[{stem}](assets/screenshots/{stem}.png)", (title, shot)
        assert (ROOT / "assets" / "screenshots" / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", stem
    assert sorted(shots.PAGES) == sorted(pages.values())
    assert readme.count("scripts/screenshots.py") == 1
    described = table((ROOT / "docs" / "app.md").read_text(), "| page | what it shows |")
    assert sorted(row[0] for row in described) == sorted(pages)


def test_the_findings_are_a_short_part_of_the_readme():
    """The README's findings: at most ten lines, at most 15 % of its words, each with a number and a link into
    docs/findings.md; every finding there is linked, and each has its command and what was not measured."""
    readme = (ROOT / "README.md").read_text()
    findings = section(readme, "Findings")
    lines = [line for line in findings.splitlines() if line.startswith("- ")]
    assert 0 < len(lines) <= 10
    assert len(findings.split()) <= 0.15 * len(readme.split()), (len(findings.split()), len(readme.split()))
    for line in lines:
        assert "](docs/findings.md#" in line and re.search(r"\d", line.split("](")[-1]), line
    document = (ROOT / "docs" / "findings.md").read_text()
    headings_ = [line[3:] for line in document.splitlines() if line.startswith("## ")]
    assert headings_ and not [h for h in headings_ if f"docs/findings.md#{anchor(h)})" not in findings]
    for heading in headings_:
        body = section(document, heading)
        assert "**Command:**" in body and "**Not measured" in body, heading


def test_the_support_table_matches_the_code():
    """docs/support.md is what the code says of every family (scripts/support_table.py makes it)."""
    spec = importlib.util.spec_from_file_location("support_table", ROOT / "scripts" / "support_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "support.md").read_text() == module.text(), \
        "docs/support.md is out of date: run .venv/bin/python scripts/support_table.py"
