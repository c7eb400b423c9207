"""The main job (zrw.demo) at its smallest settings: it runs end to end, writes the table's
JSON and the PNG, and shows what the README promises — the same loss bit for bit with and
without release, and a forward/backward-window saving equal to the BF16 bytes released."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from zrw import demo  # noqa: E402

# The demo at its smallest: 2 steps of 2 micro-batches of 2 sequences of 32 tokens, 1 layer of 64
# (and the default 4 experts in the MoE).
TINY = dict(steps=2, micro_batches=2, batch=2, seq=32, hidden=64, layers=1, vocab=128)
TINY["progress"] = False


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8-32x32"])
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_saving_equals_released_bytes_and_losses_match(model, recipe):
    c = demo.DemoConfig(model=model, recipe=recipe, **TINY)
    (s,) = demo.run(c)
    assert s["losses_bitwise_equal_release_on_off"], s["losses"]
    assert s["loss_diff_release_on_off"] == 0.0
    assert s["weights_equal_release_on_off"]
    released = s["bf16_bytes_released"]
    # Every converted weight is released: the theory's 2N bytes exactly.
    assert released == s["theoretical_saving_2N_bytes"] > 0
    assert abs(s["measured_saving_bytes"] - released) <= 0.02 * released, s
    # The BF16-free step saves 2N at the step's global peak and in the optimizer step, also
    # where the optimizer step is the peak (FP32 masters and Adam moments on a tiny model); the
    # seed's restore saves less in the optimizer step (the FP8 copies live through it).
    theory = s["theoretical_saving_2N_bytes"]
    assert abs(s["global_peak_saving_bytes"]["zrw"] - theory) <= 0.01 * theory, s
    assert abs(s["optimizer_peak_saving_bytes"]["zrw"] - theory) <= 0.01 * theory, s
    assert s["optimizer_peak_saving_bytes"]["zrw-restore"] < 0.9 * theory
    # The MX modes stay close to BF16 on this short run.
    assert abs(s["loss_diff_to_bf16"]["zrw"]) < 0.05 * s["final_loss"]["bf16"]


def test_entry_point_writes_json_and_png(tmp_path):
    out = tmp_path / "demo"
    args = [
        "--model",
        "dense",
        "--steps",
        "1",
        "--micro-batches",
        "1",
        "--batch",
        "2",
        "--seq",
        "32",
        "--hidden",
        "64",
        "--layers",
        "1",
        "--out",
        str(out),
        "--json",
        "--no-progress",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "zrw.demo", *args], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert os.path.getsize(out / "demo.png") > 10_000
    with open(out / "demo.json") as f:
        assert json.load(f)["models"][0]["model"] == "dense"
    (s,) = report["models"]
    for key in (
        "final_loss",
        "loss_diff_to_bf16",
        "loss_diff_release_on_off",
        "window_peak_bytes",
        "optimizer_peak_bytes",
        "global_peak",
        "bf16_bytes_released",
        "theoretical_saving_2N_bytes",
        "measured_saving_bytes",
        "global_peak_saving_bytes",
        "optimizer_peak_saving_bytes",
        "seconds_per_step",
        "losses",
        "timeline",
    ):
        assert key in s, key
    assert set(s["final_loss"]) == {"bf16", "cache", "zrw-restore", "zrw"}
    assert s["loss_diff_release_on_off"] == 0.0
    assert s["global_peak"]["zrw"]["phase"] in ("forward/backward", "optimizer step")


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        demo.main(["--steps", "0", "--no-progress"])
    with pytest.raises(SystemExit):
        demo.main(["--recipe", "mxfp4", "--no-progress"])


def test_bf16_free_step_saves_2n_where_the_optimizer_step_is_the_peak():
    """Few tokens: the FP32 masters and Adam moments make the optimizer step the global peak.
    There the seed's restore saves nothing (its FP8 copies live through the inner step, BF16 is
    back at the write-back), and the BF16-free step saves the full 2N."""
    few_tokens = dict(micro_batches=1, batch=1, seq=16, hidden=256, layers=2, vocab=512)
    c = demo.DemoConfig(model="dense", **{**TINY, **few_tokens})
    (s,) = demo.run(c)
    assert s["losses_bitwise_equal_release_on_off"] and s["weights_equal_release_on_off"]
    assert all(v["phase"] == "optimizer step" for v in s["global_peak"].values()), s["global_peak"]
    theory = s["theoretical_saving_2N_bytes"]
    assert abs(s["global_peak_saving_bytes"]["zrw"] - theory) <= 0.01 * theory
    assert s["global_peak_saving_bytes"]["zrw-restore"] <= 0.05 * theory
