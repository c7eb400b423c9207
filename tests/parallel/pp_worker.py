"""One rank of the pipeline-parallel tests (spawned by test_pipeline.py; gloo on CPU).

A tiny Qwen3 (transformers classes, seeded random init, BF16) is built whole on every rank with
the same seed, converted with zrw.convert, and split by layers: each rank keeps the stage(s) the
schedule gives it (`Stage`: the embedding on the first, its decoder layers, the norm and head on
the last; optionally torch.utils.checkpoint around each decoder layer) and drops the rest. Each
stage is a `torch.distributed.pipelining.PipelineStage` built by hand (no `pipeline()` tracing),
driven by ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B or ScheduleInterleavedZeroBubble
(those two with 2 stages per rank), and each
rank's `zrw.optim.AdamW` over its stages' parameters steps after `schedule.step()`.

Every case trains twice (release off, release on). Each rank records at every optimizer pre-hook
(the end of `schedule.step()`): the BF16 bytes released, the weights quantized (cache misses) and
restored (released storages given bytes again) so far, the live bytes (zrw.memory's counting
allocator, installed before any model exists) and whether each of its converted weights is
released; after training, its stages' state dicts (exact BF16, materialized from the FP32 masters
with the BF16-free step). Rank 0 also trains the whole model unsharded (one process, the same
stages in sequence, the same micro-batches, gradients divided by the micro-batch count as the
schedules do) and writes everything to --out.

--cases names what to run (CASES); they run one after the other in one launch.
"""

import gc

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from helpers import worker

VOCAB = 128
LAYERS = 4
SEQ = 16
LR = 1e-2  # AdamW


def build(seed=0):
    from helpers.models import make_model

    return make_model("dense", seed, vocab=VOCAB, layers=LAYERS, ffn=128)


class Stage(nn.Module):
    """Decoder layers `layer_ids` of a Qwen3ForCausalLM (the same module objects), with the
    embedding on the first stage and the final norm and head on the last. Parameter names keep
    the layer's index (`layers.2.mlp.up_proj.weight`), so they are unique across stages."""

    def __init__(self, model, layer_ids, first, last, recompute=False):
        super().__init__()
        self.first, self.last, self.recompute = first, last, recompute
        if first:
            self.embed_tokens = model.model.embed_tokens
        self.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layer_ids})
        self.rotary_emb = model.model.rotary_emb
        if last:
            self.norm = model.model.norm
            self.lm_head = model.lm_head

    def forward(self, x):
        h = self.embed_tokens(x) if self.first else x
        pos = torch.arange(h.shape[1]).unsqueeze(0)
        pe = self.rotary_emb(h, pos)
        for layer in self.layers.values():
            if self.recompute:
                h = checkpoint(
                    layer, h, position_ids=pos, position_embeddings=pe, use_reentrant=False
                )
            else:
                h = layer(h, position_ids=pos, position_embeddings=pe)
        if self.last:
            h = self.lm_head(self.norm(h))
        return h


def loss_fn(logits, target):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), target.reshape(-1))


def scaled_loss_fn(micro):
    """For main_grad: the schedules' scale_grads divides `.grad` only, so the loss is divided
    by the micro-batch count instead (scale_grads=False)."""
    return lambda logits, target: loss_fn(logits, target) / micro


def stage_layers(n_stages):
    per = LAYERS // n_stages
    return [list(range(s * per, (s + 1) * per)) for s in range(n_stages)]


def make_stages(model, stage_ids, n_stages, recompute):
    layers = stage_layers(n_stages)
    return [Stage(model, layers[s], s == 0, s == n_stages - 1, recompute) for s in stage_ids]


def data(steps, micro):
    """Per step, (inputs, targets) of `micro` sequences each (the schedule splits them)."""
    return worker.batches(
        steps,
        lambda g: (
            torch.randint(0, VOCAB, (micro, SEQ), generator=g),
            torch.randint(0, VOCAB, (micro, SEQ), generator=g),
        ),
    )


def converted_weights(modules):
    from zrw.nn.convert import is_zrw_layer

    return [
        getattr(m, p)
        for mod in modules
        for m in mod.modules()
        if is_zrw_layer(m)
        for p in m.zrw_quantized
    ]


