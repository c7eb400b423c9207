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

First, the host's cost per layer (`run_host`): a 64x64 weight on 4 tokens on one thread, where
the arithmetic is negligible, MXLinear's forward + backward on a cache hit against nn.Linear's.

Then, as whole training steps against BF16 (same data, same optimizer):
  stack          a stack of --stack-layers MXLinear(H, H) layers (ReLU between) against
                 nn.Linear in BF16, forward + backward, for H in --stack-hidden (1024, 4096)
  model          the demo's dense Qwen3 (transformers class, random init) at hidden
                 --model-hidden: zrw.convert(model, "mxfp8") with MasterWeights(AdamW) attached
                 against the same model in BF16 with MasterWeights(AdamW): forward, backward and
                 optimizer step

The CPU has no MX GEMM: the MX step here measures the emulation and the overheads around it,
not what hardware MX would give. mx_matmul's inner GEMM is reported (zrw.backends()["cpu"]
["gemm"]): BF16 where the CPU has native BF16 dot products, else FP32. Timings are the best
of --repeat runs (noise is upward); a call of seconds (BF16 GEMMs on a CPU without native
BF16) is timed once.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import zrw
from zrw import cache, ops, testing
from zrw.bench._timing import best_of, best_of_interleaved, print_table, recording, stamp
from zrw.demo import DemoConfig, build_model, make_batches
from zrw.nn import MXLinear, functional
from zrw.optim import MasterWeights, attach

RECIPES = ("mxfp8", "mxfp8-32x32")


