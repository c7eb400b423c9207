"""One rank of the FSDP2 tests (spawned by test_fsdp.py, 2 ranks, gloo on CPU).

Trains a small model of MXLinear layers (+ an MoE expert stack) under fully_shard with zrw's
MXFP8 all-gather, and writes what the test checks (losses, updated weights, gathered planes,
all-gather bytes counted at the process group, shard quantization counts) to a JSON/pt file.
"""
import argparse
import os
import warnings

import torch
import torch.distributed as dist

from helpers import ranks
from helpers.fsdp_runs import build


def batches(args):
    g = torch.Generator().manual_seed(1)
    # global batch per micro-batch: world * tokens_per_rank rows
    return [torch.randn(args.world * args.tokens, args.d, generator=g)
            for _ in range(args.steps * args.micro_batches)]


def optimizer_cls(args):
    return torch.optim.SGD if args.opt == "sgd" else torch.optim.AdamW


def run_single(args):
    """The single-process zrw run on the global batch (bf16 weights, FP32 masters)."""
    import zrw

    model = build(args).to(torch.bfloat16)
    opt = zrw.optim.attach(zrw.optim.MasterWeights(optimizer_cls(args), model.parameters(),
                                                   lr=args.lr))
    losses = []
    data = batches(args)
    for step in range(args.steps):
        for mb in range(args.micro_batches):
            x = data[step * args.micro_batches + mb].to(torch.bfloat16)
            loss = model(x).float().pow(2).mean() / args.micro_batches
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    # The FP32 masters: what FSDP2's sharded parameters are.
    masters = [m for group in opt.masters for m in group]
    return losses, {n: m.detach().clone() for (n, _), m in zip(model.named_parameters(), masters)}


def run_fsdp(args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import zrw
    import zrw.fsdp

    rank = dist.get_rank()
    model = build(args)
    if args.mode == "zrw":
        zrw.fsdp.prepare(model, both_planes=args.both_planes)
    mesh = init_device_mesh("cpu", (args.world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    rafw = not args.no_reshard
    if args.checkpoint:
        from torch.utils.checkpoint import checkpoint

        inner = model.forward
        model.forward = lambda x: checkpoint(inner, x, use_reentrant=False)
    for sub in [model.fc1, model.fc2] + ([model.experts] if args.moe else []):
        fully_shard(sub, mesh=mesh, mp_policy=mp, reshard_after_forward=rafw)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=rafw)
    opt = optimizer_cls(args)(model.parameters(), lr=args.lr)
    zrw.optim.attach(opt, fill="dequant")  # boundary: clears the shard cache, next_step
    data = batches(args)
    losses = []
    # The planes each zrw layer receives from the first gather, to compare byte for byte with
    # the single-process quantization of the full weight.
    first_planes = {}
    # Every gathered weight's plane state (shared by its aliases), to check after the last
    # reshard that no plane still holds memory.
    states = {}

    def capture(mod, inputs, name):
        if isinstance(mod, zrw.nn.MXFusedExperts):  # the expert stacks: their states only
            for pname in ("gate_up_proj", "down_proj"):
                w = getattr(mod, pname)
                if isinstance(w, zrw.fsdp.MXGatheredWeight):
                    states[f"{name}.{pname}"] = w._mx_state
            return
        w = mod.weight
        if not isinstance(w, zrw.fsdp.MXGatheredWeight):
            return
        states[name] = w._mx_state
        if name in first_planes:
            return
        q = w._mx_state["planes"]  # the gathered zrw.planes.MXWeight
        first_planes[name] = {f"{d}_{k}": (None if v is None else v.view(torch.uint8).clone())
                              for d, plane in (("fwd", q.fwd), ("bwd", q.bwd))
                              for k, v in (("data", plane.data), ("scale", plane.scale))}

    for name, mod in model.named_modules():
        if isinstance(mod, (zrw.nn.MXLinear, zrw.nn.MXFusedExperts)):
            mod.register_forward_pre_hook(lambda m, i, name=name: capture(m, i, name))
    q0 = zrw.fsdp.stats()["shard_quantizations"]
    per_step_bytes = []
    with ranks.count_gathered_bytes() as counts:
        for step in range(args.steps):
            before = counts["bytes"]
            for mb in range(args.micro_batches):
                x = data[step * args.micro_batches + mb]
                x = x[rank * args.tokens:(rank + 1) * args.tokens]
                loss = model(x).float().pow(2).mean() / args.micro_batches
                loss.backward()
                t = loss.detach().clone()
                dist.all_reduce(t)
                losses.append(t.item() / args.world)
            per_step_bytes.append(counts["bytes"] - before)
            opt.step()
            opt.zero_grad()
    quantizations = zrw.fsdp.stats()["shard_quantizations"] - q0
    resident = {name: sum(t.untyped_storage().nbytes() for t in st["planes"].tensors())
                for name, st in states.items()}
    full = {}
    for n, p in model.named_parameters():
        full[n] = p.full_tensor().detach().float()
    return losses, full, per_step_bytes, quantizations, first_planes, resident


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, default=29555)
    ap.add_argument("--out", required=True)
    ap.add_argument("--recipe", default="mxfp8")
    ap.add_argument("--mode", default="zrw", choices=["zrw", "bf16", "single"])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--both-planes", action="store_true")
    ap.add_argument("--no-reshard", action="store_true")
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--opt", default="adamw", choices=["adamw", "sgd"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.mode == "single":
        losses, weights = run_single(args)
        torch.save({"losses": losses, "weights": weights}, args.out)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(args.port)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, weights, per_step, quants, planes, resident = run_fsdp(args)
    msgs = [str(w.message) for w in caught if "zrw.fsdp" in str(w.message)]
    if args.rank == 0:
        torch.save({"losses": losses, "weights": weights, "per_step_bytes": per_step,
                    "quantizations": quants, "warnings": msgs, "planes": planes,
                    "resident_plane_bytes": resident}, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ranks.exit_after(main)
