"""`python -m zrw.bench step`: the optimizer step's memory, in units of N.

N is the number of converted weight elements. A stack of `layers` MXLinear-numerics weights of
dim x dim (bf16) is trained with MasterWeights(AdamW) for `steps` steps of `micro` micro-batches
of `tokens` tokens (few tokens: the weights, not the activations, dominate), in three modes:
  cache        FP8 copies cached, BF16 weights kept (release off)
  restore      zero-redundancy, the seed's boundary: MasterWeights(..., keep_released=False)
  bf16-free    zero-redundancy, the BF16-free step: MasterWeights(..., keep_released=True)
and, measured with zrw.memory's counting allocator in the last step, it reports per mode:
  - the live bytes when the step begins (weights, FP8 copies, BF16 gradients, FP32 masters and
    AdamW's two moments) and the step's peak, both in bytes per converted element;
  - the inner AdamW step's own temporaries (its peak minus the live bytes when it starts);
  - the saving of the step's peak against cache (2N is the BF16 weights).
AdamW runs both ways torch offers: foreach=False (one tensor at a time: CPU's default) and
foreach=True (multi-tensor, the GPU/NPU default), whose temporaries are whole-model lists.

The memory ledger goes further, one row per way of training the same stack, each
phase printed next to its arithmetic (the terms, exact bytes from the shapes):
  bf16                    plain BF16 training (F.linear, no zrw) with FP32 masters: the baseline
  restore-mxfp8           the seed's zero-redundancy step (restore at the step), mxfp8
  bf16-free-mxfp8         the BF16-free step, mxfp8 (dual-axis: two FP8 planes)
  bf16-free-32x32         the BF16-free step, mxfp8-32x32 (one FP8 copy)
  bf16-free-32x32-int8    ... with torchao's AdamW8bit (zrw.optim.AdamW(state_dtype="int8"))
  bf16-free-32x32-fp8     ... with torchao's AdamWFp8 (state_dtype="fp8")
  bf16-free-32x32-int4    ... with torchao's AdamW4bit (state_dtype="int4")
The phases: the forward/backward window (its live bytes when the optimizer step begins, the
state the backward leaves; its peak adds the activations) and the optimizer step (the live
bytes when the inner optimizer starts, after the gradients became FP32 and the FP8 copies the
step drops are gone; its peak adds the inner optimizer's temporaries and the write-back). The
ledger's bytes are counted from before the weights exist and without mx_matmul's tile
workspace (a constant, printed apart). "Static" is the larger of the two phases' live bytes.
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch

import zrw
from zrw import cache, memory, ops
from zrw.bench._timing import print_table, stamp
from zrw.config import get_recipe
from zrw.nn import mx_linear
from zrw.optim import MasterWeights, adamw_class, attach

BF16 = torch.bfloat16
MODES = {"cache": (False, True), "restore": (True, False), "bf16-free": (True, True)}
# The ledger's rows: (mode, recipe, state_dtype). mode "bf16" is plain BF16 training.
LEDGER = {
    "bf16": ("bf16", None, None),
    "restore-mxfp8": ("restore", "mxfp8", None),
    "bf16-free-mxfp8": ("bf16-free", "mxfp8", None),
    "bf16-free-32x32": ("bf16-free", "mxfp8-32x32", None),
    "bf16-free-32x32-int8": ("bf16-free", "mxfp8-32x32", "int8"),
    "bf16-free-32x32-fp8": ("bf16-free", "mxfp8-32x32", "fp8"),
    "bf16-free-32x32-int4": ("bf16-free", "mxfp8-32x32", "int4"),
}
BASELINE = "bf16"
# torchao's low-bit states (torchao/optim/adam.py, subclass_*.py): a tensor of at least 4096
# elements whose size is a multiple of the block is quantized, per block of `block` elements
# with an FP32 scale; 8-bit and 4-bit states also hold their code table (qmap, FP32).
LOW_BIT = {  # state_dtype: (code bits, block, qmap entries)
    "int8": (8, 256, 256),
    "fp8": (8, 256, 0),
    "int4": (4, 128, 16),
}


def fp8_copy_bytes(recipe: str, n: int, k: int) -> int:
    """The bytes of a weight's cached MXFP8 copy (docs/design.md §3): mxfp8, two planes of
    E4M3 codes, each with one E8M0 scale per 32 along its axis; mxfp8-32x32, one plane of codes,
    the per-tile E8M0 scale and its two per-axis expansions the GEMMs read."""
    kb, nb = -(-k // 32), -(-n // 32)
    if recipe == "mxfp8":
        return 2 * n * k + n * kb + k * nb
    return n * k + n * kb + k * nb + nb * kb


def moment_bytes(state_dtype, numel: int) -> int:
    """AdamW's two moments (exp_avg, exp_avg_sq) of one parameter of `numel` elements."""
    if state_dtype in (None, "fp32"):
        return 2 * 4 * numel
    bits, block, qmap = LOW_BIT[state_dtype]
    if numel < 4096 or numel % block:
        return 2 * 4 * numel  # torchao keeps small tensors' moments in FP32
    return 2 * (numel * bits // 8 + 4 * (numel // block) + 4 * qmap)


def arithmetic(row: str, dim: int, layers: int) -> dict:
    """The ledger's terms, bytes per converted element, for each phase of `row`."""
    mode, recipe, state_dtype = LEDGER[row]
    numel = dim * dim
    n = layers * numel
    per_n = lambda b: b * layers / n  # noqa: E731 (bytes of one weight -> per element)
    fp8 = per_n(fp8_copy_bytes(recipe, dim, dim)) if recipe else 0.0
    moments = per_n(moment_bytes(state_dtype, numel))
    mname = f"{state_dtype or 'fp32'} moments"
    window = {"BF16 weights": 2.0 if mode == "bf16" else 0.0}
    window.update({"FP8 copies": fp8, "BF16 grads": 2.0, "FP32 masters": 4.0, mname: moments})
    step = {"BF16 weights": 2.0 if mode == "bf16" else 0.0}
    # The seed's restore keeps the FP8 copies through the inner step; the BF16-free step drops
    # them before it (the masters are the copy), as the cache-only mode does.
    step.update({"FP8 copies": fp8 if mode == "restore" else 0.0})
    step.update({"FP32 grads": 4.0, "FP32 masters": 4.0, mname: moments})
    # torch's and torchao's AdamW keep a 0-dim FP32 step counter per parameter; torchao also
    # keeps its learning rate as a 0-dim FP32 tensor (one group here).
    counters = (4 * layers + (4 if state_dtype not in (None, "fp32") else 0)) / n
    window["step counters"] = step["step counters"] = counters
    drop = lambda d: {k: v for k, v in d.items() if v}  # noqa: E731
    window, step = drop(window), drop(step)
    return {
        "window": window,
        "step": step,
        "window_total": sum(window.values()),
        "step_total": sum(step.values()),
    }


def measure(mode, recipe, dim, layers, tokens, micro, steps, foreach, state_dtype=None) -> dict:
    """One run of `steps` steps; what zrw.memory saw in the last one. mode "bf16" is plain BF16
    training (F.linear on the BF16 weights, no zrw), the others MODES."""
    release, keep = MODES.get(mode, (False, True))
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(tokens, dim, generator=g).to(BF16) for _ in range(micro)]
    ops.free_matmul_workspace()  # each run counts its own
    base = memory.current()  # the ledger counts from here: this run's bytes only
    rcp = get_recipe(recipe) if mode != "bf16" else None
    ws = [torch.nn.Parameter(torch.randn(dim, dim, dtype=BF16) / dim**0.5) for _ in range(layers)]
    n = sum(w.numel() for w in ws)
    inner = adamw_class(state_dtype)
    kw = {"foreach": foreach} if inner is torch.optim.AdamW else {}
    opt = attach(MasterWeights(inner, ws, lr=1e-3, keep_released=keep, **kw))
    marks = {}

    def step_pre(o, a, k):
        marks["window_peak"] = memory.peak()
        marks["start"] = memory.current()
        marks["workspace"] = ops.matmul_workspace_bytes()
        marks["fp8_bytes"] = cache.cache_stats()["fp8_bytes"]
        memory.reset_peak()

    def inner_pre(o, a, k):
        marks["inner_start"] = memory.current()
        marks["before_inner_peak"] = memory.peak()
        memory.reset_peak()

    def inner_post(o, a, k):
        marks["inner_peak"] = memory.peak()

    opt.register_step_pre_hook(step_pre)
    opt.inner.register_step_pre_hook(inner_pre)
    opt.inner.register_step_post_hook(inner_post)
    for _ in range(steps):
        memory.reset_peak()  # the window: the step's first forward .. the optimizer pre-hook
        for x in xs:
            h = x
            for w in ws:
                if mode == "bf16":
                    h = torch.nn.functional.linear(h, w)
                else:
                    h = mx_linear(h, w, None, rcp, release=release)
            (h.float().pow(2).mean() / micro).backward()
            del h
        opt.step()
        # The peak after the inner step (the write-back, restores included) counts too.
        marks["peak"] = max(marks["before_inner_peak"], marks["inner_peak"], memory.peak())
        opt.zero_grad()
    ws_bytes = marks["workspace"]
    ledger = lambda key: (marks[key] - base - ws_bytes) / n  # noqa: E731
    out = {
        "n": n,
        "start_per_n": marks["start"] / n,
        "peak_per_n": marks["peak"] / n,
        "inner_temporaries_per_n": (marks["inner_peak"] - marks["inner_start"]) / n,
        "peak_bytes": marks["peak"],
        # mx_matmul's tile workspace, part of the live bytes: a constant (the largest GEMM
        # tiles, at most 40 MiB), not a per-element cost
        "matmul_workspace_bytes": ws_bytes,
        "matmul_workspace_per_n": ws_bytes / n,
        # the ledger's figures: this run's bytes only, without the workspace
        "window_live_per_n": ledger("start"),
        "window_peak_per_n": ledger("window_peak"),
        "step_live_per_n": ledger("inner_start"),
        "step_peak_per_n": ledger("peak"),
        "fp8_bytes_per_n": marks["fp8_bytes"] / n,
    }
    del opt, ws
    cache.cache_clear()
    return out


