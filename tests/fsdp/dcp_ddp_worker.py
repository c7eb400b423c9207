"""One rank of the DCP and DDP tests (spawned by test_dcp_ddp.py, 2 ranks, gloo on CPU).

--task dcp: a zrw FSDP2 model (convert + zrw.fsdp.prepare + fully_shard) trains 2 steps, is
  saved with torch.distributed.checkpoint (model + optimizer state dicts), trains 2 more steps
  (the reference losses); then a fresh model and optimizer load the checkpoint and run the same
  2 steps. Writes both loss lists.
  Both recipes, one after the other (--recipes).
--task ddp: DistributedDataParallel of converted MXLinear/GELU layers (bf16, MasterWeights AdamW,
  zrw.optim.attach) trains 3 steps x 2 micro-batches with release off, on, and on with
  gradient_as_bucket_view=True; writes losses, final weights and the released bytes seen inside
  each step. --late-ddp: a probe that constructs DDP after a (releasing) forward.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from helpers import ranks
from helpers.fsdp_runs import Net

# ---- DCP ---------------------------------------------------------------------------------------

def build_fsdp(args, seed=0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import zrw
    import zrw.fsdp

    torch.manual_seed(seed)
    model = Net(args.d, args.hidden, 4, False)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    zrw.convert(model, args.recipe, release=False)
    zrw.fsdp.prepare(model)
    mesh = init_device_mesh("cpu", (args.world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for sub in (model.fc1, model.fc2):
        fully_shard(sub, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    zrw.optim.attach(opt, fill="dequant")
    return model, opt


def dcp_batches(args):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(args.world * args.tokens, args.d, generator=g)
            for _ in range(4 * args.micro_batches)]


def train(model, opt, args, data, steps):
    rank = dist.get_rank()
    losses = []
    for step in steps:
        for mb in range(args.micro_batches):
            x = data[step * args.micro_batches + mb][rank * args.tokens:(rank + 1) * args.tokens]
            loss = model(x).float().pow(2).mean() / args.micro_batches
            loss.backward()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item())
        opt.step()
        opt.zero_grad()
    return losses


def run_dcp(args):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    data = dcp_batches(args)
    model, opt = build_fsdp(args)
    train(model, opt, args, data, range(2))
    state = {"model": get_model_state_dict(model),
             "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=args.ckpt)
    ref = train(model, opt, args, data, range(2, 4))

    # A fresh model from another seed: everything it resumes with must come from the checkpoint.
    model2, opt2 = build_fsdp(args, seed=1)
    state2 = {"model": get_model_state_dict(model2),
              "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(state2, checkpoint_id=args.ckpt)
    set_model_state_dict(model2, state2["model"])
    set_optimizer_state_dict(model2, opt2, state2["optim"])
    resumed = train(model2, opt2, args, data, range(2, 4))
    w_ref = {n: p.full_tensor().detach().float() for n, p in model.named_parameters()}
    w_res = {n: p.full_tensor().detach().float() for n, p in model2.named_parameters()}
    # The saved optimizer states came back (AdamW's moments, step).
    o_ref = get_optimizer_state_dict(model, opt)["state"]
    o_res = get_optimizer_state_dict(model2, opt2)["state"]
    types = sorted({type(p.to_local()).__name__ for p in model2.parameters()})
    return {"ref": ref, "resumed": resumed, "w_ref": w_ref, "w_res": w_res, "types": types,
            "optim_keys": sorted(o_ref) == sorted(o_res)}


# ---- DDP ---------------------------------------------------------------------------------------

def run_ddp_all(args):
    """Release off, on, and on with gradient_as_bucket_view=True, one after the other in this
    process (one launch instead of three)."""
    out = {}
    for key, no_release, view in (("off", True, False), ("on", False, False),
                                  ("view", False, True)):
        args.no_release, args.bucket_view = no_release, view
        out[key] = run_ddp(args)
    return out


def run_dcp_all(args):
    out = {}
    ckpt = args.ckpt
    for recipe in args.recipes.split(","):
        args.recipe, args.ckpt = recipe, os.path.join(ckpt, recipe)
        out[recipe] = run_dcp(args)
    return out


def run_ddp(args):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zrw

    rank = dist.get_rank()
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(args.d, args.hidden), nn.GELU(),
                        nn.Linear(args.hidden, args.hidden), nn.GELU(),
                        nn.Linear(args.hidden, args.d, bias=False)).to(torch.bfloat16)
    release = not args.no_release
    zrw.convert(seq, args.recipe, release=release)
    # DDP before the first forward: its construction broadcasts the parameters' data (they
    # must not be released then); gradient buckets are separate storages unless
    # gradient_as_bucket_view=True, and the bucket copy reads .grad, never the weight.
    if args.late_ddp:  # probe: a forward (weights released) before DDP is constructed
        # (an optimizer with the boundary owns the weights: zrw releases only those)
        early = zrw.optim.attach(zrw.optim.MasterWeights(torch.optim.AdamW, seq.parameters(),
                                                         lr=args.lr))
        seq(torch.randn(args.tokens, args.d, dtype=torch.bfloat16))
        del early
    model = DDP(seq, gradient_as_bucket_view=args.bucket_view)
    opt = zrw.optim.attach(zrw.optim.MasterWeights(torch.optim.AdamW, seq.parameters(),
                                                   lr=args.lr))
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(args.world * args.tokens, args.d, generator=g)
            for _ in range(args.steps * args.micro_batches)]
    losses, released = [], []
    for step in range(args.steps):
        peak = 0
        for mb in range(args.micro_batches):
            x = data[step * args.micro_batches + mb][rank * args.tokens:(rank + 1) * args.tokens]
            ctx = model.no_sync() if mb < args.micro_batches - 1 else _null()
            with ctx:
                loss = model(x.to(torch.bfloat16)).float().pow(2).mean() / args.micro_batches
                peak = max(peak, zrw.cache.cache_stats()["released_bytes"])
                loss.backward()
                peak = max(peak, zrw.cache.cache_stats()["released_bytes"])
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item())
        released.append(peak)
        opt.step()
        opt.zero_grad()
    # Read through state_dict: the BF16-free step keeps the weights released after the step.
    sd = seq.state_dict()
    weights = {n: sd[n].float().clone() for n, _ in seq.named_parameters()}
    # DDP keeps the replicas identical: every rank ends with the same weights.
    sums = [None] * args.world
    dist.all_gather_object(sums, [w.double().sum().item() for w in weights.values()])
    return {"losses": losses, "weights": weights, "released": released,
            "replicas_equal": all(s == sums[0] for s in sums)}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", choices=["dcp", "ddp"], required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, default=29556)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--recipe", default="mxfp8")
    ap.add_argument("--recipes", default="mxfp8,mxfp8-32x32", help="--task dcp")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--no-release", action="store_true")
    ap.add_argument("--bucket-view", action="store_true")
    ap.add_argument("--late-ddp", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(args.port)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    if args.task == "dcp":
        out = run_dcp_all(args)
    else:
        out = run_ddp(args) if args.late_ddp else run_ddp_all(args)
    if args.rank == 0:
        torch.save(out, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ranks.exit_after(main)
