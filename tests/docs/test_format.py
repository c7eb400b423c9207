"""The tree is formatted: `ruff format` for Python, `clang-format` (the repository's
.clang-format) for C++. Both tools come with the test extras (pyproject.toml), so CI fails on
unformatted code. To fix: `ruff format` and `clang-format -i $(git ls-files 'csrc/*')`."""

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tracked(*patterns):
    out = subprocess.run(
        ["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return out


def test_python_is_ruff_formatted():
    assert shutil.which("ruff"), "ruff is a test dependency (pip install -e '.[test]')"
    r = subprocess.run(["ruff", "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"unformatted (run `ruff format`):\n{r.stdout}{r.stderr}"


def test_cpp_is_clang_formatted():
    assert shutil.which("clang-format"), "clang-format is a test dependency (the [test] extra)"
    files = _tracked("csrc/*.cpp", "csrc/*.h")
    assert files, "no C++ sources found (git ls-files csrc)"
    r = subprocess.run(
        ["clang-format", "--dry-run", "--Werror", *files], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, (
        f"unformatted (run `clang-format -i $(git ls-files 'csrc/*')`):\n{r.stderr[-4000:]}"
    )