def state(modules):
    out = {}
    for mod in modules:
        for k, v in mod.state_dict().items():
            if k not in out:  # rotary_emb's buffers appear in every stage
                out[k] = v.detach().float().clone()
    return out


def recorder(opt, weights, base):
    """Per optimizer pre-hook: the cache's counters, whether every converted weight is
    released, and zrw.memory's live and peak bytes above base["live"] (the first step's start)."""
    import zrw

    log = []

    def pre_step(o, a, k):
        s = zrw.cache.cache_stats()
        log.append(
            {
                "released_bytes": s["released_bytes"],
                "misses": s["misses"],
                "hits": s["hits"],
                "restored": s["restored"],
                "restored_bytes": s["restored_bytes"],
                "live": zrw.memory.current() - base["live"],
                "peak": zrw.memory.peak() - base["live"],
                "workspace": zrw.ops.matmul_workspace_bytes(),
                "all_released": all(zrw.cache.is_released(w) for w in weights),
            }
        )

    opt.register_step_pre_hook(pre_step)
    return log


SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
}


def run_pp(case, mode, steps, micro, world, rank):
    from torch.distributed import pipelining

    import zrw

    per_rank = 1 if case["schedule"] in ("gpipe", "1f1b") else 2  # looped: stages r, r + world
    n_stages = world * per_rank
    stage_ids = [rank + world * i for i in range(per_rank)]  # loop placement
    model = build()
    main_grad = case.get("main_grad", False)
    zrw.convert(model, case["recipe"], release=(mode == "on"), main_grad=main_grad)
    mods = make_stages(model, stage_ids, n_stages, case.get("recompute", False))
    del model  # the other ranks' layers go with it
    if case.get("static", False):
        # Shapes given up front: no metadata inference (the first step's extra forward and
        # input-gradient backward that PipelineStage runs without them).
        micro_shape = (1, SEQ)
        # (what flows between stages requires grad: the stages exchange its gradient)
        hidden = torch.empty(*micro_shape, 64, dtype=torch.bfloat16, requires_grad=True)
        logits = torch.empty(*micro_shape, VOCAB, dtype=torch.bfloat16, requires_grad=True)
        ins = [torch.zeros(micro_shape, dtype=torch.long) if s == 0 else hidden for s in stage_ids]
        outs = [logits if s == n_stages - 1 else hidden for s in stage_ids]
        stages = [
            pipelining.PipelineStage(
                m, s, n_stages, torch.device("cpu"), input_args=i, output_args=o
            )
            for m, s, i, o in zip(mods, stage_ids, ins, outs)
        ]
    else:
        stages = [
            pipelining.PipelineStage(m, s, n_stages, torch.device("cpu"))
            for m, s in zip(mods, stage_ids)
        ]
    cls = getattr(pipelining, SCHEDULES[case["schedule"]])
    sched = cls(
        stages if per_rank > 1 else stages[0],
        n_microbatches=micro,
        loss_fn=scaled_loss_fn(micro) if main_grad else loss_fn,
        scale_grads=not main_grad,
    )
    params = [p for m in mods for p in m.parameters()]
    opt = zrw.optim.AdamW(params, lr=LR, weight_decay=0.0)
    weights = converted_weights(mods)
    mem = {}
    log = recorder(opt, weights, mem)
    losses = []
    first, last = 0 in stage_ids, n_stages - 1 in stage_ids
    zrw.cache.cache_clear()  # the counters below start from 0
    # mx_matmul's tile workspace persists between calls: freed here, each mode allocates it in
    # its own first step instead of the first mode of the process paying for both.
    zrw.ops.free_matmul_workspace()
    # The memory baseline: the first step's start, after a barrier (gloo's threads free the
    # buffers of the previous collective, e.g. the last case's all_gather_object, when they
    # get to it, so a baseline read right after it may still count them).
    gc.collect()
    dist.barrier()
    mem["live"] = zrw.memory.current()
    starts = []
    for x, y in data(steps, micro):
        starts.append(zrw.memory.current() - mem["live"])
        zrw.memory.reset_peak()
        got = [] if last else None
        sched.step(*((x,) if first else ()), target=y if last else None, losses=got)
        if last:
            losses += [t.detach().float().clone() for t in got]
        opt.step()
        opt.zero_grad()
    out = {
        "losses": torch.stack(losses) if losses else None,
        "log": log,
        "weights": state(mods),
        "elements": sum(w.numel() for w in weights),
        "n_weights": len(weights),
        "stage_ids": stage_ids,
        "starts": starts,
    }
    del sched, stages, opt, mods
    zrw.cache.cache_clear()
    return out


