"""zrw.cache's public calls given a DTensor weight (tensor / expert parallelism) work on its
local shard, the tensor the cache holds for it: the same entry, state, name, master and restore
as the layers and zrw.parallel use. Before, they silently worked on the DTensor wrapper (state 0,
no entry). One gloo rank on a 1-d mesh, in a child process (a process group is process-wide)."""

import subprocess
import sys

import pytest

from helpers import ranks

SCRIPT = r"""
import os, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from zrw import cache

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
recipe = sys.argv[2]
full = torch.randn(64, 96)

def dtensor(t, requires_grad=True):
    return torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)]),
                              requires_grad=requires_grad)

w = dtensor(full.bfloat16())
local = w._local_tensor
cache.set_weight_name(w, "layer.weight")
assert cache.weight_name(local) == "layer.weight" == cache.weight_name(w)

# quantize and release through the DTensor: the local shard is released, filed once
plain = full.bfloat16().requires_grad_(True)
want = cache.quant_and_release(plain, recipe, release=False)
got = cache.quant_and_release(w, recipe)
for pw, pg in ((want.fwd, got.fwd), (want.bwd, got.bwd)):
    for a, b in zip(pw, pg):  # data and scale, byte for byte
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
assert cache.cache_state(w) == cache.cache_state(local) == "released" and cache.is_released(w)
assert cache.cache_states([w, plain]) == ["released", "cached"]
again = cache.quant_and_release(w, recipe)
assert again.fwd.data.data_ptr() == got.fwd.data.data_ptr()  # the cached copy
try:
    w.to_local().sum()
    raise SystemExit("a released DTensor weight was readable")
except RuntimeError as e:
    assert "layer.weight" in str(e) and "released" in str(e), e

# a DTensor master restores it exactly
master = dtensor(full, requires_grad=False)
cache.register_master(w, master)
assert cache.master_of(w) is master._local_tensor
cache.restore(w, "master")
assert cache.cache_state(w) == "none" and torch.equal(w.to_local(), full.bfloat16())

# the BF16-free write-back with a DTensor source; restore from the entry's master
cache.quant_and_release(w, recipe)
src = dtensor(full * 2, requires_grad=False)
assert cache.assign_weights([w], [src], keep_released=True) == 1
assert cache.cache_state(w) == "pending" and cache.cache_master(w) is src._local_tensor
assert cache.cache_invalidate(w, "dequant") and cache.cache_state(w) == "none"
assert torch.equal(w.to_local(), (full * 2).bfloat16())

# a frozen DTensor weight is released for good only with release_frozen
f = dtensor(full.bfloat16(), requires_grad=False)
# distribute_tensor's local shard is a view of the temporary bf16 tensor, which a reference cycle
# inside DTensor's construction can keep alive until the cyclic GC runs: the release guard then
# (rightly) sees an aliased storage and keeps it. Collect first, so the shard owns its storage.
import gc
gc.collect()
cache.quant_and_release(f, recipe)
assert cache.cache_state(f) == "none"  # kept frozen weights are quantized at each use, never filed
cache.quant_and_release(f, recipe, release_frozen=True)
assert cache.cache_state(f) == "released_for_good"
cache.cache_clear()

# copy.deepcopy of a TP layer between BF16-free steps: the copy's weight is a DTensor holding
# bf16 of the master, readable; the layer's own weight stays released
import copy, zrw
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
model = torch.nn.Sequential(torch.nn.Linear(96, 64, dtype=torch.bfloat16))
zrw.convert(model, recipe)
parallelize_module(model, mesh, {"0": ColwiseParallel()})
zrw.parallel.prepare(model)
opt = zrw.optim.attach(zrw.optim.MasterWeights(torch.optim.AdamW, model.parameters(), lr=1e-2))
model(torch.randn(4, 96, dtype=torch.bfloat16)).float().sum().backward()
opt.step()
opt.zero_grad()
assert cache.is_released(model[0].weight)
twin = copy.deepcopy(model)
tw = twin[0].weight
assert type(tw.data).__name__ == "DTensor" and cache.cache_state(tw) == "none"
assert torch.equal(tw.to_local(), model.state_dict()["0.weight"].to_local())
assert torch.equal(tw.to_local(), opt.masters[0][0].to_local().bfloat16())
assert cache.is_released(model[0].weight)
# zrw.checkpoint: iter_state_dict materializes the DTensor weight; safetensors refuses DTensors
streamed = dict(zrw.checkpoint.iter_state_dict(model))
assert torch.equal(streamed["0.weight"].to_local(), tw.to_local())
try:
    zrw.checkpoint.save_safetensors(model, os.devnull)
    raise SystemExit("save_safetensors wrote a DTensor model")
except TypeError as e:
    assert "'0.bias' is a DTensor" in str(e) and "torch.distributed.checkpoint" in str(e), e
assert cache.is_released(model[0].weight)
# A weight sharded over a 2-d mesh reaches the layers only through FSDP2 (its gathered TP-local
# weight is a 1-d DTensor): check_placements says where the 2-d layout goes instead.
mesh2 = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
w2 = distribute_tensor(full.bfloat16(), mesh2, [Shard(0), Shard(1)])
try:
    zrw.parallel.check_placements(w2, "two.weight")
    raise SystemExit("check_placements accepted a 2-d mesh")
except ValueError as e:
    assert "'two.weight' is a DTensor on a 2-d device mesh" in str(e), e
    assert "call zrw.fsdp.prepare(model) after parallelize_module" in str(e), e
del opt, model, twin
cache.cache_clear()
dist.destroy_process_group()
sys.stdout.flush()
print("OK")
os._exit(0)
"""


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8-32x32"])
def test_cache_calls_given_a_dtensor_work_on_its_local_shard(recipe):
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ranks.free_port()), recipe],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), (
        r.stdout[-3000:] + r.stderr[-3000:]
    )
