"""The 2-D row of `python -m zrw.bench seed` ("5.2-2d"): the seed's 5.2 shapes (Qwen3-32B) at
TP=2 x FSDP=2 on 4 gloo ranks, torchtitan's layout on one DeviceMesh ("dp", "tp").

Each rank trains `steps` x `micro_batches` in two modes, in one process, with the same zrw layers
(MXFP8 GEMMs) and the same data:
  before  FSDP2 gathers each TP-local weight in BF16 (no zrw.fsdp.prepare); the layer quantizes
          the gathered weight (both planes) at its use, so a gathered layer holds its BF16 copy
          and its FP8 copy;
  after   zrw.fsdp.prepare: FSDP2 gathers the MXFP8 planes of each rank's TP-local shard
          (quantized once per optimizer step); no BF16 copy of the unsharded weight exists.
FP32 sharded parameters (the masters) with a BF16 param_dtype, SGD with zrw's boundary. Per rank
it reports the window (first forward to the optimizer step) and global peaks of zrw.memory's
counting allocator, the all-gather bytes per step (counted at the process group), and the
theory: per TP-local element of a layer FSDP2 holds unsharded at the peak, "before" gathers BF16
(2 bytes) where "after" gathers one MXFP8 plane (1 + 1/32 bytes): 1 - 1/32 bytes saved per
element. (The layer's FP8 copy that "before" makes lives no longer than the gathered weight it
is made from, except the backward plane its autograd function keeps, which "after" keeps too.)
With one layer, one is unsharded at a time; with more, FSDP2's implicit prefetch gathers the
next one while the current computes: two.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
import time
from typing import Dict, List, Optional

import torch

import zrw
import zrw.fsdp
import zrw.testing
from zrw import memory, ops
from zrw.bench._timing import print_table, typical_step

MIB = 2**20
DP, TP = 2, 2
THEORY_BYTES = 1 - 1 / 32  # per TP-local element of an unsharded layer (see the docstring)
STATE_BYTES = 10.0  # per TP-local converted weight per rank at the peak of the setup (see plan)


def tp_local_per_layer(s: dict) -> int:
    """Converted weights of one decoder layer that one TP rank holds (q/k/v, gate/up colwise,
    o/down rowwise: each split in two)."""
    h, qd, kvd = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    return (h * qd + 2 * h * kvd + qd * h + 3 * h * s["ffn"]) // TP


def plan_layers(
    s: dict, budget: int, requested: Optional[int], seed_layers: int, process_bytes: float
) -> int:
    """Layers to run: as many of the seed's as the host budget holds for all 4 ranks (each rank
    builds its layers in BF16, keeps its TP shard in FP32 while FSDP2 shards it: ~10 bytes per
    TP-local weight at the setup's peak), at least one."""
    if requested is not None:
        return max(1, min(requested, seed_layers))
    per_layer = tp_local_per_layer(s) * STATE_BYTES * DP * TP
    fixed = DP * TP * process_bytes
    fit = int((budget - fixed) // per_layer) if budget > fixed else 0
    return max(1, min(seed_layers, fit))


def _train(mode: str, build, s: dict, layers: int, args: dict, mesh) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = build("dense", s, layers)
    zrw.convert(model, "mxfp8")
    plan = {}
    for i in range(layers):
        pre = f"model.layers.{i}"
        for n in ("q_proj", "k_proj", "v_proj"):
            plan[f"{pre}.self_attn.{n}"] = ColwiseParallel()
        plan[f"{pre}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{pre}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{pre}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{pre}.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    model.float()  # FP32 shards: FSDP2's masters
    if mode == "after":
        zrw.fsdp.prepare(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    opt = zrw.optim.attach(torch.optim.SGD(model.parameters(), lr=1e-4), fill="dequant")
    res: Dict[str, List] = {
        "window_peaks": [],
        "optimizer_peaks": [],
        "losses": [],
        "gathered_bytes": [],
    }

    def window_end(o, a, k):
        res["window_peaks"].append(memory.peak())
        memory.reset_peak()

    opt.register_step_pre_hook(window_end)
    opt.register_step_post_hook(lambda o, a, k: res["optimizer_peaks"].append(memory.peak()))
    dp_rank = mesh["dp"].get_local_rank()
    g = torch.Generator().manual_seed(1 + dp_rank)  # each DP rank its data, shared over TP
    vocab = model.config.vocab_size
    data = [
        [
            torch.randint(0, vocab, (1, args["tokens"]), generator=g)
            for _ in range(args["micro_batches"])
        ]
        for _ in range(args["steps"])
    ]
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with zrw.testing.count_all_gather_bytes() as counts:
            for step in data:
                gc.collect()
                dist.barrier()
                before = counts["bytes"]
                memory.reset_peak()
                for ids in step:
                    loss = model(input_ids=ids, labels=ids).loss
                    (loss / len(step)).backward()
                    res["losses"].append(loss.item())
                    del loss
                res["gathered_bytes"].append(counts["bytes"] - before)
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        if gc_was_enabled:
            gc.enable()
    del model, opt
    zrw.cache.cache_clear()
    return res


def _rank(rank: int, build, s: dict, layers: int, args: dict, port: int, out: str) -> None:
    import warnings

    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(max(1, args["threads"] // (DP * TP)))
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(DP * TP),
        LOCAL_RANK=str(rank),
    )
    dist.init_process_group("gloo", rank=rank, world_size=DP * TP)
    memory.install()
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    mine = {"rank": rank}
    for mode in ("before", "after"):
        ops.free_matmul_workspace()  # each mode allocates its own (see bench seed)
        mine[mode] = _train(mode, build, s, layers, args, mesh)
        gc.collect()
    gathered = [None] * (DP * TP)
    dist.all_gather_object(gathered, mine)
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)


def run(
    build,
    s: dict,
    tiny: bool,
    budget: int,
    layers: Optional[int],
    tokens: int,
    micro_batches: int,
    steps: int,
    threads: int,
    seed_layers: int,
    process_bytes: float,
    free_port,
) -> dict:
    import torch.multiprocessing as mp

    n_layers = plan_layers(s, budget, layers, seed_layers, process_bytes)
    args = {"tokens": tokens, "micro_batches": micro_batches, "steps": steps, "threads": threads}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ranks.json")
        mp.spawn(
            _rank, args=(build, s, n_layers, args, free_port(), out), nprocs=DP * TP, join=True
        )
        with open(out) as f:
            ranks = json.load(f)
    per_layer = tp_local_per_layer(s)
    rows = []
    for r in ranks:
        b, a = r["before"], r["after"]
        wb, wa = b["window_peaks"], a["window_peaks"]
        gb = [max(w, o) for w, o in zip(wb, b["optimizer_peaks"])]
        ga = [max(w, o) for w, o in zip(wa, a["optimizer_peaks"])]
        sw = typical_step([x - y for x, y in zip(wb, wa)])
        sg = typical_step([x - y for x, y in zip(gb, ga)])
        theory = THEORY_BYTES * per_layer * min(2, n_layers)
        rows.append(
            {
                "rank": r["rank"],
                "tp_local_params_per_layer": per_layer,
                "layers_unsharded_at_peak": min(2, n_layers),
                "theory_bytes": theory,
                "window_peak_before_bytes": wb[sw],
                "window_peak_after_bytes": wa[sw],
                "window_saving_bytes": wb[sw] - wa[sw],
                "window_saving_vs_theory": (wb[sw] - wa[sw]) / theory,
                "global_peak_before_bytes": gb[sg],
                "global_peak_after_bytes": ga[sg],
                "global_saving_bytes": gb[sg] - ga[sg],
                "gathered_bytes_before": b["gathered_bytes"],
                "gathered_bytes_after": a["gathered_bytes"],
                "gathered_ratio": a["gathered_bytes"][-1] / b["gathered_bytes"][-1],
                "losses_before": b["losses"],
                "losses_after": a["losses"],
                "losses_bitwise_equal": b["losses"] == a["losses"],
            }
        )
    return {
        "config": "5.2-2d",
        "title": "Qwen3-32B shapes, TP=2 x FSDP2=2 on 4 ranks "
        "(parallelize_module on mesh['tp'], fully_shard on mesh['dp'])",
        "tiny": tiny,
        "shapes": s,
        "world": DP * TP,
        "dp": DP,
        "tp": TP,
        "seed_layers": seed_layers,
        "layers_run": n_layers,
        "host_budget_bytes": budget,
        "tokens_per_micro_batch": tokens,
        "micro_batches": micro_batches,
        "steps": steps,
        "seconds": time.perf_counter() - t0,
        "ranks": rows,
    }


def print_2d(r: dict) -> None:
    s = r["shapes"]
    print(f"\n{r['config']}  {r['title']}")
    print(
        "  shapes: "
        + ", ".join(f"{k} {v}" for k, v in s.items())
        + (" (TINY, for tests)" if r["tiny"] else "")
    )
    print(
        f"  {r['layers_run']} layer(s) of the seed's {r['seed_layers']} (host budget "
        f"{r['host_budget_bytes'] / 2**30:.1f} GiB for 4 ranks); {r['steps']} steps x "
        f"{r['micro_batches']} micro-batches of {r['tokens_per_micro_batch']} tokens; "
        f"{r['seconds']:.0f} s. before: FSDP2's BF16 all-gather (the layer quantizes the "
        "gathered weight); after: zrw's MXFP8 all-gather"
    )
    rows = []
    for x in r["ranks"]:
        rows.append(
            [
                x["rank"],
                f"{x['tp_local_params_per_layer']:,}",
                f"{x['theory_bytes'] / MIB:,.1f}",
                f"{x['window_peak_before_bytes'] / MIB:,.1f} -> "
                f"{x['window_peak_after_bytes'] / MIB:,.1f}",
                f"{x['window_saving_bytes'] / MIB:,.1f}",
                f"{100 * x['window_saving_vs_theory']:.1f}%",
                f"{x['global_saving_bytes'] / MIB:,.1f}",
                f"{x['gathered_ratio']:.3f}x",
                "yes" if x["losses_bitwise_equal"] else "NO",
            ]
        )
    print_table(
        "",
        [
            "rank",
            "TP-local params/layer",
            "theory MiB",
            "fwd/bwd peak MiB",
            "window saving MiB",
            "of theory",
            "global-peak saving MiB",
            "all-gather bytes vs BF16",
            "losses bitwise",
        ],
        rows,
    )
