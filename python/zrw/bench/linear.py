"""`python -m zrw.bench linear`: an MXLinear training step against nn.Linear in BF16 on CPU.

For each weight shape (out N x in K, default 1024x1024 and 4096x1024) and M tokens (default
2048) it times, in one run: a BF16 nn.Linear forward + backward (dx, dW, db), and MXLinear's
forward + backward for each recipe, on a later microbatch of a step (the weight's FP8 copy is a
cache hit) and on the first one (a miss: the weight is quantized). The MX steps are broken
down from inside the same timed step (the zrw.ops calls the layer makes are timed as it runs):

  act quant      Q(x) and Q(dy), each along both of its axes (mx_quantize_dual, one read each)
  matmul emu     the three MX GEMMs (forward, dgrad, wgrad on .t() views); on CPU these are
                 emulated (dequantized tiles, FP32 accumulation)
  cache lookup   quant_and_release on a hit (what every later microbatch and recompute pays)
  weight miss    quant_and_release on a miss (quantize + insert; the first microbatch)
  other          the rest of the step: autograd, bias, reshapes

and, timed on their own: the recipe's weight kernel alone (dual-axis 1x32, or 32x32 tiles), and
what release adds per step (free + poison on the miss, re-allocation at the boundary's
restore, against the same miss keeping the BF16).

The CPU has no MX GEMM: the MX step here measures the emulation and the overheads around it,
not what hardware MX would give. Timings are the best of --repeat runs (noise is upward);
a call of seconds (BF16 GEMMs on a CPU without native BF16) is timed once.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import zrw
from zrw import ops
from zrw import cache
from zrw.bench._timing import best_of, best_of_interleaved, print_table, recording
from zrw.nn import MXLinear
from zrw.nn.linear import cache_recipe

RECIPES = ("mxfp8", "mxfp8-32x32")


def _param(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    # built in place so the Parameter alone owns its storage (the release guard's "aliased")
    return torch.nn.Parameter(torch.randn(*shape, generator=g).mul_(shape[-1] ** -0.5)
                              .to(torch.bfloat16))


def _step(layer, x, dy):
    """One training step of a layer: forward, backward; grads reset so nothing accumulates."""
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    layer(x).backward(dy)


def _time(fn, repeat: int) -> float:
    """best_of, except that a call of seconds (BF16 GEMMs on a CPU without native BF16) is
    timed once: another run would cost more than its noise."""
    t0 = time.perf_counter()
    fn()  # the warm-up, timed
    t = time.perf_counter() - t0
    if t > 2.0:
        return t
    return min(t, best_of(fn, repeat, 0))


_PARTS = {"quant_and_release": "weight", "mx_quantize_dual": "act_quant",
          "mx_matmul": "matmul_emu"}
_MODULE_OF = {"quant_and_release": cache, "mx_quantize_dual": ops, "mx_matmul": ops}


def _instrumented(fn, repeat: int, before=None) -> dict:
    """Times fn (a training step) and, inside that very step, the time spent in the ops it
    calls through zrw.ops and zrw.cache (the layers look them up there at call time). The parts of the run
    with the best total are returned, with other = total - parts."""
    best = None
    for i in range(repeat + 1):  # the first run is the warm-up
        parts = {v: 0.0 for v in _PARTS.values()}
        saved = {name: getattr(_MODULE_OF[name], name) for name in _PARTS}

        def wrap(name, real):
            part = _PARTS[name]
            return recording(real, lambda t: parts.__setitem__(part, parts[part] + t))

        if before is not None:
            before()
        for name, real in saved.items():
            setattr(_MODULE_OF[name], name, wrap(name, real))
        try:
            t0 = time.perf_counter()
            fn()
            total = time.perf_counter() - t0
        finally:
            for name, real in saved.items():
                setattr(_MODULE_OF[name], name, real)
        if i > 0 and (best is None or total < best["total"]):
            best = dict(parts, total=total)
        if total > 2.0 and best is not None:
            break
    best["other"] = best["total"] - sum(best[v] for v in _PARTS.values())
    return best


def run_shape(m: int, n: int, k: int, recipes=RECIPES, repeat: int = 3) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16)
    e4m3 = torch.float8_e4m3fn

    lin = torch.nn.Linear(k, n, dtype=torch.bfloat16)  # the BF16 baseline
    t_bf16 = _time(lambda: _step(lin, x, dy), repeat)
    out = {"tokens": m, "out_features": n, "in_features": k,
           "ms": {"bf16_linear_step": t_bf16 * 1e3}, "recipes": {}}

    for recipe in recipes:
        cr = cache_recipe(zrw.get_recipe(recipe))
        w = _param(n, k, seed=1)
        w0 = w.detach().clone()
        kernel = ops.mx_quantize_dual if cr == "mxfp8" else ops.mx_quantize_block
        t_wq = best_of(lambda: kernel(w.detach(), e4m3, "floor"), repeat)

        def miss():
            cache.cache_invalidate(w)
            cache.quant_and_release(w, cr, False, name="bench.weight")

        def release_cycle():  # a miss that releases, the boundary's restore, the new values
            cache.quant_and_release(w, cr, True, name="bench.weight")
            cache.restore(w, "empty")
            with torch.no_grad():
                w.copy_(w0)

        def keep_cycle():  # the same without release
            miss()
            with torch.no_grad():
                w.copy_(w0)

        t_miss = best_of(miss, repeat)
        cache.cache_invalidate(w)
        # Interleaved: the release's cost is the difference of the two, which drift would swamp.
        # It can still come out slightly negative for small weights, where it is within noise.
        cycles = best_of_interleaved({"release": release_cycle, "keep": keep_cycle}, repeat)
        t_rel, t_keep = cycles["release"], cycles["keep"]
        cache.cache_invalidate(w)
        del w

        # a later microbatch: the released weight's FP8 copy is a cache hit
        layer = MXLinear(k, n, bias=True, recipe=recipe, release=True, dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(w0)
        _step(layer, x, dy)  # the step's first microbatch: quantize and release
        assert cache.is_released(layer.weight)
        hit = _instrumented(lambda: _step(layer, x, dy), repeat)
        cache.cache_clear("dequant")

        # the first microbatch of a step: a miss (BF16 kept, so it can miss again and again)
        keep = MXLinear(k, n, bias=True, recipe=recipe, release=False, dtype=torch.bfloat16)
        with torch.no_grad():
            keep.weight.copy_(w0)
        miss_step = _instrumented(lambda: _step(keep, x, dy), repeat,
                                  before=lambda: cache.cache_invalidate(keep.weight))
        cache.cache_clear()

        ms = lambda d: {key: v * 1e3 for key, v in d.items()}  # noqa: E731
        out["recipes"][recipe] = {
            "step_hit_ms": ms(hit),
            "step_miss_ms": ms(miss_step),
            "ms": {"weight_quant_kernel": t_wq * 1e3, "weight_miss": t_miss * 1e3,
                   "release_cycle": (t_rel - t_keep) * 1e3},
            "step_hit_over_bf16": hit["total"] / t_bf16,
            "step_miss_over_bf16": miss_step["total"] / t_bf16,
        }
    return out


def run(tokens: int = 2048, shapes=((1024, 1024), (4096, 1024)), recipes=RECIPES,
        repeat: int = 3) -> dict:
    a = torch.randn(64, 64).to(torch.bfloat16)
    best_of(lambda: (a @ a).sum().item(), 1, 2)  # BLAS / oneDNN first-call setup
    return {
        "threads": torch.get_num_threads(),
        "cpu_isa": zrw._C.cpu_isa(),
        "tokens": tokens,
        "shapes": [run_shape(tokens, n, k, recipes, repeat) for n, k in shapes],
    }


def _shape(s: str):
    n, k = s.lower().split("x")
    return int(n), int(k)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m zrw.bench linear", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="M, tokens per microbatch")
    p.add_argument("--shapes", default="1024x1024,4096x1024",
                   help="comma-separated weight shapes OUTxIN (N x K)")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    shapes = [_shape(s) for s in args.shapes.split(",") if s]
    recipes = [r for r in args.recipes.split(",") if r]
    if args.threads:
        torch.set_num_threads(args.threads)
    r = run(args.tokens, shapes, recipes, args.repeat)
    if args.json:
        print(json.dumps(r))
        return
    print(f"zrw {zrw.__version__}: MXLinear training step (forward + backward) vs BF16 "
          f"nn.Linear, {r['tokens']} tokens, {r['threads']} threads, kernel ISA {r['cpu_isa']}")
    for s in r["shapes"]:
        bf16 = s["ms"]["bf16_linear_step"]
        rows = [["BF16 nn.Linear step", bf16, 1.0, ""]]
        for recipe, rr in s["recipes"].items():
            h, mi, m2 = rr["step_hit_ms"], rr["step_miss_ms"], rr["ms"]
            rows += [
                [f"MXLinear step, weight hit ({recipe})", h["total"], h["total"] / bf16, 1.0],
                ["  act quant: Q(x), Q(dy), both axes", h["act_quant"], "",
                 h["act_quant"] / h["total"]],
                ["  matmul emu: 3 MX GEMMs", h["matmul_emu"], "", h["matmul_emu"] / h["total"]],
                ["  cache lookup (hit)", h["weight"], "", h["weight"] / h["total"]],
                ["  other (autograd, bias, reshape)", h["other"], "", h["other"] / h["total"]],
                [f"MXLinear step, weight miss ({recipe})", mi["total"], mi["total"] / bf16, 1.0],
                ["  weight miss: quant_and_release", mi["weight"], "",
                 mi["weight"] / mi["total"]],
                ["  (weight quant kernel alone)", m2["weight_quant_kernel"], "", ""],
                ["  release + restore, per step", m2["release_cycle"], "", ""],
            ]
        print_table(f"\n  M={s['tokens']}, weight {s['out_features']}x{s['in_features']} "
                    f"(out x in)", ["", "ms", "x BF16 step", "share of step"], rows)
