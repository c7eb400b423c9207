"""One rank of the DCP and DDP tests (spawned by test_dcp_ddp.py, 2 ranks, gloo on CPU).

--tasks dcp: a zrw FSDP2 model (convert + zrw.fsdp.prepare + fully_shard) trains 2 steps, is
  saved with torch.distributed.checkpoint (model + optimizer state dicts), trains 2 more steps
  (the reference losses); then a fresh model and optimizer load the checkpoint and run the same
  2 steps. Writes both loss lists.
  Both recipes, one after the other (--recipes).
--tasks ddp: DistributedDataParallel of converted MXLinear/GELU layers (bf16, MasterWeights
  AdamW, zrw.optim.attach) trains 3 steps x 2 micro-batches with release off, on, and on with
  gradient_as_bucket_view=True; writes losses, final weights and the released bytes seen inside
  each step. --late-ddp: a probe that constructs DDP after a (releasing) forward.
--tasks dcp,ddp: both, in one launch.
"""

import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn

from helpers import worker
from helpers.fsdp_runs import Net

# ---- DCP ---------------------------------------------------------------------------------------


def build_fsdp(args, seed=0):
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
    mesh = worker.mesh(args.world)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for sub in (model.fc1, model.fc2):
        fully_shard(sub, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    zrw.optim.attach(opt, fill="dequant")
    return model, opt


def batches(args, steps):
    """Per step and micro-batch, the global batch: world * tokens rows (rank r takes its rows)."""
    return worker.batches(
        steps * args.micro_batches,
        lambda g: torch.randn(args.world * args.tokens, args.d, generator=g),
    )


def train(model, opt, args, data, steps, **kw):
    rows = slice(dist.get_rank() * args.tokens, (dist.get_rank() + 1) * args.tokens)
    losses, _ = worker.train(
        opt,
        steps,
        args.micro_batches,
        worker.mean_square_loss(model, data, args.micro_batches, rows),
        group=dist.group.WORLD,
        **kw,
    )
    return losses


def run_dcp(args):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    data = batches(args, 4)
    model, opt = build_fsdp(args)
    train(model, opt, args, data, range(2))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=args.ckpt)
    ref = train(model, opt, args, data, range(2, 4))

    # A fresh model from another seed: everything it resumes with must come from the checkpoint.
    model2, opt2 = build_fsdp(args, seed=1)
    state2 = {
        "model": get_model_state_dict(model2),
        "optim": get_optimizer_state_dict(model2, opt2),
    }
    dcp.load(state2, checkpoint_id=args.ckpt)
    set_model_state_dict(model2, state2["model"])
    set_optimizer_state_dict(model2, opt2, state2["optim"])
    resumed = train(model2, opt2, args, data, range(2, 4))
    # The saved optimizer states came back (AdamW's moments, step).
    o_ref = get_optimizer_state_dict(model, opt)["state"]
    o_res = get_optimizer_state_dict(model2, opt2)["state"]
    types = sorted({type(p.to_local()).__name__ for p in model2.parameters()})
    return {
        "ref": ref,
        "resumed": resumed,
        "w_ref": worker.full_weights(model),
        "w_res": worker.full_weights(model2),
        "types": types,
        "optim_keys": sorted(o_ref) == sorted(o_res),
    }


def run_dcp_all(args):
    out = {}
    ckpt = args.ckpt
    for recipe in args.recipes.split(","):
        args.recipe, args.ckpt = recipe, os.path.join(ckpt, recipe)
        out[recipe] = run_dcp(args)
    args.ckpt = ckpt
    return out


# ---- DDP ---------------------------------------------------------------------------------------


def run_ddp_all(args):
    """Release off, on, and on with gradient_as_bucket_view=True, one after the other in this
    process (one launch instead of three)."""
    out = worker.release_modes(lambda release: run_ddp(args, release, False))
    out["view"] = run_ddp(args, True, True)
    return out


def run_ddp(args, release, bucket_view):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zrw

    torch.manual_seed(0)
    seq = nn.Sequential(
        nn.Linear(args.d, args.hidden),
        nn.GELU(),
        nn.Linear(args.hidden, args.hidden),
        nn.GELU(),
        nn.Linear(args.hidden, args.d, bias=False),
    ).to(torch.bfloat16)
    zrw.convert(seq, args.recipe, release=release)
    # DDP before the first forward: its construction broadcasts the parameters' data (they
    # must not be released then); gradient buckets are separate storages unless
    # gradient_as_bucket_view=True, and the bucket copy reads .grad, never the weight.
    if args.late_ddp:  # probe: a forward (weights released) before DDP is constructed
        # (an optimizer with the boundary owns the weights: zrw releases only those)
        early = worker.master_weights(seq.parameters(), args.lr)
        seq(torch.randn(args.tokens, args.d, dtype=torch.bfloat16))
        del early
    model = DDP(seq, gradient_as_bucket_view=bucket_view)
    opt = worker.master_weights(seq.parameters(), args.lr)
    data = batches(args, args.steps)
    rows = slice(dist.get_rank() * args.tokens, (dist.get_rank() + 1) * args.tokens)
    released = [0] * args.steps  # the most bytes released inside each step

    def note(step, mb=None):
        released[step] = max(released[step], zrw.cache.cache_stats()["released_bytes"])

    def loss_of(step, mb):
        loss = model(data[step * args.micro_batches + mb][rows].to(torch.bfloat16))
        note(step)
        return loss.float().pow(2).mean()

    last = args.micro_batches - 1
    losses, _ = worker.train(
        opt,
        range(args.steps),
        args.micro_batches,
        loss_of,
        group=dist.group.WORLD,
        context=lambda s, mb: model.no_sync() if mb < last else contextlib.nullcontext(),
        after_backward=note,
    )
    # Read through state_dict: the BF16-free step keeps the weights released after the step.
    sd = seq.state_dict()
    weights = {n: sd[n].float().clone() for n, _ in seq.named_parameters()}
    # DDP keeps the replicas identical: every rank ends with the same weights.
    sums = [None] * args.world
    dist.all_gather_object(sums, [w.double().sum().item() for w in weights.values()])
    return {
        "losses": losses,
        "weights": weights,
        "released": released,
        "replicas_equal": all(s == sums[0] for s in sums),
    }


def run(args):
    if args.late_ddp:
        return run_ddp(args, True, False)
    tasks = {"dcp": run_dcp_all, "ddp": run_ddp_all}
    return {task: tasks[task](args) for task in args.tasks.split(",")}


if __name__ == "__main__":
    ap = worker.parser(__doc__)
    ap.add_argument("--tasks", default="dcp,ddp", help="dcp, ddp or both, comma-separated")
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--recipes", default="mxfp8,mxfp8-32x32", help="--tasks dcp")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--late-ddp", action="store_true")
    worker.main(run, ap.parse_args(), quiet=False)
