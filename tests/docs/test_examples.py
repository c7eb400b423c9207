"""The documented examples run as they are (examples/, docs/training.md): the custom layer on
zrw's ops trains, releases 2 bytes per weight element every step, and its losses and final
weights with release on equal release off bit for bit."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_custom_layer_example():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "custom_layer.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "release on vs off, losses and final weights bit for bit: True" in text, text
    m = re.search(r"released per step: \[([\d, ]+)\] for (\d+) weight elements", text)
    assert m, text
    per_step = [int(v) for v in m.group(1).split(",")]
    elements = int(m.group(2))
    assert per_step == [2 * elements] * len(per_step) and len(per_step) == 4
    assert "release off: [0, 0, 0, 0]" in text
