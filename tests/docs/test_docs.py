"""The documentation holds together: the README stays a five-minute read whose test
command is the one CI runs, the design page has its numbered sections, every citation of it or of
the NPU page names one of their sections, no file outside docs/ cites anything outside the
repository, and every relative link resolves. Reads files only (the list of tracked files comes
from git where there is one): nothing is imported or built."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def _tracked():
    """Every file git tracks (the walk of CITING where there is no git checkout)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return list(_files())
    return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


# What no file outside docs/ may mention: the files and notes that lived beside the repository
# (spelled apart so that this file does not mention them). docs/ cites its own pages instead.
OUTSIDE = [
    ("shared/" + "reference", False),
    ("../" + "shared", False),
    ("reference " + "notes", True),  # any case
    ("DESIGN" + ".md", False),
    ("STYLE" + ".md", False),
]


def test_nothing_outside_docs_cites_a_file_outside_the_repository():
    found = []
    for p in _tracked():
        rel = p.relative_to(ROOT)
        if rel.parts[0] == "docs":
            continue
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            for word, any_case in OUTSIDE:
                if word.lower() in line.lower() if any_case else word in line:
                    found.append(f"{rel}:{i}: {word}")
    assert not found, f"cite docs/design.md §N or docs/npu.md §N.M instead: {found}"


def _npu_sections():
    text = (DOCS / "npu.md").read_text()
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", text, re.M))


def test_npu_page_has_numbered_sections():
    sections = _npu_sections()
    # the torch_npu facts the adapter relies on (§5) are what csrc/npu and tests/npu cite
    assert {"5", "5.1", "5.2", "5.3", "5.4", "5.5", "5.6", "5.7"} <= sections, sorted(sections)


def test_every_npu_citation_names_a_section():
    sections = _npu_sections()
    # `docs/npu.md §5.3`, also across a comment's line break, and `[npu.md](npu.md) §4` in docs/
    cite = re.compile(r"npu\.md\)?(?:\s|//|#)*§(\d+(?:\.\d+)*)")
    bad, seen = [], 0
    for p in _tracked():
        if p.suffix not in SUFFIXES:
            continue
        text = p.read_text(errors="replace")
        for m in cite.finditer(text):
            seen += 1
            if m.group(1) not in sections:
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{p.relative_to(ROOT)}:{line}: §{m.group(1)}")
    # the page's own cross-references (§6.1), not those of design.md's sections
    page = (DOCS / "npu.md").read_text()
    for m in re.finditer(r"(?<!design\.md\) )(?<!design\.md )§(\d+(?:\.\d+)*)", page):
        if m.group(1) not in sections:
            bad.append(f"docs/npu.md:{page.count(chr(10), 0, m.start()) + 1}: §{m.group(1)}")
    assert seen, "no docs/npu.md §N citation found: is the pattern still right?"
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


_HISTORY = re.compile(r"issue [0-9]+|\bsessions?\b", re.IGNORECASE)


def test_the_product_speaks_of_features_not_of_tracker_issues_or_sessions():
    """Code, docs, tests and messages name features and behaviours; history belongs in git."""
    found = []
    for top in ("docs", "python", "csrc", "tests", "README.md"):
        base = ROOT / top
        paths = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for path in paths:
            if path.suffix not in (".py", ".md", ".h", ".cpp", ".txt", ".toml", ""):
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            for n, line in enumerate(text.splitlines(), 1):
                if _HISTORY.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not found, "\n".join(found)
