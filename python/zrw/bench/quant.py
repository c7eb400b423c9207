"""`python -m zrw.bench quant`: the MX quantization kernels against a plain copy and torchao.

For one bf16 weight (default 4096 x 4096) it times, in one run: a plain `copy_` of the weight
(the floor any kernel that reads and writes it must pay), zrw's dual-axis, 32x32-block and
one-axis quantization, and torchao's `to_mx` doing the same work (both axes: to_mx of w and of
w.t().contiguous()). It also times mx_matmul against a bf16 torch.matmul of the same shape, and
the dual-axis kernel on 1 and on all threads.

Quantization straight from an FP32 master (the *_from_master ops: each element rounded to bf16
and quantized in one read) is timed in the same rounds against a `copy_` of the fp32 master into
a preallocated fp32 buffer, and shown beside the bf16 op's ratio to the bf16 copy: the fused op
reads twice the bytes, so equal ratios mean it is as fast per byte read as the bf16 path. The
two-pass alternative (`master.to(torch.bfloat16)`, then the bf16 op) is timed too.

Output memory: the quantization ops allocate their outputs on every call, the copy_ writes into
a tensor it already has. On glibc the benchmark keeps freed memory in the heap, so the ops reuse
warm pages like the copy does, and then times the dual-axis op once more with fresh pages for
every output (what a call pays when the allocator has returned the memory to the OS: a page
fault per 4 KiB, which costs ~2 us on this VM and is most of the difference).
"""
from __future__ import annotations

import argparse
import json
import warnings

import torch

import zrw
from zrw import ops, testing
from zrw.bench._timing import best_of, best_of_interleaved, fresh_pages, print_table, warm_heap


def _torchao_to_mx():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception:  # torchao is optional: the benchmark says so instead of failing
        return None
    return lambda x: to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)