def _param(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    # built in place so the Parameter alone owns its storage (the release guard's "aliased")
    return torch.nn.Parameter(
        torch.randn(*shape, generator=g).mul_(shape[-1] ** -0.5).to(torch.bfloat16)
    )


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


# The functions a layer's step calls, looked up at call time: the cache lookup in zrw.cache, and
# the op overloads zrw.nn.functional's autograd functions call.
_PARTS = {"quant_and_release": "weight", "_quantize_dual": "act_quant", "_matmul": "matmul_emu"}
_MODULE_OF = {"quant_and_release": cache, "_quantize_dual": functional, "_matmul": functional}


def _instrumented(fn, repeat: int, before=None) -> dict:
    """Times fn (a training step) and, inside that very step, the time spent in the ops it
    calls (_PARTS). The parts of the run with the best total are returned, with other = total -
    parts."""
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
    out = {
        "tokens": m,
        "out_features": n,
        "in_features": k,
        "ms": {"bf16_linear_step": t_bf16 * 1e3},
        "recipes": {},
    }

    for recipe in recipes:
        cr = zrw.get_recipe(recipe).cache_layout
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
        w = None  # frees it before the next recipe (the closures above read it)

        # a later microbatch: the released weight's FP8 copy is a cache hit
        layer = MXLinear(k, n, bias=True, recipe=recipe, release=True, dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(w0)
        # zrw releases only a weight that an optimizer with the boundary owns
        _owner = zrw.optim.attach(torch.optim.SGD(layer.parameters(), lr=0.0), fill="dequant")
        _step(layer, x, dy)  # the step's first microbatch: quantize and release
        assert cache.is_released(layer.weight)
        hit = _instrumented(lambda: _step(layer, x, dy), repeat)
        cache.cache_clear("dequant")

        # the first microbatch of a step: a miss (BF16 kept, so it can miss again and again)
        keep = MXLinear(k, n, bias=True, recipe=recipe, release=False, dtype=torch.bfloat16)
        with torch.no_grad():
            keep.weight.copy_(w0)
        miss_step = _instrumented(
            lambda: _step(keep, x, dy), repeat, before=lambda: cache.cache_invalidate(keep.weight)
        )
        cache.cache_clear()

        ms = lambda d: {key: v * 1e3 for key, v in d.items()}  # noqa: E731
        out["recipes"][recipe] = {
            "step_hit_ms": ms(hit),
            "step_miss_ms": ms(miss_step),
            "ms": {
                "weight_quant_kernel": t_wq * 1e3,
                "weight_miss": t_miss * 1e3,
                "release_cycle": (t_rel - t_keep) * 1e3,
            },
            "step_hit_over_bf16": hit["total"] / t_bf16,
            "step_miss_over_bf16": miss_step["total"] / t_bf16,
        }
    return out


def run_stack(hidden: int, layers: int, tokens: int, repeat: int = 3) -> dict:
    """BF16 nn.Linear stack vs MXLinear ("mxfp8", release on, a later microbatch: weight hits)
    stack, forward + backward of `tokens` tokens."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)

    def make(mx: bool):
        torch.manual_seed(0)
        lins = [
            torch.nn.Linear(hidden, hidden, bias=False, dtype=torch.bfloat16) for _ in range(layers)
        ]
        if mx:
            lins = [
                MXLinear.from_linear(lin, "mxfp8", name=f"stack.{i}.weight")
                for i, lin in enumerate(lins)
            ]
        return torch.nn.Sequential(*[m for lin in lins for m in (lin, torch.nn.ReLU())][:-1])

    def step(model):
        model(x).float().pow(2).mean().backward()

    bf16, mx = make(False), make(True)
    t_bf16 = _time(lambda: step(bf16), repeat)
    step(mx)  # the step's first microbatch: quantize and release every weight
    t_mx = _time(lambda: step(mx), repeat)
    cache.cache_clear("dequant")
    return {
        "hidden": hidden,
        "layers": layers,
        "tokens": tokens,
        "ms": {"bf16_step": t_bf16 * 1e3, "mxfp8_step": t_mx * 1e3},
        "mxfp8_over_bf16": t_mx / t_bf16,
    }


def run_model(hidden: int, steps: int = 3) -> dict:
    """The demo's dense model at `hidden`: a whole training step (4 sequences of 64 tokens,
    forward, backward, MasterWeights(AdamW) step) in BF16 and with zrw mxfp8, best of `steps`
    after one warm-up step."""
    c = DemoConfig(model="dense", hidden=hidden, progress=False)
    ids = make_batches(c, 1)[0]
    out = {"hidden": hidden, "layers": c.layers, "tokens": c.batch * c.seq, "ms": {}}
    for mode in ("bf16", "mxfp8"):
        model = build_model("dense", c)
        if mode == "mxfp8":
            zrw.convert(model, "mxfp8")
        opt = attach(MasterWeights(torch.optim.AdamW, model.parameters(), lr=1e-4))

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

        out["ms"][f"{mode}_step"] = _time(step, steps) * 1e3
        cache.cache_clear("dequant")
        model = opt = None  # frees them before the next mode (step() reads them)
    out["mxfp8_over_bf16"] = out["ms"]["mxfp8_step"] / out["ms"]["bf16_step"]
    return out


def run_host(
    recipes=RECIPES, n: int = 64, tokens: int = 4, calls: int = 200, rounds: int = 15
) -> dict:
    """The host's cost of a layer: forward + backward of a 64x64 weight on 4 tokens on one
    thread, where the arithmetic is negligible, for nn.Linear in BF16 and MXLinear on a cache
    hit (each with its optimizer built, the weight owned: what a training step's later
    micro-batches pay per layer). On an accelerator the GEMMs are fast and this per-layer host
    work is what remains. Ratios of the best of interleaved rounds of `calls` steps each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, n, generator=g).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(tokens, n, generator=g).to(torch.bfloat16)
        layers = {"bf16": torch.nn.Linear(n, n, dtype=torch.bfloat16)}
        for recipe in recipes:
            layers[recipe] = MXLinear(n, n, recipe=recipe, dtype=torch.bfloat16)
        opts = [zrw.optim.AdamW(layer.parameters()) for layer in layers.values()]  # owned

        def steps(layer):
            def fn():
                for _ in range(calls):
                    layer(x).backward(dy)

            return fn

        best = best_of_interleaved({k: steps(v) for k, v in layers.items()}, rounds)
        del opts
    finally:
        torch.set_num_threads(threads)
    us = {k: v / calls * 1e6 for k, v in best.items()}
    return {
        "weight": [n, n],
        "tokens": tokens,
        "threads": 1,
        "us": us,
        "over_linear": {r: us[r] / us["bf16"] for r in recipes},
    }


def run(
    tokens: int = 2048,
    shapes=((1024, 1024), (4096, 1024)),
    recipes=RECIPES,
    repeat: int = 3,
    stack_hidden=(1024, 4096),
    stack_layers: int = 4,
    stack_tokens: int = 512,
    model_hidden: int = 1024,
) -> dict:
    a = torch.randn(64, 64).to(torch.bfloat16)
    best_of(lambda: (a @ a).sum().item(), 1, 2)  # BLAS / oneDNN first-call setup
    testing.reset_gemm_counts()
    out = {
        "threads": torch.get_num_threads(),
        "cpu_isa": zrw._C.cpu_isa(),
        "gemm_path": zrw._C.cpu_gemm(),
        "native_bf16": zrw._C.cpu_native_bf16(),
        "tokens": tokens,
        "host": run_host(recipes),
        "shapes": [run_shape(tokens, n, k, recipes, repeat) for n, k in shapes],
        "stack": [run_stack(h, stack_layers, stack_tokens, repeat) for h in stack_hidden],
        "model": None if not model_hidden else run_model(model_hidden, repeat),
    }
    out["mx_matmul_gemm_calls"] = testing.gemm_counts()
    return {"bench": "linear", "stamp": stamp(), **out}


