"""Past one parallel axis, on real process groups (gloo on CPU):

* FSDP2 x TP on one 2-D DeviceMesh: 4 ranks, mesh ("dp", "tp") = (2, 2), torchtitan's order:
  zrw.convert, parallelize_module on mesh["tp"] (fc1 Colwise, fc2 Rowwise), zrw.fsdp.prepare,
  fully_shard on mesh["dp"] (tests/parallel/fsdp_tp_worker.py);
* expert parallelism inside FSDP2: 2 ranks, a tiny Qwen3-MoE under transformers' own engine
  (experts sharded over EP with its all-to-all dispatch, everything under FSDP2 over DP;
  tests/parallel/ep_fsdp_worker.py).
See the workers' docstrings for the modes each launch runs. The 4-rank cases share one launch
(and the DCP resume a second one: fresh processes), both recipes of the EP case another."""

import os

import pytest
import torch

from helpers import TESTS, ranks

WORKER = os.path.join(TESTS, "parallel", "fsdp_tp_worker.py")
EP_WORKER = os.path.join(TESTS, "parallel", "ep_fsdp_worker.py")
WEIGHTS = ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]
# The losses of the 2-D run against the unsharded zrw run on the same global batch: the
# rowwise layers' partial products are summed over the TP ranks in the activation dtype
# (BF16, as for a BF16 layer under TP) and FSDP2 averages FP32 gradients over DP, so the runs
# differ by reduction order; measured <= 0.2% over 3 steps, asserted <= 1%.
LOSS_RTOL = 1e-2


LIMIT = {"mxfp8": 0.52, "mxfp8-32x32": 0.51}  # all-gathered bytes against BF16's, at most
RUNS = {
    "mxfp8": "--recipe mxfp8",
    "mxfp8-32x32": "--recipe mxfp8-32x32",
    # hidden 96 at TP=2: fc1's 48 rows per TP rank cut a 32-row block.
    "tp_cut": "--hidden 96 --expect-error",
    # d 32 at DP=2: fc2's 32 rows (TP splits its columns) give 16 rows per DP rank.
    "dp_cut": "--d 32 --recipe mxfp8",
    "dcp_save": "--task dcp_save",
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp_tp") / "ckpt"


@pytest.fixture(scope="module")
def runs(ckpt):
    args = [a for flags in RUNS.values() for a in ("--run", flags)]
    out = ranks.launch(WORKER, ckpt.parent, "--ckpt", str(ckpt), *args, world=4)
    return dict(zip(RUNS, out))


@pytest.mark.parametrize("recipe", list(LIMIT))
def test_fsdp_x_tp_gathers_fp8_planes_of_tp_local_shards(runs, recipe):
    r, limit = runs[recipe], LIMIT[recipe]
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


def test_fsdp_x_tp_dcp_resume_in_fresh_processes_is_bitwise(runs, ckpt, tmp_path):
    saved = runs["dcp_save"]
    resumed = ranks.launch(WORKER, tmp_path, "--task", "dcp_resume", "--ckpt", str(ckpt), world=4)
    assert resumed["rest"] == saved["rest"]
    for n, w in saved["weights"].items():
        assert torch.equal(resumed["weights"][n], w), n
    assert "PreQuantWeight" in resumed["types"]  # the all-gather extension is back after load


def test_a_tp_split_that_cuts_a_block_is_refused(runs):
    msg = runs["tp_cut"]["error"]
    assert msg is not None
    for part in (
        "'blocks.0.fc1.weight'",
        "mesh dimension 'tp'",
        "48 per rank",
        "not a multiple of the MX block (32)",
        "Use a parallel degree",
    ):
        assert part in msg, msg


def test_a_dp_split_that_cuts_a_block_gathers_bf16_with_a_warning(runs):
    r = runs["dp_cut"]
    warned = [w for w in r["warnings"] if "mesh dimension 'dp'" in w]
    assert warned and all("blocks." in w and "fc2.weight" in w for w in warned), r["warnings"]
    assert not any("fc1.weight" in w for w in r["warnings"]), r["warnings"]
    assert r["on"]["losses"] == r["off"]["losses"]
    for got, want in zip(r["on"]["losses"], r["single_losses"]):
        assert abs(got - want) <= LOSS_RTOL * abs(want)


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    out = ranks.launch(
        EP_WORKER,
        tmp_path_factory.mktemp("ep"),
        *[a for recipe in LIMIT for a in ("--run", f"--recipe {recipe}")],
    )
    return dict(zip(LIMIT, out))


@pytest.mark.parametrize("recipe", list(LIMIT))
def test_expert_parallel_inside_fsdp2(ep_runs, recipe):
    r, limit = ep_runs[recipe], LIMIT[recipe]
    on, off, bf16 = r["on"], r["off"], r["bf16"]
    # The experts: sharded over EP by the engine, inside FSDP2 (2-D placements), all-gathered
    # through zrw's extension (the local shard is a PreQuantWeight).
    assert len(on["expert_placements"]) == 4
    for name, (placements, local) in on["expert_placements"].items():
        assert local == "PreQuantWeight" and placements.count("Shard") == 2, (name, placements)
    # release on = release off, bit for bit.
    assert on["losses"] == off["losses"]
    for n, w in on["weights"].items():
        assert torch.equal(w, off["weights"][n]), n
    # The unsharded zrw run on the same global batch.
    for got, want in zip(on["losses"], r["single_losses"]):
        assert abs(got - want) <= LOSS_RTOL * abs(want), (on["losses"], r["single_losses"])
    # Each rank quantizes its shard of every converted weight (experts included) once per
    # step; no BF16 copy of a converted weight is ever made (nothing goes through the native
    # cache, nothing is restored).
    assert len(on["converted"]) == 12
    assert on["quantizations"] == 3 * len(on["converted"])
    assert on["cache_entries"] == 0 and on["restored_bytes"] == 0
    # All-gather bytes against FSDP2's BF16 gather of the same model, collective by collective
    # (the same schedule in both runs). The collectives that carry converted weights are the
    # decoder layers' groups: their attention weights travel as MXFP8, their norms and router
    # in BF16 in both runs (layer_other_bytes, subtracted from both); the converted weights
    # send <= limit of their BF16 bytes. The root group (embeddings, final norm, lm_head: not
    # converted) gathers the same BF16 bytes in both runs (the whole model's ratio is ~0.61
    # for this tiny, vocabulary-heavy model).
    assert len(on["calls"]) == len(bf16["calls"])
    pairs = [(a, b) for a, b in zip(on["calls"], bf16["calls"]) if a != b]
    assert pairs and all(a < b for a, b in pairs)
    other = on["layer_other_bytes"]
    ratio = sum(a - other for a, _ in pairs) / sum(b - other for _, b in pairs)
    assert ratio <= limit, ratio