def run(n: int = 4096, k: int = 4096, mm: int = 2048, repeat: int = 7) -> dict:
    """Every figure of the benchmark. Sets glibc's malloc thresholds for the rest of the process
    (see the module docstring): call it from a process of its own."""
    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    dst = torch.empty_like(w)
    master = torch.randn(n, k, dtype=torch.float32)
    dst32 = torch.empty_like(master)
    threads = torch.get_num_threads()
    e4m3, bf16 = torch.float8_e4m3fn, torch.bfloat16
    kernels = {
        "copy": lambda: dst.copy_(w),
        "dual": lambda: ops.mx_quantize_dual(w, e4m3, "floor"),
        "block": lambda: ops.mx_quantize_block(w, e4m3, "floor"),
        "single_dim_-1": lambda: ops.mx_quantize(w, -1, e4m3, "floor"),
        "single_dim_0": lambda: ops.mx_quantize(w, 0, e4m3, "floor"),
    }
    # The same layouts from the fp32 master, timed in the same rounds against an fp32 copy.
    master_kernels = {
        "copy_fp32": lambda: dst32.copy_(master),
        "dual_from_master": lambda: ops.mx_quantize_dual_from_master(master, bf16, e4m3, "floor"),
        "block_from_master":
            lambda: ops.mx_quantize_block_from_master(master, bf16, e4m3, "floor"),
        "single_dim_-1_from_master":
            lambda: ops.mx_quantize_from_master(master, -1, bf16, e4m3, "floor"),
        "cast_then_dual": lambda: ops.mx_quantize_dual(master.to(bf16), e4m3, "floor"),
    }

    warm = warm_heap()
    t_all = best_of_interleaved({**kernels, **master_kernels}, repeat)
    t = {name: t_all[name] for name in kernels}
    t_master = {name: t_all[name] for name in master_kernels}
    t_copy, t_copy32 = t["copy"], t_master["copy_fp32"]
    t_dual_fresh = None
    if fresh_pages():
        t_dual_fresh = best_of_interleaved(
            {"copy": kernels["copy"], "dual": kernels["dual"]}, repeat)["dual"]
        warm_heap()
    torch.set_num_threads(1)
    try:
        t1 = best_of_interleaved({"copy": kernels["copy"], "dual": kernels["dual"]},
                                 max(3, repeat // 2))
    finally:
        torch.set_num_threads(threads)

    to_mx = _torchao_to_mx()
    t_ao_dual = t_ao_single = None
    if to_mx is not None:
        t_ao_single = best_of(lambda: to_mx(w), 3, 1)
        t_ao_dual = best_of(lambda: (to_mx(w), to_mx(w.t().contiguous())), 3, 1)

    a = torch.randn(mm, mm, dtype=torch.bfloat16)
    b = torch.randn(mm, mm, dtype=torch.bfloat16)
    qa, sa = ops.mx_quantize(a, -1)
    qb, sb = ops.mx_quantize(b, -1)
    t_mm_bf16 = best_of(lambda: torch.matmul(a, b.t()), 3, 1)
    testing.reset_gemm_counts()
    t_mm_mx = best_of(lambda: ops.mx_matmul(qa, sa, qb, sb, torch.bfloat16), 3, 1)
    counts = testing.gemm_counts()
    gemm_ran = sorted(k for k, v in counts.items() if v)

    def ratio(x, y):
        return None if x is None or y is None else x / y

    return {
        "shape": [n, k],
        "threads": threads,
        "cpu_isa": zrw._C.cpu_isa(),
        "gemm_path": zrw._C.cpu_gemm(),
        "native_bf16": zrw._C.cpu_native_bf16(),
        "mx_matmul_gemm_ran": gemm_ran,
        "ms": {
            **{name: v * 1e3 for name, v in t.items()},
            **{name: v * 1e3 for name, v in t_master.items()},
            "dual_fresh_output_pages": None if t_dual_fresh is None else t_dual_fresh * 1e3,
            "copy_1_thread": t1["copy"] * 1e3,
            "dual_1_thread": t1["dual"] * 1e3,
            "torchao_to_mx_dual": None if t_ao_dual is None else t_ao_dual * 1e3,
            "torchao_to_mx_single": None if t_ao_single is None else t_ao_single * 1e3,
            "matmul_bf16": t_mm_bf16 * 1e3,
            "mx_matmul": t_mm_mx * 1e3,
        },
        "allocator": "glibc, freed memory kept in the heap" if warm else "as is",
        "ratio_to_copy": {name: v / t_copy for name, v in t.items() if name != "copy"},
        # The fused master ops against the fp32 copy, and each one's bf16 counterpart against
        # the bf16 copy (same figure as ratio_to_copy): equal ratios = as fast per byte read.
        "from_master": {
            "param_dtype": "bfloat16",
            "ratio_to_fp32_copy": {
                "dual": t_master["dual_from_master"] / t_copy32,
                "block": t_master["block_from_master"] / t_copy32,
                "single_dim_-1": t_master["single_dim_-1_from_master"] / t_copy32,
                "cast_then_dual": t_master["cast_then_dual"] / t_copy32,
            },
            "bf16_ratio_to_bf16_copy": {
                name: t[name] / t_copy for name in ("dual", "block", "single_dim_-1")
            },
        },
        "speedup_vs_torchao": {
            "dual": ratio(t_ao_dual, t["dual"]),
            "single_dim_-1": ratio(t_ao_single, t["single_dim_-1"]),
        },
        "thread_speedup_dual": t1["dual"] / t["dual"],
        "matmul_shape": [mm, mm, mm],
        "mx_matmul_over_bf16_matmul": t_mm_mx / t_mm_bf16,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m zrw.bench quant", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4096, help="weight rows (out_features)")
    p.add_argument("--k", type=int, default=4096, help="weight columns (in_features)")
    p.add_argument("--mm", type=int, default=2048, help="M = N = K of the matmul comparison")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    r = run(args.n, args.k, args.mm, args.repeat)
    if args.json:
        print(json.dumps(r))
        return
    ms, rc, sp = r["ms"], r["ratio_to_copy"], r["speedup_vs_torchao"]
    print(f"zrw {zrw.__version__}: MX quantization of a {args.n}x{args.k} bf16 weight, "
          f"{r['threads']} threads, kernel ISA {r['cpu_isa']}")
    rows = [["copy_ (baseline)", ms["copy"], 1.0, "", ""]]
    for key, label in [("dual", "dual-axis (mxfp8)"), ("block", "32x32 block"),
                       ("single_dim_-1", "one axis, dim -1"), ("single_dim_0", "one axis, dim 0")]:
        ao = {"dual": "torchao_to_mx_dual", "single_dim_-1": "torchao_to_mx_single"}.get(key)
        rows.append([label, ms[key], rc[key], "" if ao is None or ms[ao] is None else ms[ao],
                     "" if sp.get(key) is None else f"{sp[key]:.0f}x"])
    print_table("", ["kernel", "ms", "x copy", "torchao ms", "zrw speed-up"], rows)
    fm = r["from_master"]
    print_table("\n  from an FP32 master (rounded to bf16 and quantized in one read), against a "
                "copy_ of the fp32 master; the bf16 op against the bf16 copy_ beside it:",
                ["kernel", "ms", "x fp32 copy", "bf16 op: x bf16 copy"],
                [["fp32 copy_ (baseline)", ms["copy_fp32"], 1.0, ""]]
                + [[label, ms[key + "_from_master"], fm["ratio_to_fp32_copy"][key],
                    fm["bf16_ratio_to_bf16_copy"][key]]
                   for key, label in [("dual", "dual-axis"), ("block", "32x32 block"),
                                      ("single_dim_-1", "one axis, dim -1")]]
                + [["cast to bf16, then dual", ms["cast_then_dual"],
                    fm["ratio_to_fp32_copy"]["cast_then_dual"], ""]])
    print(f"\n  output memory: {r['allocator']}")
    if ms["dual_fresh_output_pages"] is not None:
        fresh = ms["dual_fresh_output_pages"]
        print(f"  dual-axis with fresh output pages: {fresh:.3g} ms "
              f"({fresh / ms['copy']:.2f}x copy; +{fresh - ms['dual']:.3g} ms of page faults)")
    print(f"  dual-axis on 1 thread: {ms['dual_1_thread']:.3g} ms = "
          f"{ms['dual_1_thread'] / ms['copy_1_thread']:.2f}x a 1-thread copy "
          f"(speed-up from 1 to {r['threads']} threads: {r['thread_speedup_dual']:.2f}x)")
    print(f"  mx_matmul {args.mm}^3: {ms['mx_matmul']:.4g} ms vs bf16 torch.matmul "
          f"{ms['matmul_bf16']:.4g} ms -> {r['mx_matmul_over_bf16_matmul']:.2f}x the bf16 time "
          f"(inner GEMM: {'/'.join(r['mx_matmul_gemm_ran'])}; native BF16: "
          f"{'yes' if r['native_bf16'] else 'no'})")
