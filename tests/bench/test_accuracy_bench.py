"""`python -m zrw.bench accuracy --setting tiny`: it runs end to end on the stdlib's source, every
mode has its curves, release on and off give the same curves bit for bit, the gaps are computed
from the final held-out losses, and the telemetry is there for every MXFP8 mode. No figure of
quality is asserted (a few steps of a tiny model say nothing about a recipe)."""

import json
import math
import os
import subprocess
import sys

import pytest

from zrw.bench import accuracy


def test_split_is_by_file_and_fixed():
    files = accuracy.stdlib_files()
    assert len(files) > 100 and all(rel.endswith(".py") for rel, _ in files)
    assert not any("site-packages" in rel for rel, _ in files)
    train, held = accuracy.split_files(files, 10)
    assert {r for r, _ in train}.isdisjoint({r for r, _ in held})
    assert len(train) + len(held) == len(files) and 0 < len(held) < len(files) // 5
    assert accuracy.split_files(accuracy.stdlib_files(), 10) == (train, held)


def test_spread_says_when_seeds_disagree():
    s = accuracy.spread([0.5, -0.2, 0.1])
    assert not s["resolved"] and "within the seed spread" in accuracy.verdict(s, "x")
    # same sign in every seed is not enough: the mean must clear its 95% interval (t, 2 dof)
    s = accuracy.spread([0.5, 0.2, 0.1])
    assert s["mean"] == pytest.approx(0.8 / 3)
    assert s["std"] == pytest.approx(0.2081665999, rel=1e-6)
    assert s["ci95"] == pytest.approx(4.303 * s["std"] / 3**0.5)
    assert not s["resolved"] and "within the seed spread" in accuracy.verdict(s, "x")
    s = accuracy.spread([1.0, 1.1, 0.9])
    assert s["resolved"] and "above beyond the seed spread" in accuracy.verdict(s, "x")
    assert "one seed decides nothing" in accuracy.verdict(accuracy.spread([1.0]), "x")


def test_bench_accuracy_tiny(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "zrw.bench",
            "accuracy",
            "--setting",
            "tiny",
            "--json",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    c = r["config"]
    assert os.path.getsize(tmp_path / "accuracy.png") > 0
    assert json.loads((tmp_path / "accuracy.json").read_text())["summary"] == r["summary"]
    assert r["corpus"]["train_tokens"] == c["steps"] * c["batch"] * c["seq"]
    assert r["corpus"]["heldout_tokens"] == c["eval_seqs"] * c["seq"]
    modes = ["baseline", "mxfp8/floor", "mxfp8/rceil", "mxfp8-32x32/floor", "mxfp8-32x32/rceil"]
    on = {x["mode"]: x for x in r["runs"] if x["release"]}
    assert sorted(on) == sorted(modes)
    for mode, run in on.items():
        assert len(run["train_loss"]) == c["steps"]
        assert all(math.isfinite(v) for v in run["train_loss"])
        assert [s for s, _ in run["heldout"]] == [2, 4]
        assert run["final_heldout"] == run["heldout"][-1][1]
    base = on["baseline"]["final_heldout"]
    for mode in modes[1:]:
        gap = r["summary"]["gap_percent"][mode]
        assert gap["values"] == [pytest.approx(100 * (on[mode]["final_heldout"] - base) / base)]
    # release off: the same curves, bit for bit
    off = [x for x in r["runs"] if not x["release"]]
    assert len(off) == 1 and off[0]["mode"] == c["release_off"]
    assert off[0]["train_loss"] == on[c["release_off"]]["train_loss"]
    assert off[0]["heldout"] == on[c["release_off"]]["heldout"]
    assert r["summary"]["release_off"] == [
        {
            "seed": 0,
            "mode": c["release_off"],
            "train_loss_bitwise_equal": True,
            "heldout_bitwise_equal": True,
        }
    ]
    # telemetry at the first, middle and last step of every MXFP8 mode, none for the baseline
    assert on["baseline"]["telemetry"] == []
    for mode in modes[1:]:
        snaps = on[mode]["telemetry"]
        assert [s["step"] for s in snaps] == [0, 2, 3]
        tensors = {x["tensor"] for x in snaps[-1]["summary"]}
        want = {"weight", "activation", "gradient"} | (
            {"weight_bwd"} if mode.startswith("mxfp8/") else set()
        )
        assert tensors == want
        for x in snaps[-1]["summary"]:
            assert x["scale_mode"] == mode.split("/")[1]
            assert 0 < x["sqnr_db"] < 60 and 0 <= x["flushed"] < 0.01
            if x["scale_mode"] == "rceil":
                assert x["saturated"] == 0  # rceil fits every block's largest value
        layers = {x["layer"] for x in snaps[-1]["layers"]}
        assert len(layers) == 7 * c["layers"]  # q, k, v, o, gate, up, down per decoder layer


def test_results_of_other_seeds_merge(tmp_path):
    def result(seeds, steps=10):
        return {
            "config": {"seeds": seeds, "steps": steps, "out": "x"},
            "corpus": {"train_tokens": 100},
            "runs": [{"seed": s, "mode": "baseline"} for s in seeds],
        }

    paths = []
    for i, r in enumerate([result([0, 1]), result([2]), result([1]), result([3], steps=20)]):
        paths.append(str(tmp_path / f"{i}.json"))
        with open(paths[-1], "w") as fh:
            json.dump(r, fh)
    merged = accuracy.merge_results(paths[:2])
    assert merged["config"]["seeds"] == [0, 1, 2]
    assert [x["seed"] for x in merged["runs"]] == [0, 1, 2]
    with pytest.raises(ValueError, match="repeats seeds"):
        accuracy.merge_results([paths[0], paths[2]])
    with pytest.raises(ValueError, match="other settings"):
        accuracy.merge_results([paths[0], paths[3]])
