"""One rank of the tensor / expert parallel tests (spawned by test_parallel.py; gloo on CPU).

Tiny Qwen3 / Qwen3-MoE models (transformers classes, seeded random init; the converted weights
BF16, see `build`) are converted with zrw.convert, sharded by a real engine and trained 3 steps x
2 micro-batches under zrw.optim.MasterWeights(AdamW) with the zrw boundary, once with release off
and once with release on. Engines:
  torch   PyTorch's parallelize_module: q/k/v and gate/up ColwiseParallel, o and down
          RowwiseParallel (the torchtitan way); MoE experts stay whole on every rank. The
          per-head q_norm/k_norm see only this rank's heads: their gradients are summed over
          the ranks by a hook on each backward pass's gradient.
  hf      transformers' own engine: the model's base_model_tp_plan / base_model_ep_plan under
          DistributedConfig, applied by zrw.parallel.apply_plan (the engine's
          prepare_distribute_model + maybe_distribute_model, as from_pretrained runs them).
Rank 0 also trains the same model unsharded (zrw, release on) on the same batches. Every rank
reports the BF16 bytes released inside each step and what zrw.parallel.prepare counted; rank 0
writes everything (losses, first-step gradients, final weights, all gathered whole) to --out.

--cases names what to run (CASES, or "errors"); they run one after the other in one launch.
"""

import torch
import torch.distributed as dist

from helpers import worker

VOCAB = 128
LR = 1e-2  # AdamW


def build(
    kind,
    heads,
    kv_heads,
    ffn,
    moe_ffn,
    experts,
    act="fp32",
    freeze_head_norms=False,
    seed=0,
    layers=2,
):
    """The converted layers' weights (linears, expert stacks; not lm_head) are BF16, as zrw
    releases them. act="fp32" keeps everything else (embeddings, norms, router, head) in FP32,
    so that activations, partial products and the engines' collectives are FP32 and a sharded
    run differs from the unsharded one by the order of FP32 sums only; act="bf16": all BF16."""
    from helpers.models import make_model

    sizes = dict(heads=heads, kv_heads=kv_heads, ffn=ffn, moe_ffn=moe_ffn, experts=experts)
    model = make_model(kind, seed, vocab=VOCAB, layers=layers, dtype=None, **sizes)
    if kind != "dense":
        # A zero router sends every token of the first step to the same two experts (a tie
        # that top-k breaks the same way for every token): the other experts get no token in
        # that step and must still be restored and written back exactly.
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.zero_()
    if freeze_head_norms:
        # transformers 5.23's replicated_with_grad_allreduce (its q_norm/k_norm rule) sums the
        # ACCUMULATED .grad over the ranks after every backward pass, so with 2 micro-batches
        # the first one's gradient is counted twice (2·G1 + G2): an engine issue, not zrw's.
        # Frozen norms keep the sharded and unsharded runs comparable.
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.requires_grad_(False)
            layer.self_attn.k_norm.weight.requires_grad_(False)
    if act == "bf16":
        return model.to(torch.bfloat16).train()
    for name, mod in model.named_modules():
        if (isinstance(mod, torch.nn.Linear) and "lm_head" not in name) or name.endswith("experts"):
            mod.to(torch.bfloat16)
    return model.train()


def batches(n):
    """n micro-batches of token ids (step s, micro-batch mb: index s * micro + mb)."""
    return worker.batches(n, lambda g: torch.randint(0, VOCAB, (2, 16), generator=g))


