"""`python -m zrw.bench cache`: the fused quant-and-release op and the restore at the boundary.

In one run, for both recipes and for bf16 weights of 2048 x 2048 and 4096 x 4096 (default), it
times:
  - the bare quantization (mx_quantize_dual for "mxfp8", mx_quantize_block for "mxfp8-32x32");
  - quant_and_release on a miss (lookup, quantize, insert, free + poison the BF16 storage), and
    on a miss with release=False (the cache alone, no release);
  - quant_and_release on a hit (every later use of the weight in the step);
and reports the miss and the hit as ratios of the bare quantization. Between two timed misses
the weight is restored by dequantization (untimed), so every miss reads realistic values.

Then it trains a small MLP (nn.Linear weights used through zrw.nn.mx_linear, MasterWeights(AdamW)
attached, a few microbatches per step) and reports the
restore at the optimizer boundary (attach's pre-hook: restore_all) as a fraction of the step.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import zrw
from zrw import cache, ops
from zrw.bench._timing import best_of, print_table
from zrw.config import get_recipe
from zrw.nn import mx_linear
from zrw.optim import MasterWeights, attach

BF16 = torch.bfloat16


def _bare(recipe):
    if recipe == "mxfp8":
        return lambda w: ops.mx_quantize_dual(w)
    return lambda w: ops.mx_quantize_block(w)


def _best_miss(w, recipe, release, repeat, warmup=1):
    """Best time of a quant_and_release miss; the entry is dropped (and the weight restored)
    between calls, outside the timed region."""
    best = float("inf")
    for i in range(warmup + repeat):
        if release:
            cache.restore(w, "dequant")  # no-op on the first pass
        else:
            cache.cache_invalidate(w)
        t0 = time.perf_counter()
        cache.quant_and_release(w, recipe, release)
        t = time.perf_counter() - t0
        if i >= warmup:
            best = min(best, t)
    cache.cache_invalidate(w)  # restores (dequant) if released
    return best


def time_op(shape, recipe, repeat):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(*shape, dtype=BF16))
    bare = _bare(recipe)
    t_bare = best_of(lambda: bare(w), repeat)
    t_miss = _best_miss(w, recipe, True, repeat)
    t_miss_keep = _best_miss(w, recipe, False, repeat)
    cache.quant_and_release(w, recipe)  # the miss; every call below is a hit
    assert cache.is_released(w)
    n_hit = 100
    t_hit = best_of(lambda: [cache.quant_and_release(w, recipe) for _ in range(n_hit)],
                    repeat) / n_hit
    cache.cache_invalidate(w)
    return {
        "bare_ms": t_bare * 1e3,
        "miss_ms": t_miss * 1e3,
        "miss_no_release_ms": t_miss_keep * 1e3,
        "hit_us": t_hit * 1e6,
        "miss_over_bare": t_miss / t_bare,
        "miss_no_release_over_bare": t_miss_keep / t_bare,
        "hit_over_bare": t_hit / t_bare,
    }


def time_step(recipe, dim, layers, tokens, micro, steps, fill="empty"):
    """Trains an MLP of `layers` dim x dim weights; returns the best step time and the best
    restore time at the boundary (attach's pre-hook, with `fill`), each over `steps` steps after
    one warm-up."""
    torch.manual_seed(0)
    rcp = get_recipe(recipe)
    lins = [torch.nn.Linear(dim, dim, bias=False, dtype=BF16) for _ in range(layers)]
    ws = [l.weight for l in lins]
    opt = MasterWeights(torch.optim.AdamW, ws, lr=1e-3)
    marks = {}
    opt.register_step_pre_hook(lambda o, a, k: marks.__setitem__("pre", time.perf_counter()))
    attach(opt, fill=fill)  # its pre-hook (restore_all) runs between the two marks
    opt.register_step_pre_hook(lambda o, a, k: marks.__setitem__("post", time.perf_counter()))
    xs = [torch.randn(tokens, dim, dtype=BF16) for _ in range(micro)]
    best_step = best_restore = float("inf")
    released = 0
    for s in range(steps + 1):
        t0 = time.perf_counter()
        for x in xs:
            h = x
            for i, w in enumerate(ws):
                h = mx_linear(h, w, None, rcp)  # zrw's MXLinear numerics
                if i + 1 < layers:
                    h = torch.relu(h)
            (h.float().pow(2).mean() / micro).backward()
        released = cache.cache_stats()["released_bytes"]
        opt.step()
        opt.zero_grad()
        t = time.perf_counter() - t0
        if s > 0:  # the first step allocates the optimizer state
            best_step = min(best_step, t)
            best_restore = min(best_restore, marks["post"] - marks["pre"])
    cache.cache_clear()
    return {
        "step_ms": best_step * 1e3,
        "restore_ms": best_restore * 1e3,
        "restore_fraction": best_restore / best_step,
        "released_bytes": released,
    }


def run(sizes=((2048, 2048), (4096, 4096)), repeat=5, dim=1024, layers=4, tokens=32,
        micro=4, steps=3) -> dict:
    cache.cache_clear()
    out = {
        "threads": torch.get_num_threads(),
        "cpu_isa": zrw._C.cpu_isa(),
        "shapes": [list(s) for s in sizes],
        "op": {},
        "step": {},
        "mlp": {"dim": dim, "layers": layers, "tokens": tokens, "microbatches": micro,
                "optimizer": "MasterWeights(AdamW)"},
    }
    for recipe in cache.RECIPES:
        out["op"][recipe] = {f"{n}x{k}": time_op((n, k), recipe, repeat) for n, k in sizes}
        out["step"][recipe] = {fill: time_step(recipe, dim, layers, tokens, micro, steps, fill)
                               for fill in ("empty", "dequant")}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m zrw.bench cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="2048x2048,4096x4096",
                   help="comma-separated NxK weight shapes for the op timings")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dim", type=int, default=1024, help="MLP width (dim x dim weights)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32, help="tokens per microbatch")
    p.add_argument("--micro", type=int, default=4, help="microbatches per step")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    r = run(sizes, args.repeat, args.dim, args.layers, args.tokens, args.micro, args.steps)
    if args.json:
        print(json.dumps(r))
        return
    print(f"zrw {zrw.__version__}: the fused quant_and_release op, {r['threads']} threads, "
          f"kernel ISA {r['cpu_isa']}")
    rows = []
    for recipe, by_shape in r["op"].items():
        bare = "mx_quantize_dual" if recipe == "mxfp8" else "mx_quantize_block"
        for shape, m in by_shape.items():
            rows.append([recipe, shape, bare, m["bare_ms"], m["miss_ms"], m["miss_over_bare"],
                         m["miss_no_release_ms"], m["miss_no_release_over_bare"], m["hit_us"],
                         f"{m['hit_over_bare']:.2e}"])
    print_table("", ["recipe", "weight", "bare op", "bare ms", "miss ms", "miss/bare",
                     "miss keep ms", "keep/bare", "hit us", "hit/bare"], rows)
    print("  (miss: quantize + insert + release; miss keep: release=False; hit: cached planes)")
    mlp = r["mlp"]
    print(f"\nrestore at the optimizer boundary (attach's pre-hook: restore_all) vs a whole "
          f"training step: MLP of {mlp['layers']} x {mlp['dim']}x{mlp['dim']} weights, "
          f"{mlp['microbatches']} microbatches x {mlp['tokens']} tokens, {mlp['optimizer']}")
    rows = [[recipe, fill, s["step_ms"], s["restore_ms"], f"{100 * s['restore_fraction']:.3g}%",
             s["released_bytes"]]
            for recipe, by_fill in r["step"].items() for fill, s in by_fill.items()]
    print_table("", ["recipe", "fill", "step ms", "restore ms", "of step", "released bytes"],
                rows)
    print("  (\"empty\" only re-allocates: MasterWeights' copy then writes every weight, in the "
          "step; \"dequant\" also fills from the FP8 copy)")