def ledger(dim=1024, layers=8, tokens=32, micro=2, steps=2, rows=None) -> dict:
    """The memory ledger: each row measured (in this process, one after the other) and its
    arithmetic; ratios against the BF16 baseline."""
    memory.install()
    out = {}
    for row in [x for x in (rows or list(LEDGER)) if x != "none"]:
        mode, recipe, state_dtype = LEDGER[row]
        r = measure(mode, recipe, dim, layers, tokens, micro, steps, False, state_dtype)
        r["arithmetic"] = arithmetic(row, dim, layers)
        r["static_per_n"] = max(r["window_live_per_n"], r["step_live_per_n"])
        r["static_arithmetic"] = max(r["arithmetic"]["window_total"], r["arithmetic"]["step_total"])
        r["global_peak_per_n"] = max(r["window_peak_per_n"], r["step_peak_per_n"])
        out[row] = r
    if BASELINE in out:
        b = out[BASELINE]
        for r in out.values():
            r["static_vs_baseline"] = r["static_per_n"] / b["static_per_n"]
            r["global_peak_vs_baseline"] = r["global_peak_per_n"] / b["global_peak_per_n"]
    return out


def run(recipe="mxfp8", dim=1024, layers=8, tokens=32, micro=2, steps=2, ledger_rows=None) -> dict:
    memory.install()  # before the weights exist: every byte below is counted
    cache.cache_clear()
    out = {
        "recipe": recipe,
        "dim": dim,
        "layers": layers,
        "tokens": tokens,
        "micro": micro,
        "foreach": {},
    }
    for foreach in (False, True):
        runs = {m: measure(m, recipe, dim, layers, tokens, micro, steps, foreach) for m in MODES}
        n = runs["cache"]["n"]
        for m, r in runs.items():
            r["peak_saving_vs_cache_per_n"] = (runs["cache"]["peak_bytes"] - r["peak_bytes"]) / n
        out["foreach"][str(foreach)] = runs
    out["ledger"] = ledger(dim, layers, tokens, micro, steps, ledger_rows)
    return {"bench": "step", "stamp": stamp(), **out}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m zrw.bench step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--recipe", choices=list(cache.RECIPES), default="mxfp8")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument(
        "--ledger",
        default="all",
        help="the memory ledger's rows, comma-separated, 'all' or 'none' (rows: "
        + ", ".join(LEDGER)
        + ")",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    a = p.parse_args(argv)
    # torch.compile of torchao's step warns once per state class about AOT autograd caching
    warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching.*")
    rows = list(LEDGER) if a.ledger == "all" else [x for x in a.ledger.split(",") if x]
    if a.ledger == "none":
        rows = []
    bad = [x for x in rows if x not in LEDGER]
    if bad:
        p.error(f"--ledger: unknown row(s) {bad}; rows: {list(LEDGER)}, 'all' or 'none'")
    r = run(a.recipe, a.dim, a.layers, a.tokens, a.micro, a.steps, rows or ["none"])
    if a.json:
        print(json.dumps(r))
        return
    print(
        f"zrw {zrw.__version__}: optimizer-step memory of MasterWeights(AdamW), {a.recipe}, "
        f"{a.layers} weights of {a.dim}x{a.dim} (N = {a.layers * a.dim * a.dim} elements), "
        f"{a.micro} x {a.tokens} tokens; bytes per converted element (x N)"
    )
    for foreach, runs in r["foreach"].items():
        rows = [
            [
                m,
                x["start_per_n"],
                x["peak_per_n"],
                x["inner_temporaries_per_n"],
                x["peak_saving_vs_cache_per_n"],
            ]
            for m, x in runs.items()
        ]
        print_table(
            f"\nAdamW foreach={foreach}",
            [
                "mode",
                "live at step start",
                "step peak",
                "AdamW temporaries",
                "peak saving vs cache",
            ],
            rows,
        )
    print(
        "  (live at step start: BF16 weights 2 (not when released), FP8 copies 2.06 (mxfp8: "
        "two planes) or 1.06 (32x32), BF16 grads 2, FP32 masters 4, AdamW moments 8)"
    )
    ws = r["foreach"]["False"]["cache"]
    print(
        f"  (and mx_matmul's CPU tile workspace, the same in every mode: "
        f"{ws['matmul_workspace_bytes'] / 2**20:.2f} MiB = "
        f"{ws['matmul_workspace_per_n']:.2f} N here; a constant of at most 40 MiB, not a "
        f"per-element cost, freed by zrw.ops.free_matmul_workspace())"
    )

    if r["ledger"]:
        print_ledger(r["ledger"], a)