def torch_tp(model, world, kind):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = worker.mesh(world)
    plan = {}
    for i in range(len(model.model.layers)):
        pre = f"model.layers.{i}"
        for n in ("q_proj", "k_proj", "v_proj"):
            plan[f"{pre}.self_attn.{n}"] = ColwiseParallel()
        plan[f"{pre}.self_attn.o_proj"] = RowwiseParallel()
        if kind == "dense":
            plan[f"{pre}.mlp.gate_proj"] = ColwiseParallel()
            plan[f"{pre}.mlp.up_proj"] = ColwiseParallel()
            plan[f"{pre}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    for name, p in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            # each rank's gradient covers its own heads: sum them, per backward pass (a hook
            # on the incoming gradient, so that accumulated micro-batches are summed once)
            p.register_hook(_sum_over_ranks)
    return model


def _sum_over_ranks(grad):
    grad = grad.clone()
    dist.all_reduce(grad)
    return grad


def hf_plan(model, tp, ep):
    from transformers.distributed import DistributedConfig

    import zrw

    kw = {"tp_size": tp}
    if ep > 1:
        kw["ep_size"] = ep
    return zrw.parallel.apply_plan(model, DistributedConfig(**kw))


def train(model, data, args, record_routing=False):
    """args.steps x args.micro_batches; returns the losses (each micro-batch's, divided by the
    micro-batch count), the first step's gradients, the BF16 bytes released inside each step
    (read at the optimizer pre-hook, registered before zrw's boundary) and tokens per expert per
    step."""
    import zrw

    full = worker.full
    opt = zrw.optim.MasterWeights(torch.optim.AdamW, model.parameters(), lr=LR, weight_decay=0.0)
    released, grads = [], {}

    def pre_step(o, a, k):
        released.append(zrw.cache.cache_stats()["released_bytes"])
        if not grads:  # the first step's gradients (every rank gathers the DTensor ones)
            for n, p in model.named_parameters():
                g = getattr(p, "main_grad", None)  # zrw.convert(main_grad=True): FP32
                g = p.grad if g is None else g
                if g is not None:
                    grads[n] = full(g)

    opt.register_step_pre_hook(pre_step)
    zrw.optim.attach(opt)
    counts, hooks = [], []
    if record_routing:
        for i, layer in enumerate(model.model.layers):

            def rec(m, inp, out, i=i):
                idx = out[2].reshape(-1)
                counts[-1][i] += torch.bincount(idx, minlength=m.num_experts)

            hooks.append(layer.mlp.gate.register_forward_hook(rec))

    def loss_of(step, mb):
        if record_routing and mb == 0:
            counts.append([0] * len(model.model.layers))
        ids = data[step * args.micro_batches + mb]
        return model(input_ids=ids, labels=ids).loss

    losses, _ = worker.train(opt, range(args.steps), args.micro_batches, loss_of)
    for h in hooks:
        h.remove()
    zrw.cache.cache_clear()
    return {
        "losses": torch.tensor(losses),
        "released": released,
        "grads": grads,
        "tokens_per_expert": [[c.tolist() for c in s] for s in counts],
    }


def local_converted_elements(model):
    """Elements of the converted weights this rank holds, read from the model itself."""
    from zrw.nn.convert import is_zrw_layer
    from zrw.parallel import local_tensor

    n = 0
    for mod in model.modules():
        if is_zrw_layer(mod):
            n += sum(local_tensor(getattr(mod, p)).numel() for p in mod.zrw_quantized)
    return n


def run_case(case, args, world, rank):
    import zrw

    engine, kind = case["engine"], case["kind"]
    shape = dict(
        heads=case.get("heads", 4),
        kv_heads=case.get("kv_heads", 2),
        ffn=case.get("ffn", 128),
        moe_ffn=case.get("moe_ffn", 64),
        experts=case.get("experts", 4),
        act=case.get("act", "fp32"),
        freeze_head_norms=(engine == "hf"),
    )
    data = batches(args.steps * args.micro_batches)
    main_grad = case.get("main_grad", False)
    # The runs are compared with the unsharded one, which must route every token to the same
    # experts: the sharded runs sum in another FP32 order, and with the rceil scale rule (the
    # recipes' default) one near-tie of the MoE router flips a token on step 3
    # (layer 1: 24/40 tokens against 23/41), after which the runs cannot be compared. The
    # scale rule is not what this worker tests: its comparisons keep the floor rule, whose
    # routing agrees.
    recipe = zrw.get_recipe("mxfp8", scale_mode="floor")
    out = {}
    orders = case.get("orders", ["before"])
    for mode in ("off", "on"):
        for order in orders if mode == "on" else ["before"]:
            model = build(kind, **shape)
            if order == "before":
                zrw.convert(model, recipe, release=(mode == "on"), main_grad=main_grad)
            if engine == "torch":
                model = torch_tp(model, world, kind)
            else:
                model = hf_plan(model, case.get("tp", world), case.get("ep", 1))
            if order == "after":
                zrw.convert(model, recipe, release=True, main_grad=main_grad)
            summary = zrw.parallel.prepare(model)
            r = train(model, data, args, record_routing=(kind == "moe"))
            r["prepare"] = {
                "local_elements": summary.local_elements,
                "release_bytes": summary.release_bytes,
                "weights": summary.weights,
            }
            r["counted_elements"] = local_converted_elements(model)
            r["weights"] = worker.full_weights(model)
            gathered = [None] * world
            dist.all_gather_object(
                gathered, {k: r[k] for k in ("released", "prepare", "counted_elements")}
            )
            r["per_rank"] = gathered
            key = mode if order == "before" else f"{mode}_{order}"
            out[key] = r
            del model
    if rank == 0:
        model = build(kind, **shape)
        zrw.convert(model, recipe, release=True, main_grad=main_grad)
        r = train(model, data, args, record_routing=(kind == "moe"))
        r["weights"] = worker.full_weights(model)
        out["unsharded"] = r
    dist.barrier()
    return out


def run_errors(args, world, rank):
    """Refusals, each caught on every rank (so no rank waits in a collective)."""
    import zrw

    out = {}
    # A shard boundary inside a 32-block: 1 KV head of 32 split over the ranks.
    model = build("dense", heads=4, kv_heads=2, ffn=96, moe_ffn=64, experts=4)
    zrw.convert(model, "mxfp8")
    model = hf_plan(model, world, 1)
    try:
        zrw.parallel.prepare(model)
        out["misaligned"] = "no error"
    except ValueError as e:
        out["misaligned"] = str(e)
    # The same weights in a forward without prepare (the layer checks them too).
    try:
        model(input_ids=batches(1)[0]).logits.sum()
        out["misaligned_forward"] = "no error"
    except ValueError as e:
        out["misaligned_forward"] = str(e)
    # convert after transformers' plan: the engine's wrappers close over the old modules.
    model = hf_plan(build("moe", heads=4, kv_heads=2, ffn=128, moe_ffn=64, experts=4), world, 1)
    try:
        zrw.convert(model, "mxfp8")
        out["convert_after_hf"] = "no error"
    except RuntimeError as e:
        out["convert_after_hf"] = str(e)
    # experts handed to forward as to_local() views without zrw.parallel.prepare
    model = build("moe", heads=4, kv_heads=2, ffn=128, moe_ffn=64, experts=4)
    zrw.convert(model, "mxfp8")
    model = hf_plan(model, world, world)
    try:
        ids = batches(1)[0]
        model(input_ids=ids, labels=ids).loss.backward()
        out["no_prepare"] = "no error"
    except RuntimeError as e:
        out["no_prepare"] = str(e)
    zrw.cache.cache_clear()
    # Mid-step (weights released): state_dict() materializes the BF16 of the DTensor masters,
    # shard by shard, as DTensors laid out as the weights, which stay released; after
    # restore_all("master") the weights themselves hold the same values.
    model = build("dense", heads=4, kv_heads=2, ffn=128, moe_ffn=64, experts=4)
    zrw.convert(model, "mxfp8")
    model = hf_plan(model, world, 1)
    zrw.parallel.prepare(model)
    opt = zrw.optim.attach(zrw.optim.MasterWeights(torch.optim.AdamW, model.parameters()))
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    name = "model.layers.0.self_attn.o_proj.weight"
    master = opt.masters[0][[n for n, _ in model.named_parameters()].index(name)]
    weight = model.get_parameter(name)
    sd = model.state_dict()
    full = worker.full
    same = torch.equal(full(sd[name]), full(master).bfloat16().float())  # collective: all ranks
    out["state_dict_mid_step"] = (
        zrw.parallel.is_dtensor(sd[name])
        and sd[name].placements == weight.placements
        and same
        and zrw.cache.is_released(zrw.parallel.local_tensor(weight))
    )
    zrw.cache.restore_all("master")
    sd = model.state_dict()
    out["restored_equals_master"] = torch.equal(full(sd[name]), full(master).bfloat16().float())
    opt.step()
    zrw.cache.cache_clear()
    dist.barrier()
    return out


CASES = {
    # 2 ranks
    "torch_dense": dict(engine="torch", kind="dense", orders=["before", "after"]),
    "torch_moe": dict(engine="torch", kind="moe", main_grad=True),
    # Megatron-style FP32 weight gradients (zrw.convert(main_grad=True)) on DTensor weights
    "hf_dense": dict(engine="hf", kind="dense", main_grad=True),
    "hf_moe_tp": dict(engine="hf", kind="moe"),
    "hf_moe_ep": dict(engine="hf", kind="moe", ep=2, main_grad=True),
    "hf_moe_ep_bf16": dict(engine="hf", kind="moe", ep=2, act="bf16"),
    # 4 ranks: 4 KV heads (a 32-row shard each), expert FFN 128 (32 per rank of each part)
    "hf_moe_ep4": dict(engine="hf", kind="moe", ep=4, kv_heads=4, experts=8),
    "torch_dense_tp4": dict(engine="torch", kind="dense", kv_heads=4),
}


def run(args):
    return {
        name: run_errors(args, args.world, args.rank)
        if name == "errors"
        else run_case(CASES[name], args, args.world, args.rank)
        for name in args.cases.split(",")
    }


if __name__ == "__main__":
    ap = worker.parser(__doc__)
    ap.add_argument("--cases", required=True, help="comma-separated names (CASES, errors)")
    worker.main(run, ap.parse_args(), hf=True)
