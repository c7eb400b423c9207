"""The documentation holds together (issue 30): the README stays a five-minute read whose test
command is the one CI runs, the design page has its numbered sections, every citation of it names
one of them, no file cites the design outside the repository, and every relative link resolves.
Reads files only: nothing is imported or built."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

SECTIONS = {
    1: "Architecture and layers",
    2: "Layout and build",
    3: "Numerics",
    4: "Ops",
    5: "The weight record and lifecycle",
    6: "Training layers",
    7: "FSDP2",
    8: "Errors",
    9: "Measuring",
    10: "Adding an op and a backend",
}

# Where code, tests and user docs live (docs/ itself may name the old file where it must).
CITING = [
    ROOT / "python",
    ROOT / "csrc",
    ROOT / "tests",
    ROOT / "examples",
    README,
    ROOT / "setup.py",
    ROOT / "CMakeLists.txt",
    ROOT / "pyproject.toml",
    ROOT / ".ci",
]
SUFFIXES = {".py", ".cpp", ".h", ".cu", ".md", ".txt", ".toml", ""}


def _files():
    for place in CITING:
        if place.is_file():
            yield place
        elif place.is_dir():
            for p in sorted(place.rglob("*")):
                if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts:
                    yield p


def _fenced_after(text: str, label: str) -> str:
    """The first line of the first fenced block after `label`."""
    after = text[text.index(label) :]
    block = re.search(r"```[a-z]*\n(.*?)\n```", after, re.S)
    return block.group(1).strip()


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/"


def test_ci_runs_the_readme_test_command():
    command = _fenced_after(README.read_text(), "**Tests**")
    ci = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert ci[-1] == command, (ci[-1], command)


def test_design_has_its_numbered_sections():
    headings = re.findall(r"^## (\d+)\. (.+)$", (DOCS / "design.md").read_text(), re.M)
    assert [(int(n), title) for n, title in headings] == list(SECTIONS.items())


def test_no_citation_of_a_design_file_outside_the_repository():
    old = "DESIGN" + ".md"  # spelled apart so that this file does not cite it
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in _files()
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if old in line
    ]
    assert not found, f"cite docs/design.md §N instead: {found}"


def test_every_design_citation_names_a_section():
    bad = []
    for p in list(_files()) + sorted(DOCS.glob("*.md")):
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            for n in re.findall(r"design\.md §(\d+)", line):
                if int(n) not in SECTIONS:
                    bad.append(f"{p.relative_to(ROOT)}:{i}: §{n}")
    assert not bad, bad


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        if not (page.parent / target).exists():
            missing.append(target)
    assert not missing, f"{page.name}: {missing}"


@pytest.mark.parametrize(
    "page, marker",
    [
        ("memory.md", "demo-table"),
        ("benchmarks.md", "bench-quant"),
        ("benchmarks.md", "bench-seed"),
    ],
)
def test_marker_blocks_live_in_the_docs(page, marker):
    text = (DOCS / page).read_text()
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    assert text.count(start) == 1 and text.count(end) == 1, (page, marker)
    assert text.index(start) < text.index(end)
    assert start not in README.read_text()
