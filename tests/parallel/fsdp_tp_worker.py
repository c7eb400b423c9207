"""One rank of the FSDP2 x TP tests (spawned by test_fsdp_2d.py: 4 ranks, gloo on CPU).

torchtitan's layout on one 2-D DeviceMesh ("dp", "tp") = (2, 2): a stack of MLP blocks (fc1
ColwiseParallel, fc2 RowwiseParallel, on mesh["tp"] with parallelize_module), then fully_shard
on mesh["dp"] per block and on the root, FP32 parameters with a BF16 param_dtype (the FP32
sharded parameters are the masters), AdamW with zrw's boundary. --task train runs the modes
  zrw      zrw.convert, parallelize_module, zrw.fsdp.prepare, fully_shard (MXFP8 all-gather),
           release on and off
  bf16     the same model without zrw (FSDP2's BF16 all-gather): the byte reference
  single   rank 0 alone: the unsharded zrw run on the global batch (MasterWeights(AdamW))
and writes losses, the final weights (full tensors), the all-gather bytes per step, the shard
quantizations and any zrw.fsdp warnings; --expect-error: zrw.fsdp.prepare's refusal;
--task dcp_save / dcp_resume: see run_dcp. Several --run's go in one launch (helpers.worker).
"""

import warnings

import torch
import torch.distributed as dist
from torch import nn

from helpers import worker


class Block(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden, bias=True)
        self.fc2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d, hidden, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def build(args, release=True, seed=0):
    import zrw

    torch.manual_seed(seed)
    model = Net(args.d, args.hidden, args.blocks)
    if args.mode != "bf16":
        zrw.convert(model, args.recipe, release=release, skip=())
    return model


def batches(args):
    """Per step and micro-batch, the global batch: dp * tokens rows (dp rank r takes its rows)."""
    return worker.batches(
        args.steps * args.micro_batches,
        lambda g: torch.randn(args.dp * args.tokens, args.d, generator=g),
    )


def run_single(args):
    import zrw

    model = build(args).to(torch.bfloat16)
    opt = zrw.optim.AdamW(model.parameters(), lr=args.lr)
    losses = worker.train_in_one_process(model, opt, batches(args), args)
    return losses, worker.masters_by_name(model, opt)


def setup_2d(args, release=True, seed=0):
    """The model sharded on the 2-D mesh and its optimizer; returns (model, opt, mesh)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import zrw
    import zrw.fsdp

    mesh = worker.mesh(args.dp, args.tp, names=("dp", "tp"))
    model = build(args, release, seed)
    plan = {}
    for i in range(args.blocks):
        plan[f"blocks.{i}.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.fc2"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    if args.mode == "zrw":
        zrw.fsdp.prepare(model, both_planes=args.both_planes)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, mesh=mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    opt = zrw.optim.attach(torch.optim.AdamW(model.parameters(), lr=args.lr), fill="dequant")
    return model, opt, mesh


def train_2d(model, opt, mesh, args, data, steps, counts=None):
    """Train `steps` (indices into the batches); returns the losses (mean over dp) and the
    all-gathered bytes of each step (with `counts`)."""
    dp_rank = mesh["dp"].get_local_rank()
    rows = slice(dp_rank * args.tokens, (dp_rank + 1) * args.tokens)
    return worker.train(
        opt,
        steps,
        args.micro_batches,
        worker.mean_square_loss(model, data, args.micro_batches, rows, torch.bfloat16),
        group=mesh["dp"].get_group(),
        world=args.dp,
        gathered=counts,
    )


def run_2d(args, release=True):
    import zrw
    import zrw.fsdp
    import zrw.testing

    model, opt, mesh = setup_2d(args, release)
    data = batches(args)
    states = {}

    def capture(mod, inputs, name):
        w = mod.weight
        local = w._local_tensor if zrw.parallel.is_dtensor(w) else w
        if isinstance(local, zrw.fsdp.MXGatheredWeight):
            states[name] = local._mx_state

    for name, mod in model.named_modules():
        if isinstance(mod, zrw.nn.MXLinear):
            mod.register_forward_pre_hook(lambda m, i, name=name: capture(m, i, name))
    q0 = zrw.testing.shard_quantizations()
    with worker.count_gathered_bytes() as counts:
        losses, per_step = train_2d(model, opt, mesh, args, data, range(args.steps), counts)
    quantizations = zrw.testing.shard_quantizations() - q0
    resident = {
        name: sum(t.untyped_storage().nbytes() for t in st["planes"].tensors())
        for name, st in states.items()
        if st["planes"] is not None
    }
    sharded = {
        n: (str(p.placements), tuple(p.device_mesh.mesh_dim_names or ()))
        for n, p in model.named_parameters()
    }
    return {
        "losses": losses,
        "weights": worker.full_weights(model),
        "per_step_bytes": per_step,
        "quantizations": quantizations,
        "resident_plane_bytes": resident,
        "placements": sharded,
    }


def run_dcp(args):
    """--task dcp_save: train 4 steps, saving model and optimizer with
    torch.distributed.checkpoint after step 2. --task dcp_resume (fresh processes): a model
    from another seed loads the checkpoint and trains steps 3 and 4."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    args.mode, args.steps = "zrw", 4
    data = batches(args)
    if args.task == "dcp_save":
        model, opt, mesh = setup_2d(args)
        first, _ = train_2d(model, opt, mesh, args, data, range(2))
        dcp.save(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
            checkpoint_id=args.ckpt,
        )
        rest, _ = train_2d(model, opt, mesh, args, data, range(2, 4))
        return {"first": first, "rest": rest, "weights": worker.full_weights(model)}
    model, opt, mesh = setup_2d(args, seed=1)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=args.ckpt)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    rest, _ = train_2d(model, opt, mesh, args, data, range(2, 4))
    types = sorted({type(p.to_local()).__name__ for p in model.parameters()})
    return {"rest": rest, "weights": worker.full_weights(model), "types": types}


def run(args):
    args.dp, args.tp = 2, args.world // 2
    if args.task != "train":
        return run_dcp(args)
    if args.expect_error:
        args.mode = "zrw"
        try:
            run_2d(args)
            return {"error": None}
        except (ValueError, RuntimeError) as e:
            return {"error": str(e)}
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args.mode = "zrw"
        out.update(worker.release_modes(lambda release: run_2d(args, release), ("on", "off")))
        args.mode = "bf16"
        out["bf16"] = run_2d(args)
    out["warnings"] = [str(w.message) for w in caught if "zrw.fsdp" in str(w.message)]
    if args.rank == 0:
        args.mode = "single"
        out["single_losses"], out["single_weights"] = run_single(args)
    dist.barrier()
    return out


if __name__ == "__main__":
    ap = worker.parser(__doc__, world=4, lr=1e-2)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--both-planes", action="store_true")
    ap.add_argument(
        "--expect-error", action="store_true", help="zrw.fsdp.prepare must raise: save its message"
    )
    ap.add_argument("--task", default="train", choices=["train", "dcp_save", "dcp_resume"])
    ap.add_argument("--ckpt", default="")
    worker.main(worker.each_run(run, ap), ap.parse_args(), quiet=False)
