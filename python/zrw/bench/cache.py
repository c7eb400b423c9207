"""`python -m zrw.bench cache`: the fused quant-and-release op and the restore at the boundary.

In one run, for both recipes and for bf16 weights of 2048 x 2048 and 4096 x 4096 (default), it
times:
  - the bare quantization (mx_quantize_dual for "mxfp8", mx_quantize_block for "mxfp8-32x32");
  - quant_and_release on a miss (lookup, quantize, insert, free + poison the BF16 storage), and
    on a miss with release=False (the cache alone, no release);
  - quant_and_release on a hit (every later use of the weight in the step);
and reports the miss and the hit as ratios of the bare quantization. Last, MasterWeights' check
for writes that bypass it, as a share of its step (`run_write_check`). Between two timed misses
the weight is restored by dequantization (untimed), so every miss reads realistic values.

Then it trains a small MLP (nn.Linear weights used through zrw.nn.mx_linear, a few microbatches
per step) with each kind of boundary and reports its restore as a fraction of the step:
  - "bf16-free": MasterWeights(AdamW) attached, keep_released=True (the default): nothing is
    restored; the write-back hands each released weight its master, and the next step's first
    use quantizes straight from it (the "restore" column is that write-back);
  - "master": MasterWeights(AdamW, keep_released=False) attached; the restore is its write-back
    (every released weight gets fresh bytes filled from its FP32 master, after the inner step);
  - "dequant": AdamW attached with fill="dequant"; the restore is the boundary's pre-hook
    (the optimizer's own weights, filled from their FP8 copies).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import zrw
from zrw import cache, ops
from zrw.bench._timing import best_of, best_of_interleaved, print_table, recording, stamp
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
        cache.cache_invalidate(w)  # restores (dequant) if released
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
    t_bare = best_of(lambda: bare(w.detach()), repeat)
    t_miss = _best_miss(w, recipe, True, repeat)
    t_miss_keep = _best_miss(w, recipe, False, repeat)
    cache.quant_and_release(w, recipe)  # the miss; every call below is a hit
    assert cache.is_released(w)
    n_hit = 100
    t_hit = (
        best_of(lambda: [cache.quant_and_release(w, recipe) for _ in range(n_hit)], repeat) / n_hit
    )
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


def time_step(recipe, dim, layers, tokens, micro, steps, boundary="master"):
    """Trains an MLP of `layers` dim x dim weights with the given boundary ("master" or
    "dequant", see the module doc); returns the best step time and the best restore time, each
    over `steps` steps after one warm-up."""
    torch.manual_seed(0)
    rcp = get_recipe(recipe)
    lins = [torch.nn.Linear(dim, dim, bias=False, dtype=BF16) for _ in range(layers)]
    ws = [l.weight for l in lins]
    marks = {}

    if boundary in ("master", "bf16-free"):
        opt = attach(
            MasterWeights(torch.optim.AdamW, ws, lr=1e-3, keep_released=boundary == "bf16-free")
        )
        # The write-back is the restore.
        opt._write_back = recording(opt._write_back, lambda t: marks.__setitem__("restore", t))
    else:
        opt = torch.optim.AdamW(ws, lr=1e-3)
        opt.register_step_pre_hook(lambda o, a, k: marks.__setitem__("pre", time.perf_counter()))
        attach(opt, fill=boundary)  # its pre-hook (the restore) runs between the two marks
        opt.register_step_pre_hook(
            lambda o, a, k: marks.__setitem__("restore", time.perf_counter() - marks["pre"])
        )
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
            best_restore = min(best_restore, marks["restore"])
    cache.cache_clear()
    return {
        "step_ms": best_step * 1e3,
        "restore_ms": best_restore * 1e3,
        "restore_fraction": best_restore / best_step,
        "released_bytes": released,
    }


BOUNDARIES = ("bf16-free", "master", "dequant")


def run_write_check(params: int = 16, dim: int = 1024, steps: int = 8) -> dict:
    """MasterWeights' check for writes that bypass it (a `.data` write bumps no version), as a
    share of a MasterWeights(AdamW) step over `params` unreleased bf16 parameters of dim x dim
    (embeddings, norms and heads are never released), against the full bit comparison of every
    parameter with its master (what the check did before the digests). Two optimizers over two
    equal sets of parameters, one per mode, stepped in turn in one run; best step of each.

    The digest mode's check is the comparison before the step (`_sync_masters`), the record
    after the write-back (`_record_written`) and what taking the digests costs the write-back
    itself (they are taken right after each write, cache.write_back): the best of
    interleaved write-backs with and without digests, the difference."""
    g = torch.Generator().manual_seed(0)
    sets = {
        mode: [
            torch.nn.Parameter(torch.randn(dim, dim, generator=g).to(BF16)) for _ in range(params)
        ]
        for mode in ("digest", "bit comparison")
    }
    grads = [torch.full((dim, dim), 1e-3, dtype=BF16) for _ in range(params)]
    opts = {mode: MasterWeights(torch.optim.AdamW, ps, lr=1e-3) for mode, ps in sets.items()}
    spent = {"check": 0.0}
    real_sync, real_record = MasterWeights._sync_masters, MasterWeights._record_written
    real_digest, real_write_back = cache.weight_digest, cache.write_back
    compared_ids = {id(p) for p in sets["bit comparison"]}

    def timed(fn):
        def run_it(self, *args):
            t0 = time.perf_counter()
            try:
                return fn(self, *args)
            finally:
                spent["check"] += time.perf_counter() - t0

        return run_it

    def write_back(weights, sources, keep_released):
        if id(weights[0]) in compared_ids:  # the old check: no digests
            torch.ops.zrw.assign_weights(weights, sources, keep_released)
            return [None] * len(weights)
        return real_write_back(weights, sources, keep_released)

    best = {}
    try:
        MasterWeights._sync_masters = timed(real_sync)
        MasterWeights._record_written = timed(real_record)
        cache.weight_digest = lambda p: None if id(p) in compared_ids else real_digest(p)
        cache.write_back = write_back
        for i in range(steps + 1):
            for mode, opt in opts.items():
                for p, gr in zip(sets[mode], grads):
                    p.grad = gr
                spent["check"] = 0.0
                t0 = time.perf_counter()
                opt.step()
                total = time.perf_counter() - t0
                if i and (mode not in best or total < best[mode][0]):
                    best[mode] = (total, spent["check"])
    finally:
        MasterWeights._sync_masters, MasterWeights._record_written = real_sync, real_record
        cache.weight_digest, cache.write_back = real_digest, real_write_back
    ps = sets["digest"]
    ms = [m for group in opts["digest"].masters for m in group]
    plain = best_of_interleaved(
        {
            "digests": lambda: real_write_back(ps, ms, True),
            "plain": lambda: torch.ops.zrw.assign_weights(ps, ms, True),
        },
        max(steps, 15),
    )
    fused = max(0.0, plain["digests"] - plain["plain"])
    t, c = best["digest"]
    best["digest"] = (t, c + fused)
    return {
        "params": params,
        "dim": dim,
        "write_back_digest_ms": fused * 1e3,
        "modes": {
            m: {"step_ms": t * 1e3, "check_ms": c * 1e3, "fraction": c / t}
            for m, (t, c) in best.items()
        },
    }


def run(
    sizes=((2048, 2048), (4096, 4096)),
    repeat=5,
    dim=1024,
    layers=4,
    tokens=32,
    micro=4,
    steps=3,
    check_params=16,
    check_dim=1024,
) -> dict:
    cache.cache_clear()
    out = {
        "threads": torch.get_num_threads(),
        "cpu_isa": zrw._C.cpu_isa(),
        "shapes": [list(s) for s in sizes],
        "op": {},
        "step": {},
        "mlp": {
            "dim": dim,
            "layers": layers,
            "tokens": tokens,
            "microbatches": micro,
            "optimizer": "AdamW (in MasterWeights for the bf16-free and master boundaries)",
        },
    }
    for recipe in cache.RECIPES:
        out["op"][recipe] = {f"{n}x{k}": time_op((n, k), recipe, repeat) for n, k in sizes}
        out["step"][recipe] = {
            b: time_step(recipe, dim, layers, tokens, micro, steps, b) for b in BOUNDARIES
        }
    out["write_check"] = run_write_check(check_params, check_dim)
    return {"bench": "cache", "stamp": stamp(), **out}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m zrw.bench cache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--sizes",
        default="2048x2048,4096x4096",
        help="comma-separated NxK weight shapes for the op timings",
    )
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dim", type=int, default=1024, help="MLP width (dim x dim weights)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32, help="tokens per microbatch")
    p.add_argument("--micro", type=int, default=4, help="microbatches per step")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    p.add_argument(
        "--check-params",
        type=int,
        default=16,
        help="parameters of the write check's optimizer step",
    )
    p.add_argument("--check-dim", type=int, default=1024, help="each is check-dim x check-dim bf16")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    r = run(
        sizes,
        args.repeat,
        args.dim,
        args.layers,
        args.tokens,
        args.micro,
        args.steps,
        args.check_params,
        args.check_dim,
    )
    if args.json:
        print(json.dumps(r))
        return
    print(
        f"zrw {zrw.__version__}: the fused quant_and_release op, {r['threads']} threads, "
        f"kernel ISA {r['cpu_isa']}"
    )
    rows = []
    for recipe, by_shape in r["op"].items():
        bare = "mx_quantize_dual" if recipe == "mxfp8" else "mx_quantize_block"
        for shape, m in by_shape.items():
            rows.append(
                [
                    recipe,
                    shape,
                    bare,
                    m["bare_ms"],
                    m["miss_ms"],
                    m["miss_over_bare"],
                    m["miss_no_release_ms"],
                    m["miss_no_release_over_bare"],
                    m["hit_us"],
                    f"{m['hit_over_bare']:.2e}",
                ]
            )
    print_table(
        "",
        [
            "recipe",
            "weight",
            "bare op",
            "bare ms",
            "miss ms",
            "miss/bare",
            "miss keep ms",
            "keep/bare",
            "hit us",
            "hit/bare",
        ],
        rows,
    )
    print("  (miss: quantize + insert + release; miss keep: release=False; hit: cached planes)")
    mlp = r["mlp"]
    print(
        f"\nrestore at the optimizer boundary vs a whole "
        f"training step: MLP of {mlp['layers']} x {mlp['dim']}x{mlp['dim']} weights, "
        f"{mlp['microbatches']} microbatches x {mlp['tokens']} tokens, {mlp['optimizer']}"
    )
    rows = [
        [
            recipe,
            fill,
            s["step_ms"],
            s["restore_ms"],
            f"{100 * s['restore_fraction']:.3g}%",
            s["released_bytes"],
        ]
        for recipe, by_fill in r["step"].items()
        for fill, s in by_fill.items()
    ]
    print_table(
        "", ["recipe", "boundary", "step ms", "restore ms", "of step", "released bytes"], rows
    )
    wc = r["write_check"]
    print(
        f"\nMasterWeights' check for writes that bypass it, {wc['params']} unreleased bf16 "
        f"parameters of {wc['dim']}x{wc['dim']}, MasterWeights(AdamW) step (the "
        "check's target: at most 5% of the step)"
    )
    print_table(
        "",
        ["check", "step ms", "check ms", "of step"],
        [
            [m, v["step_ms"], v["check_ms"], f"{100 * v['fraction']:.3g}%"]
            for m, v in wc["modes"].items()
        ],
    )
    print(
        "  (digest: a 64-bit digest of each parameter taken as the write-back writes it "
        f"({wc['write_back_digest_ms']:.3g} ms of the check), compared before the next step; "
        "bit comparison: every parameter against its master, as before)"
    )
    print(
        "  (bf16-free: MasterWeights' write-back keeps the weights released, the next miss "
        "quantizes from the FP32 master; master: MasterWeights(keep_released=False) writes "
        "bf16 of every FP32 master into fresh bytes; dequant: AdamW's own weights filled from "
        "their FP8 copies in the pre-hook)"
    )
