"""The demo refuses what it cannot do before it trains or writes anything: a refused run leaves
no output directory and no file behind, and its outputs are written whole (made in memory, then
written)."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("transformers")

from zrw import demo  # noqa: E402

TINY = [
    "--model",
    "dense",
    "--steps",
    "1",
    "--micro-batches",
    "1",
    "--batch",
    "1",
    "--seq",
    "16",
    "--hidden",
    "64",
    "--layers",
    "1",
    "--no-progress",
]


def _without(monkeypatch, module):
    """`import module` raises ImportError, as where it is not installed."""
    monkeypatch.setitem(sys.modules, module, None)


@pytest.mark.parametrize(
    "change",
    [["--batch", "0"], ["--seq", "-1"], ["--hidden", "0"], ["--layers", "0"], ["--steps", "0"]],
    ids=["batch", "seq", "hidden", "layers", "steps"],
)
def test_demo_refuses_a_bad_size_before_it_writes(change, tmp_path, capsys):
    out = tmp_path / "demo"
    with pytest.raises(SystemExit):
        demo.main([*TINY, *change, "--out", str(out)])
    assert change[0] in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_demo_refuses_an_out_that_is_a_file(tmp_path):
    out = tmp_path / "demo"
    out.write_text("a file")
    with pytest.raises(SystemExit):
        demo.main([*TINY, "--out", str(out)])
    assert os.listdir(tmp_path) == ["demo"] and out.read_text() == "a file"


def test_demo_without_matplotlib_is_refused_before_it_runs(tmp_path, monkeypatch, capsys):
    _without(monkeypatch, "matplotlib")
    monkeypatch.setattr(demo, "run", lambda c: pytest.fail("the demo ran before its refusal"))
    out = tmp_path / "demo"
    with pytest.raises(SystemExit):
        demo.main([*TINY, "--out", str(out)])
    assert "matplotlib" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_demo_writes_nothing_when_its_outputs_cannot_be_made(tmp_path, monkeypatch):
    """A failure while making the outputs (after the run) leaves no directory, no file."""
    pytest.importorskip("matplotlib")

    def plot_fails(summaries, path):
        raise RuntimeError("the plot failed")

    monkeypatch.setattr(demo, "run", lambda c: [])
    monkeypatch.setattr(demo, "plot", plot_fails)
    out = tmp_path / "demo"
    with pytest.raises(RuntimeError, match="the plot failed"):
        demo.main([*TINY, "--out", str(out)])
    assert os.listdir(tmp_path) == []