def run_unsharded(recipe, steps, micro, main_grad=False, n_stages=2):
    """The whole model in this process: the same stages in sequence on each micro-batch, each
    micro-batch's loss backward, then the gradients divided by the micro-batch count (what the
    schedules' scale_grads does), AdamW, zero_grad."""
    import zrw

    model = build()
    zrw.convert(model, recipe, release=True, main_grad=main_grad)
    mods = make_stages(model, range(n_stages), n_stages, False)
    lf = scaled_loss_fn(micro) if main_grad else loss_fn
    opt = zrw.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for x, y in data(steps, micro):
        for xm, ym in zip(x.tensor_split(micro), y.tensor_split(micro)):
            h = xm
            for m in mods:
                h = m(h)
            loss = lf(h, ym)
            loss.backward()
            losses.append(loss.detach().float().clone())
        for p in model.parameters():
            if p.grad is not None and not main_grad:
                p.grad.div_(micro)
        opt.step()
        opt.zero_grad()
    out = {"losses": torch.stack(losses), "weights": state(mods)}
    zrw.cache.cache_clear()
    return out


CASES = {
    "gpipe_mxfp8": dict(schedule="gpipe", recipe="mxfp8"),
    "gpipe_32x32": dict(schedule="gpipe", recipe="mxfp8-32x32"),
    "1f1b_mxfp8": dict(schedule="1f1b", recipe="mxfp8"),
    "1f1b_32x32": dict(schedule="1f1b", recipe="mxfp8-32x32"),
    "interleaved_mxfp8": dict(schedule="interleaved", recipe="mxfp8"),
    "interleaved_32x32": dict(schedule="interleaved", recipe="mxfp8-32x32"),
    "1f1b_mxfp8_recompute": dict(schedule="1f1b", recipe="mxfp8", recompute=True),
    "interleaved_32x32_recompute": dict(
        schedule="interleaved", recipe="mxfp8-32x32", recompute=True
    ),
    # input and weight gradients in separate backward passes (torch.autograd.grad for each)
    "zero_bubble_32x32": dict(schedule="zero_bubble", recipe="mxfp8-32x32"),
    # FP32 main_grad (zrw.convert(main_grad=True)); the schedule's scale_grads divides .grad
    # only, so the loss is divided instead
    "1f1b_mxfp8_main_grad": dict(schedule="1f1b", recipe="mxfp8", main_grad=True),
    # PipelineStage given its input/output shapes: no metadata inference
    "gpipe_mxfp8_static": dict(schedule="gpipe", recipe="mxfp8", static=True),
    # 4 ranks, one stage (one decoder layer) each
    "1f1b_32x32_4stages": dict(schedule="1f1b", recipe="mxfp8-32x32"),
}


def run(args):
    res = {}
    names = args.cases.split(",")
    for name in names:
        case = CASES[name]
        res[name] = {}
        for mode in ("off", "on"):
            mine = run_pp(case, mode, args.steps, args.micro_batches, args.world, args.rank)
            gathered = [None] * args.world
            dist.all_gather_object(gathered, mine)
            res[name][mode] = gathered
    if args.rank == 0:
        refs = sorted({(CASES[n]["recipe"], CASES[n].get("main_grad", False)) for n in names})
        res["unsharded"] = {
            (r, mg): run_unsharded(r, args.steps, args.micro_batches, mg) for r, mg in refs
        }
    return res


if __name__ == "__main__":
    ap = worker.parser(__doc__, micro_batches=4)
    ap.add_argument("--cases", required=True, help="comma-separated names (CASES)")
    import zrw

    zrw.memory.install()  # before any model exists
    worker.main(run, ap.parse_args(), hf=True)
