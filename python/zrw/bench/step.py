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
"""

from __future__ import annotations

import argparse
import json

import torch

import zrw
from zrw import cache, memory, ops
from zrw.bench._timing import print_table
from zrw.config import get_recipe
from zrw.nn import mx_linear
from zrw.optim import MasterWeights, attach

BF16 = torch.bfloat16
MODES = {"cache": (False, True), "restore": (True, False), "bf16-free": (True, True)}


def measure(mode, recipe, dim, layers, tokens, micro, steps, foreach) -> dict:
    release, keep = MODES[mode]
    torch.manual_seed(0)
    rcp = get_recipe(recipe)
    ws = [torch.nn.Parameter(torch.randn(dim, dim, dtype=BF16) / dim**0.5) for _ in range(layers)]
    n = sum(w.numel() for w in ws)
    opt = attach(MasterWeights(torch.optim.AdamW, ws, lr=1e-3, foreach=foreach, keep_released=keep))
    marks = {}

    def step_pre(o, a, k):
        marks["start"] = memory.current()
        marks["workspace"] = ops.matmul_workspace_bytes()
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
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(tokens, dim, generator=g).to(BF16) for _ in range(micro)]
    for _ in range(steps):
        for x in xs:
            h = x
            for w in ws:
                h = mx_linear(h, w, None, rcp, release=release)
            (h.float().pow(2).mean() / micro).backward()
        opt.step()
        # The peak after the inner step (the write-back, restores included) counts too.
        marks["peak"] = max(marks["before_inner_peak"], marks["inner_peak"], memory.peak())
        opt.zero_grad()
    out = {
        "n": n,
        "start_per_n": marks["start"] / n,
        "peak_per_n": marks["peak"] / n,
        "inner_temporaries_per_n": (marks["inner_peak"] - marks["inner_start"]) / n,
        "peak_bytes": marks["peak"],
        # mx_matmul's tile workspace, part of the live bytes: a constant (the largest GEMM
        # tiles, at most 40 MiB), not a per-element cost
        "matmul_workspace_bytes": marks["workspace"],
        "matmul_workspace_per_n": marks["workspace"] / n,
    }
    del opt, ws
    cache.cache_clear()
    return out


def run(recipe="mxfp8", dim=1024, layers=8, tokens=32, micro=2, steps=2) -> dict:
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
    return out


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
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    a = p.parse_args(argv)
    r = run(a.recipe, a.dim, a.layers, a.tokens, a.micro, a.steps)
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
        "  (live at step start: BF16 weights 2 (not when released), FP8 copies ~1.06 (mxfp8) "
        "or ~1.03 (32x32), BF16 grads 2, FP32 masters 4, AdamW moments 8)"
    )
    ws = r["foreach"]["False"]["cache"]
    print(
        f"  (and mx_matmul's CPU tile workspace, the same in every mode: "
        f"{ws['matmul_workspace_bytes'] / 2**20:.2f} MiB = "
        f"{ws['matmul_workspace_per_n']:.2f} N here; a constant of at most 40 MiB, not a "
        f"per-element cost, freed by zrw.ops.free_matmul_workspace())"
    )
