"""One rank of the FSDP2 tests (spawned by test_fsdp.py and test_fsdp_recipe.py: 2 ranks, gloo on
CPU).

Trains a small model of MXLinear layers (+ an MoE expert stack: tests/helpers/fsdp_runs.py) under
fully_shard with zrw's MXFP8 all-gather (--mode zrw), the same model under FSDP2's BF16
all-gather (--mode bf16), or, on rank 0 alone, the single-process zrw run on the global batch
(--mode single). Each --run "FLAGS" is one such run (its flags on top of the command line's);
they run one after the other in one launch, and rank 0 writes the list of their results (losses,
updated weights, gathered planes, all-gather bytes counted at the process group, shard
quantization counts, zrw.fsdp's warnings).
"""

import warnings

import torch
import torch.distributed as dist

from helpers import worker
from helpers.fsdp_runs import build


def batches(args):
    # global batch per micro-batch: world * tokens rows (rank r takes its rows)
    return worker.batches(
        args.steps * args.micro_batches,
        lambda g: torch.randn(args.world * args.tokens, args.d, generator=g),
    )


def optimizer_cls(args):
    return torch.optim.SGD if args.opt == "sgd" else torch.optim.AdamW


def run_single(args):
    """The single-process zrw run on the global batch (bf16 weights, FP32 masters)."""
    model = build(args).to(torch.bfloat16)
    opt = worker.master_weights(model.parameters(), args.lr, optimizer_cls(args))
    losses = worker.train_in_one_process(model, opt, batches(args), args)
    # The FP32 masters: what FSDP2's sharded parameters are.
    return {"losses": losses, "weights": worker.masters_by_name(model, opt)}


def run_fsdp(args):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import zrw
    import zrw.fsdp
    import zrw.testing

    rank = dist.get_rank()
    model = build(args)
    if args.mode == "zrw":
        zrw.fsdp.prepare(model, both_planes=args.both_planes)
    mesh = worker.mesh(args.world)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    rafw = not args.no_reshard
    if args.checkpoint:
        from torch.utils.checkpoint import checkpoint

        inner = model.forward
        model.forward = lambda x: checkpoint(inner, x, use_reentrant=False)
    for sub in [model.fc1, model.fc2] + ([model.experts] if args.moe else []):
        fully_shard(sub, mesh=mesh, mp_policy=mp, reshard_after_forward=rafw)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=rafw)
    if args.master:  # FP32 masters of the sharded parameters (zrw.optim.MasterWeights)
        opt = worker.master_weights(model.parameters(), args.lr, optimizer_cls(args))
    else:
        opt = optimizer_cls(args)(model.parameters(), lr=args.lr)
        zrw.optim.attach(opt, fill="dequant")  # boundary: clears the shard cache, next_step
    data = batches(args)
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
        first_planes[name] = {
            f"{d}_{k}": (None if v is None else v.view(torch.uint8).clone())
            for d, plane in (("fwd", q.fwd), ("bwd", q.bwd))
            for k, v in (("data", plane.data), ("scale", plane.scale))
        }

    for name, mod in model.named_modules():
        if isinstance(mod, (zrw.nn.MXLinear, zrw.nn.MXFusedExperts)):
            mod.register_forward_pre_hook(lambda m, i, name=name: capture(m, i, name))
    q0 = zrw.testing.shard_quantizations()
    rows = slice(rank * args.tokens, (rank + 1) * args.tokens)
    with worker.count_gathered_bytes() as counts:
        losses, per_step = worker.train(
            opt,
            range(args.steps),
            args.micro_batches,
            worker.mean_square_loss(model, data, args.micro_batches, rows),
            group=dist.group.WORLD,
            world=args.world,
            gathered=counts,
        )
    return {
        "losses": losses,
        "weights": worker.full_weights(model),
        "per_step_bytes": per_step,
        "quantizations": zrw.testing.shard_quantizations() - q0,
        "planes": first_planes,
        "resident_plane_bytes": {
            name: sum(t.untyped_storage().nbytes() for t in st["planes"].tensors())
            for name, st in states.items()
        },
    }


def run(args):
    import zrw

    if args.mode == "single":
        out = run_single(args) if args.rank == 0 else None
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = run_fsdp(args)
        out["warnings"] = [str(w.message) for w in caught if "zrw.fsdp" in str(w.message)]
    zrw.cache.cache_clear()
    return out


def parser():
    ap = worker.parser(__doc__)
    ap.add_argument("--mode", default="zrw", choices=["zrw", "bf16", "single"])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--both-planes", action="store_true")
    ap.add_argument("--no-reshard", action="store_true")
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--opt", default="adamw", choices=["adamw", "sgd"])
    ap.add_argument("--master", action="store_true", help="step with zrw.optim.MasterWeights")
    return ap


if __name__ == "__main__":
    ap = parser()
    worker.main(worker.each_run(run, ap), ap.parse_args(), quiet=False)
