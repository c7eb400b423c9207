"""DCP checkpointing of a zrw FSDP2 model and DDP with released weights: real 2-rank runs (gloo on
CPU) of tests/fsdp/dcp_ddp_worker.py (ranks 0 and 1): one launch runs both tasks."""

import io
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from helpers import ranks

WORKER = os.path.join(os.path.dirname(__file__), "dcp_ddp_worker.py")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("dcp") / "ckpt"


@pytest.fixture(scope="module")
def runs(ckpt):
    return ranks.launch(WORKER, ckpt.parent, "--tasks", "dcp,ddp", "--ckpt", str(ckpt))


def test_dcp_save_load_resumes_bitwise(runs, ckpt):
    # 2 steps, dcp.save(model + optimizer state dicts), 2 more steps; a fresh model (another
    # seed, convert + prepare + fully_shard) and optimizer dcp.load + set_state_dict and run the
    # same 2 steps: the same losses and weights, bitwise. Both recipes, in one launch.
    assert sorted(runs["dcp"]) == ["mxfp8", "mxfp8-32x32"]
    for recipe, r in runs["dcp"].items():
        _check_dcp(ckpt / recipe, r)


def _check_dcp(ckpt, r):
    assert len(r["resumed"]) == 4
    assert r["resumed"] == r["ref"]
    for n in r["w_ref"]:
        assert torch.equal(r["w_res"][n], r["w_ref"][n]), n
    assert r["optim_keys"]
    # The resumed model still all-gathers as MXFP8: the extension survives the load.
    assert "PreQuantWeight" in r["types"]
    # The checkpoint holds plain tensors (torch.load(weights_only=True) reads them: DCP's
    # reader does) of the shard's own size, not FSDP2's padded buffer nor the wrapper.
    files = [f for f in os.listdir(ckpt) if f.endswith(".distcp")]
    assert len(files) == 2
    md = FileSystemReader(str(ckpt)).read_metadata()
    for idx, info in md.storage_data.items():
        with open(os.path.join(ckpt, info.relative_path), "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        t = torch.load(io.BytesIO(blob), weights_only=True)
        if isinstance(t, torch.Tensor):
            assert type(t) is torch.Tensor, idx.fqn
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), idx.fqn


def test_ddp_release_on_equals_release_off_bitwise(runs):
    # DDP is constructed before the first forward (its construction broadcasts the parameters'
    # data); release off, on, and on with gradient_as_bucket_view=True run in one launch.
    r = runs["ddp"]
    on, off, view = r["on"], r["off"], r["view"]
    # The weights really are released inside every step (all three MXLinear weights, bf16)...
    n_bytes = 2 * (128 * 256 + 256 * 256 + 256 * 128)
    assert on["released"] == [n_bytes] * 3, on["released"]
    assert view["released"] == [n_bytes] * 3
    assert off["released"] == [0] * 3
    # ... and the training is bitwise the release-off one, with and without bucket views.
    assert on["losses"] == off["losses"] == view["losses"]
    for n in off["weights"]:
        assert torch.equal(on["weights"][n], off["weights"][n]), n
        assert torch.equal(view["weights"][n], off["weights"][n]), n
    assert on["replicas_equal"] and off["replicas_equal"] and view["replicas_equal"]


def test_ddp_constructed_after_a_released_forward_errors_clearly(tmp_path):
    # DDP broadcasts the parameters' data at construction: after a forward has released them
    # that is a clear zrw error, not a broadcast of garbage. Construct DDP before the first
    # forward (or under zrw.no_release()).
    procs, logs = ranks.launch(WORKER, tmp_path, "--late-ddp", expect_ok=False)
    assert any(p.returncode != 0 for p in procs)
    assert any("is released" in log for log in logs), logs[0][-3000:]