def _shape(s: str):
    n, k = s.lower().split("x")
    return int(n), int(k)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m zrw.bench linear",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokens", type=int, default=2048, help="M, tokens per microbatch")
    p.add_argument(
        "--shapes",
        default="1024x1024,4096x1024",
        help="comma-separated weight shapes OUTxIN (N x K)",
    )
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    p.add_argument(
        "--stack-hidden",
        default="1024,4096",
        help="comma-separated hidden sizes of the dense layer stack ('' skips it)",
    )
    p.add_argument("--stack-layers", type=int, default=4)
    p.add_argument("--stack-tokens", type=int, default=512)
    p.add_argument(
        "--model-hidden",
        type=int,
        default=1024,
        help="hidden size of the demo's dense model (0 skips it)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    shapes = [_shape(s) for s in args.shapes.split(",") if s]
    recipes = [r for r in args.recipes.split(",") if r]
    if args.threads:
        torch.set_num_threads(args.threads)
    stack_hidden = [int(h) for h in args.stack_hidden.split(",") if h]
    r = run(
        args.tokens,
        shapes,
        recipes,
        args.repeat,
        stack_hidden,
        args.stack_layers,
        args.stack_tokens,
        args.model_hidden,
    )
    if args.json:
        print(json.dumps(r))
        return
    print(
        f"zrw {zrw.__version__}: MXLinear training step (forward + backward) vs BF16 "
        f"nn.Linear, {r['tokens']} tokens, {r['threads']} threads, kernel ISA {r['cpu_isa']}, "
        f"mx_matmul GEMM {r['gemm_path']} (native BF16: {'yes' if r['native_bf16'] else 'no'})"
    )
    h = r["host"]
    print_table(
        f"\n  host cost per layer: weight {h['weight'][0]}x{h['weight'][1]}, "
        f"{h['tokens']} tokens, 1 thread, forward + backward (MX: a cache hit; "
        "the host-time goal: at most 2.5x nn.Linear)",
        ["", "us", "x nn.Linear"],
        [["BF16 nn.Linear", h["us"]["bf16"], 1.0]]
        + [[f"MXLinear ({rc})", h["us"][rc], x] for rc, x in h["over_linear"].items()],
    )
    for s in r["shapes"]:
        bf16 = s["ms"]["bf16_linear_step"]
        rows = [["BF16 nn.Linear step", bf16, 1.0, ""]]
        for recipe, rr in s["recipes"].items():
            h, mi, m2 = rr["step_hit_ms"], rr["step_miss_ms"], rr["ms"]
            rows += [
                [f"MXLinear step, weight hit ({recipe})", h["total"], h["total"] / bf16, 1.0],
                [
                    "  act quant: Q(x), Q(dy), both axes",
                    h["act_quant"],
                    "",
                    h["act_quant"] / h["total"],
                ],
                ["  matmul emu: 3 MX GEMMs", h["matmul_emu"], "", h["matmul_emu"] / h["total"]],
                ["  cache lookup (hit)", h["weight"], "", h["weight"] / h["total"]],
                ["  other (autograd, bias, reshape)", h["other"], "", h["other"] / h["total"]],
                [f"MXLinear step, weight miss ({recipe})", mi["total"], mi["total"] / bf16, 1.0],
                ["  weight miss: quant_and_release", mi["weight"], "", mi["weight"] / mi["total"]],
                ["  (weight quant kernel alone)", m2["weight_quant_kernel"], "", ""],
                ["  release + restore, per step", m2["release_cycle"], "", ""],
            ]
        print_table(
            f"\n  M={s['tokens']}, weight {s['out_features']}x{s['in_features']} (out x in)",
            ["", "ms", "x BF16 step", "share of step"],
            rows,
        )
    if r["stack"]:
        rows = [
            [
                f"{s['layers']} x {s['hidden']}x{s['hidden']}, {s['tokens']} tokens",
                s["ms"]["bf16_step"],
                s["ms"]["mxfp8_step"],
                s["mxfp8_over_bf16"],
            ]
            for s in r["stack"]
        ]
        print_table(
            "\n  dense layer stack, forward + backward (MX: weights are cache hits)",
            ["stack", "BF16 ms", "mxfp8 ms", "mxfp8 / BF16"],
            rows,
        )
    if r["model"]:
        m = r["model"]
        print_table(
            f"\n  the demo's dense model at hidden {m['hidden']} ({m['layers']} layers, "
            f"{m['tokens']} tokens): forward + backward + MasterWeights(AdamW) step",
            ["model", "BF16 ms", "mxfp8 ms", "mxfp8 / BF16"],
            [
                [
                    "Qwen3 (transformers)",
                    m["ms"]["bf16_step"],
                    m["ms"]["mxfp8_step"],
                    m["mxfp8_over_bf16"],
                ]
            ],
        )
    print(f"\n  mx_matmul calls per GEMM in this run: {r['mx_matmul_gemm_calls']}")
