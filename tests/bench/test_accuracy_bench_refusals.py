"""`python -m zrw.bench accuracy` refuses what it cannot do before it trains or writes anything:
a refused run leaves no output directory and no file behind, and its outputs are written whole
(made in memory, then written)."""

from __future__ import annotations

import os
import sys

import pytest

from zrw.bench import accuracy


def _without(monkeypatch, module):
    """`import module` raises ImportError, as where it is not installed."""
    monkeypatch.setitem(sys.modules, module, None)


def test_accuracy_bench_refuses_before_it_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(accuracy, "run", lambda *a, **k: pytest.fail("the benchmark ran"))
    out = tmp_path / "acc"
    out.write_text("a file")
    with pytest.raises(SystemExit):
        accuracy.main(["--setting", "tiny", "--out", str(out), "--no-progress"])
    assert "--out" in capsys.readouterr().err and out.read_text() == "a file"
    _without(monkeypatch, "matplotlib")
    with pytest.raises(SystemExit):
        accuracy.main(["--setting", "tiny", "--out", str(tmp_path / "new"), "--no-progress"])
    assert "matplotlib" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["acc"]


def test_accuracy_bench_writes_nothing_when_its_outputs_cannot_be_made(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(accuracy, "run", lambda *a, **k: {"runs": []})
    monkeypatch.setattr(accuracy, "summarize", lambda *a, **k: {})

    def plot_fails(r, path):
        raise RuntimeError("the plot failed")

    monkeypatch.setattr(accuracy, "plot", plot_fails)
    with pytest.raises(RuntimeError, match="the plot failed"):
        accuracy.main(["--setting", "tiny", "--out", str(tmp_path / "acc"), "--no-progress"])
    assert os.listdir(tmp_path) == []