def print_ledger(rows: dict, a) -> None:
    n = a.layers * a.dim * a.dim
    print(
        f"\nMemory ledger: bytes per converted weight element (x N, N = {n}), "
        f"the last of {a.steps} steps, {a.micro} x {a.tokens} tokens; measured with zrw.memory "
        "(this run's bytes, mx_matmul's tile workspace apart) next to the arithmetic"
    )
    table = []
    for name, x in rows.items():
        ar = x["arithmetic"]
        cells = [
            ar["window_total"],
            x["window_live_per_n"],
            x["window_peak_per_n"],
            ar["step_total"],
            x["step_live_per_n"],
            x["step_peak_per_n"],
            x["static_per_n"],
            x.get("static_vs_baseline", float("nan")),
            x.get("global_peak_vs_baseline", float("nan")),
        ]
        table.append([name] + [f"{c:.3f}" for c in cells])
    print_table(
        "",
        [
            "row",
            "fwd/bwd: arithm.",
            "live",
            "peak",
            "opt step: arithm.",
            "live",
            "peak",
            "static",
            f"static / {BASELINE}",
            f"global peak / {BASELINE}",
        ],
        table,
    )
    print("  the arithmetic, term by term (x N; fwd/bwd = when the step begins, opt step = when")
    print("  the inner optimizer starts):")
    for name, x in rows.items():
        ar = x["arithmetic"]
        for phase, label in (("window", "fwd/bwd"), ("step", "opt step")):
            terms = " + ".join(
                f"{v:.4g} {k}" if v >= 1e-3 else f"{v * n:.0f} B {k}" for k, v in ar[phase].items()
            )
            print(f"  {name:22s} {label:8s} {terms} = {ar[phase + '_total']:.4g}")
    goal = rows.get("bf16-free-32x32-fp8")
    if goal is not None and BASELINE in rows:
        base = rows[BASELINE]
        verdict = "met" if goal["static_per_n"] <= 11.0 else "NOT met"
        print(
            f"  goal: the BF16-free 32x32 step with FP8 moments at or below 11 N "
            f"static, 0.61x the baseline's 18 N: {goal['static_per_n']:.3f} N static = "
            f"{goal['static_vs_baseline']:.3f}x the measured baseline "
            f"{base['static_per_n']:.3f} N ({verdict}); global peak "
            f"{goal['global_peak_per_n']:.3f} N = {goal['global_peak_vs_baseline']:.3f}x "
            f"the baseline's {base['global_peak_per_n']:.3f} N"
        )
    ws = [x["matmul_workspace_bytes"] for x in rows.values()]
    print(
        f"  (mx_matmul's tile workspace, not counted above: {max(ws) / 2**20:.2f} MiB in the "
        "zrw rows, 0 in bf16: a constant, not a per-element cost)"
    )
