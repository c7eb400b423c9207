"""FSDP2 with zrw's MXFP8 all-gather: real 2-rank runs (gloo on CPU), spawned by the test.

One launch of tests/fsdp/fsdp_worker.py (ranks 0 and 1) runs every configuration below one after
the other (RUNS); each test compares what rank 0 wrote with the single-process zrw run on the
same global batch and with FSDP2's plain BF16 all-gather of the same model. Bytes are counted by
the worker's own wrapper of the process group's all-gather (not by zrw)."""

import subprocess
import sys

import pytest
import torch

import zrw
from helpers import ranks
from helpers.fsdp_runs import (
    WORKER,
    assert_trains_like_bf16_gather_and_single_process,
    initial_weight,
)

RECIPES = {"mxfp8": 0.52, "mxfp8-32x32": 0.51}  # recipe: the all-gather byte ratio's limit
SGD = "--opt sgd --lr 0.5"


def recipe_args(recipe):
    # the MoE model: fc1, fc2 and an expert stack (the dense layers' checks included)
    return f"--recipe {recipe} --moe"


RUNS = {}
for _recipe in RECIPES:
    for _mode in ("zrw", "bf16", "single"):
        RUNS[f"{_recipe}_{_mode}"] = f"{recipe_args(_recipe)} --mode {_mode} {SGD}"
RUNS.update(
    {
        "ref": "--recipe mxfp8 --mode zrw",
        "ckpt": "--recipe mxfp8 --mode zrw --checkpoint --both-planes",
        "keep": "--recipe mxfp8 --mode zrw --no-reshard --both-planes",
        "master": "--recipe mxfp8 --mode zrw --master",
    }
)
for _moe in ("", "_moe"):  # fc1 has 48 rows: 24 per rank, not whole 32-row blocks
    for _mode in ("zrw", "bf16"):
        RUNS[f"uneven{_moe}_{_mode}"] = f"--recipe mxfp8 --hidden 48 --mode {_mode}" + (
            " --moe" if _moe else ""
        )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    args = [a for flags in RUNS.values() for a in ("--run", flags)]
    return dict(zip(RUNS, ranks.launch(WORKER, tmp_path_factory.mktemp("fsdp"), *args)))


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_all_gather_matches_single_process_and_halves_bytes(runs, recipe):
    z, b, s = (runs[f"{recipe}_{m}"] for m in ("zrw", "bf16", "single"))
    args = recipe_args(recipe).split()

    # After the last reshard no gathered plane holds memory (FSDP2 frees what it gathered).
    assert z["resident_plane_bytes"] and not any(z["resident_plane_bytes"].values())
    assert_trains_like_bf16_gather_and_single_process(z, b, s, args)

    # The gathered planes equal the single-process quantization of the full weight, byte for byte.
    for name in ("fc1", "fc2"):
        got = z["planes"][name]
        w = initial_weight(f"{name}.weight", args)
        rcp = zrw.get_recipe(recipe)  # its element format and scale rule
        if recipe == "mxfp8":
            ref = dict(
                zip(
                    ("fwd_data", "fwd_scale"),
                    zrw.ops.mx_quantize_dual(w, rcp.elem_dtype, rcp.scale_mode)[:2],
                )
            )
        else:
            data, block = zrw.ops.mx_quantize_block(w, rcp.elem_dtype, rcp.scale_mode)
            ref = {
                "fwd_data": data,
                "fwd_scale": zrw.ops.expand_block_scale(block, w.shape, -1),
                "bwd_data": data,
                "bwd_scale": zrw.ops.expand_block_scale(block, w.shape, -2),
            }
        for k, v in ref.items():
            assert torch.equal(got[k], v.contiguous().view(torch.uint8)), (name, k)

    # Quantized once per optimizer step per weight (3 steps x 2 micro-batches x 2 gathers each):
    # fc1, fc2 and the two expert stacks.
    assert z["quantizations"] == 3 * 4
    ratio = [zb / bb for zb, bb in zip(z["per_step_bytes"], b["per_step_bytes"])]
    assert all(r <= RECIPES[recipe] for r in ratio), ratio
    assert z["warnings"] == []


def test_activation_checkpointing_and_no_reshard_need_both_planes(runs, tmp_path):
    ref, ckpt, keep = runs["ref"], runs["ckpt"], runs["keep"]
    assert ckpt["losses"] == ref["losses"]
    for n in ref["weights"]:
        assert torch.equal(ckpt["weights"][n], ref["weights"][n]), n
    assert keep["losses"] == ref["losses"]
    # Without both planes, recompute finds only the backward plane: a clear error, not garbage.
    procs, logs = ranks.launch(WORKER, tmp_path, "--mode", "zrw", "--checkpoint", expect_ok=False)
    assert any(p.returncode != 0 for p in procs)
    assert any("both_planes=True" in log for log in logs), logs[0][-3000:]


def test_master_weights_steps_the_shards_as_the_plain_optimizer(runs):
    """zrw.optim.MasterWeights over FSDP2's sharded parameters (each a PreQuantWeight around the
    rank's shard): its write-back and write check read the shard's own bytes, and with FP32
    shards it steps them exactly as the plain AdamW does."""
    ref, master = runs["ref"], runs["master"]
    assert master["losses"] == ref["losses"]
    for name, w in ref["weights"].items():
        assert torch.equal(master["weights"][name], w), name


@pytest.mark.parametrize("moe", [False, True])
def test_uneven_shards_warn_and_stay_correct(runs, moe):
    z, b = (runs[f"uneven{'_moe' if moe else ''}_{m}"] for m in ("zrw", "bf16"))
    assert any("fc1.weight" in w and "whole 32-row blocks" in w for w in z["warnings"])
    # fc2 has K = 48 and, with --moe, the expert stacks have N = 48 (gate_up_proj) and K = 24
    # (down_proj): their two scale planes differ in size, the smaller one travels padded and is
    # compacted into a buffer FSDP2 frees at reshard like the planes; after the last reshard
    # no gathered plane of any layer holds memory.
    names = {"fc1", "fc2"} | ({"experts.gate_up_proj", "experts.down_proj"} if moe else set())
    assert z["resident_plane_bytes"] == dict.fromkeys(names, 0)
    assert z["losses"] == b["losses"]
    for n in z["weights"]:
        assert torch.equal(z["weights"][n], b["weights"][n]), n


PREPARE_AFTER_SHARD = r"""
import os, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import zrw, zrw.fsdp
os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = "%d"
dist.init_process_group("gloo", rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(64, 64))
zrw.convert(model, release=False)
fully_shard(model)
try:
    zrw.fsdp.prepare(model)
except RuntimeError as e:
    print("RAISED", e)
dist.destroy_process_group()
"""


def test_prepare_after_fully_shard_is_refused_clearly():
    r = subprocess.run(
        [sys.executable, "-c", PREPARE_AFTER_SHARD % ranks.free_port()],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RAISED" in r.stdout and "'0.weight' is already sharded" in r.stdout
    assert "before fully_shard" in r.stdout
