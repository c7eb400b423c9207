"""One rank of the expert-parallel-inside-FSDP2 test (spawned by test_fsdp_2d.py: 2 ranks, gloo).

torchtitan's MoE layout through transformers' own engine: a tiny Qwen3-MoE whose experts are
sharded over EP (ep_size=2, `ep_dispatch_experts` with the all-to-all token exchange: the
engine's dispatch) and everything under FSDP2 over DP (fsdp_size=2; transformers' fsdp_plan,
its mixed precision: FP32 shards, BF16 compute). zrw's order: zrw.convert, zrw.fsdp.prepare,
then the engine (zrw.parallel.apply_plan, which runs what from_pretrained(...,
distributed_config=...) runs). Modes: zrw with release on and off, bf16 (the same model without
zrw: FSDP2's BF16 all-gather), and rank 0 alone unsharded (zrw, release on) on the global batch.
Several --run's (one per recipe) go in one launch (helpers.worker).
"""

import torch
import torch.distributed as dist

from helpers import worker

VOCAB = 128


def build(seed=0):
    """The tiny Qwen3-MoE in FP32 (the caller casts it)."""
    from helpers.models import make_model

    return make_model(
        "moe", seed, vocab=VOCAB, heads=4, kv_heads=2, ffn=128, moe_ffn=64, dtype=None
    )


def batches(args):
    """Per step and micro-batch, the global batch: one sequence of 16 tokens per rank."""
    return worker.batches(
        args.steps * args.micro_batches,
        lambda g: torch.randint(0, VOCAB, (args.world, 16), generator=g),
    )


def converted(model):
    import zrw

    return [
        f"{n}.{p}"
        for n, m in model.named_modules()
        if zrw.planes.is_zrw_layer(m)
        for p in m.zrw_quantized
    ]


def run_sharded(args, mode):
    from transformers.distributed import DistributedConfig

    import zrw
    import zrw.fsdp
    import zrw.testing

    model = build().float()
    names = []
    if mode != "bf16":
        zrw.convert(model, args.recipe, release=(mode == "on"))
        names = converted(model)
        zrw.fsdp.prepare(model)
    # A decoder layer's FSDP2 group gathers, besides its converted attention weights, its
    # norms and router in BF16 (the experts have a group of their own, over EP).
    attention = {f"self_attn.{n}_proj.weight" for n in "qkvo"}
    other = sum(
        p.numel()
        for n, p in model.model.layers[0].named_parameters()
        if n not in attention and not n.startswith("mlp.experts.")
    )
    model = zrw.parallel.apply_plan(
        model,
        DistributedConfig(
            fsdp_size=args.world,
            ep_size=args.world,
            tp_size=1,
            ep_implementation="all_to_all",
            fsdp_mixed_precision=True,
        ),
    )
    expert_placements = {
        n: (str(p.placements), type(p._local_tensor).__name__)
        for n, p in model.named_parameters()
        if ".experts." in n
    }
    opt = zrw.optim.attach(torch.optim.AdamW(model.parameters(), lr=args.lr), fill="dequant")
    rank = dist.get_rank()
    data = batches(args)

    def loss_of(step, mb):
        ids = data[step * args.micro_batches + mb][rank : rank + 1]
        return model(input_ids=ids, labels=ids).loss

    q0 = zrw.testing.shard_quantizations()
    with worker.count_gathered_bytes() as counts:
        losses, per_step = worker.train(
            opt,
            range(args.steps),
            args.micro_batches,
            loss_of,
            group=dist.group.WORLD,
            world=args.world,
            gathered=counts,
        )
    stats = zrw.cache.cache_stats()
    return {
        "losses": losses,
        "per_step_bytes": per_step,
        "calls": counts["sizes"],
        "layer_other_bytes": 2 * other,
        "converted": names,
        "quantizations": zrw.testing.shard_quantizations() - q0,
        "cache_entries": stats["entries"],
        "restored_bytes": stats["restored_bytes"],
        "expert_placements": expert_placements,
        "weights": worker.full_weights(model),
    }


def run_single(args):
    """The unsharded zrw run on the global batch (the loss averages both sequences' tokens as
    the ranks' mean does: equal token counts)."""
    import zrw

    model = build()
    zrw.convert(model, args.recipe)
    model = model.to(torch.bfloat16)
    opt = zrw.optim.AdamW(model.parameters(), lr=args.lr)
    data = batches(args)

    def loss_of(step, mb):
        ids = data[step * args.micro_batches + mb]
        return (
            sum(
                model(input_ids=ids[r : r + 1], labels=ids[r : r + 1]).loss
                for r in range(args.world)
            )
            / args.world
        )

    return worker.train(opt, range(args.steps), args.micro_batches, loss_of)[0]


def run(args):
    out = {mode: run_sharded(args, mode) for mode in ("on", "off", "bf16")}
    if args.rank == 0:
        out["single_losses"] = run_single(args)
    dist.barrier()
    return out


if __name__ == "__main__":
    ap = worker.parser(__doc__)
    worker.main(worker.each_run(run, ap), ap.parse_args(), hf=True)
