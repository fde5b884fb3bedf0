"""docs/architecture.md stays a map: short, its layer diagram names every package of autopar/, and it
links every deep dive in docs/design/. Reads the tree and the docs at test time; starts no process."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_LINES = 450


def _packages() -> list[str]:
    """Every package under autopar/ (a directory with an __init__.py), as a path relative to autopar/
    ("" for autopar itself, "passes/search" for a subpackage)."""
    base = ROOT / "autopar"
    return sorted(str(init.parent.relative_to(base)).replace("\\", "/").replace(".", "")
                  for init in base.rglob("__init__.py"))


def _diagram() -> str:
    """The first fenced block after the "## Layers" heading."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text.split("\n## Layers\n", 1)
    assert len(section) == 2, "docs/architecture.md has no '## Layers' section"
    block = re.search(r"^```[^\n]*\n(.*?)^```", section[1], re.S | re.M)
    assert block, "the '## Layers' section of docs/architecture.md has no fenced diagram"
    return block.group(1)


def _named(diagram: str, package: str) -> bool:
    """A package is named as its path from autopar/ followed by '/', not as the tail of a longer path
    (``rules/`` alone does not name ``ir/rules``... unless written ``ir/rules/``)."""
    name = "autopar/" if not package else package + "/"
    return re.search(r"(?<![\w/.])" + re.escape(name) + r"(?!\w)", diagram) is not None


def test_the_layer_diagram_names_every_package():
    diagram = _diagram()
    packages = _packages()
    assert "passes/search" in packages and "" in packages  # the walk found the tree
    missing = [p or "autopar" for p in packages if not _named(diagram, p)]
    assert not missing, (f"docs/architecture.md's layer diagram does not name the packages {missing}: "
                         f"add each as 'path/' (its path from autopar/, ending in '/')")


def test_a_package_missing_from_a_diagram_is_reported():
    diagram = "autopar/ cli/ passes/search/ rules/"
    assert _named(diagram, "passes/search")
    assert not _named(diagram, "passes")  # only the tail of passes/search/
    assert not _named(diagram, "ir/rules")  # rules/ alone is not ir/rules/
    assert not _named(diagram, "search")


def test_architecture_is_at_most_450_lines():
    lines = ARCHITECTURE.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"docs/architecture.md has {lines} lines; move depth to docs/design/"


def test_every_design_file_is_linked_from_architecture():
    text = ARCHITECTURE.read_text(encoding="utf-8")
    designs = sorted(p.name for p in (ROOT / "docs" / "design").glob("*.md"))
    assert designs, "docs/design/ has no deep dive"
    unlinked = [name for name in designs if f"(design/{name})" not in text]
    assert not unlinked, f"docs/architecture.md links no {unlinked}"
