"""FSDP2 x TP on one 2-D DeviceMesh (issue 22): 4 real ranks (gloo on CPU), mesh ("dp", "tp") =
(2, 2), torchtitan's order: zrw.convert, parallelize_module on mesh["tp"] (fc1 Colwise, fc2
Rowwise), zrw.fsdp.prepare, fully_shard on mesh["dp"]. Each launch runs tests/parallel/
fsdp_tp_worker.py on 4 ranks (see its docstring for the modes)."""
import os

import pytest
import torch

from helpers import TESTS, ranks

WORKER = os.path.join(TESTS, "parallel", "fsdp_tp_worker.py")
WEIGHTS = ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]
# The losses of the 2-D run against the unsharded zrw run on the same global batch: the
# rowwise layers' partial products are summed over the TP ranks in the activation dtype
# (BF16, as for a BF16 layer under TP) and FSDP2 averages FP32 gradients over DP, so the runs
# differ by reduction order; measured <= 0.2% over 3 steps, asserted <= 1%.
LOSS_RTOL = 1e-2


def launch(tmp_path, *args, **kwargs):
    return ranks.launch(WORKER, tmp_path, *args, world=4, **kwargs)


@pytest.mark.parametrize("recipe, limit", [("mxfp8", 0.52), ("mxfp8-32x32", 0.51)])
def test_fsdp_x_tp_gathers_fp8_planes_of_tp_local_shards(tmp_path, recipe, limit):
    r = launch(tmp_path, "--recipe", recipe)
    on, off, bf16 = r["on"], r["off"], r["bf16"]
    # Every weight is a 2-D DTensor: FSDP2's DP shard of the TP shard.
    for name in WEIGHTS:
        placements, dims = on["placements"][f"{name}.weight"]
        assert dims == ("dp", "tp"), (name, placements, dims)
    # release on = release off, bit for bit (losses and final weights).
    assert on["losses"] == off["losses"]
    for n, w in on["weights"].items():
        assert torch.equal(w, off["weights"][n]), n
    # The unsharded zrw run on the same batches: within the reduction-order tolerance.
    for got, want in zip(on["losses"], r["single_losses"]):
        assert abs(got - want) <= LOSS_RTOL * abs(want), (on["losses"], r["single_losses"])
    # Each layer received the gathered MXFP8 planes of its TP-local weight (no BF16 copy of it
    # exists: the carrier refuses every other use), and none is resident after the reshard.
    assert sorted(on["resident_plane_bytes"]) == WEIGHTS
    assert not any(on["resident_plane_bytes"].values()), on["resident_plane_bytes"]
    # Each rank quantizes its shard of each weight once per optimizer step.
    assert on["quantizations"] == 3 * len(WEIGHTS)
    # All-gathered bytes per step against FSDP2's BF16 gather of the same model.
    ratio = [a / b for a, b in zip(on["per_step_bytes"], bf16["per_step_bytes"])]
    assert all(x <= limit for x in ratio), ratio
    assert r["warnings"] == []


def test_fsdp_x_tp_dcp_resume_in_fresh_processes_is_bitwise(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = launch(tmp_path, "--task", "dcp_save", "--ckpt", ckpt)
    resumed = launch(tmp_path, "--task", "dcp_resume", "--ckpt", ckpt)
    assert resumed["rest"] == saved["rest"]
    for n, w in saved["weights"].items():
        assert torch.equal(resumed["weights"][n], w), n
    assert "PreQuantWeight" in resumed["types"]  # the all-gather extension is back after load


def test_a_tp_split_that_cuts_a_block_is_refused(tmp_path):
    # hidden 96 at TP=2: fc1's 48 rows per TP rank cut a 32-row block.
    r = launch(tmp_path, "--hidden", "96", "--expect-error")
    msg = r["error"]
    assert msg is not None
    for part in ("'blocks.0.fc1.weight'", "mesh dimension 'tp'", "48 per rank",
                 "not a multiple of the MX block (32)", "Use a parallel degree"):
        assert part in msg, msg


def test_a_dp_split_that_cuts_a_block_gathers_bf16_with_a_warning(tmp_path):
    # d 32 at DP=2: fc2's 32 rows (TP splits its columns) give 16 rows per DP rank.
    r = launch(tmp_path, "--d", "32", "--recipe", "mxfp8")
    warned = [w for w in r["warnings"] if "mesh dimension 'dp'" in w]
    assert warned and all("blocks." in w and "fc2.weight" in w for w in warned), r["warnings"]
    assert not any("fc1.weight" in w for w in r["warnings"]), r["warnings"]
    assert r["on"]["losses"] == r["off"]["losses"]
    for got, want in zip(r["on"]["losses"], r["single_losses"]):
        assert abs(got - want) <= LOSS_RTOL * abs(want)
