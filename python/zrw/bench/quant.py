"""`python -m zrw.bench quant`: the MX quantization kernels against a plain copy and torchao.

For one bf16 weight (default 4096 x 4096) it times, in one run: a plain `copy_` of the weight
(the floor any kernel that reads and writes it must pay), zrw's dual-axis, 32x32-block and
one-axis quantization, and torchao's `to_mx` doing the same work (both axes: to_mx of w and of
w.t().contiguous()). Every kernel runs on 1 thread and on all threads, and is reported as its
time over the copy's and as bytes moved per second (what it reads plus what it writes) over the
copy's bytes per second: the copy measures the machine's bandwidth in the same rounds. The table
names the kernel ISA and the CPU model. It also times mx_matmul against a bf16 torch.matmul of
the same shape, and, in a child process forced onto the FP32 GEMM path (what a CPU without
native BF16 runs), against an fp32 torch.matmul.

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

`--isa avx512,avx2,base` (or `--isa all`) runs the benchmark once per kernel build, each in its
own process with ZRW_CPU_ISA forcing it (builds this CPU cannot run are listed as skipped), and
ends with one table of every build's ratios to the copy against the targets (one axis <= 1.0x
the copy, dual-axis <= 1.3x, 32x32 <= 1.1x, dual-axis from an FP32 master <= 1.2x an fp32 copy,
on all threads; and all threads no slower than one for any kernel). A build forced on a wider
CPU runs its own instructions only: `--isa avx2` on an AVX-512 machine measures the AVX2 kernels
(with that machine's memory system).
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch

import zrw
from zrw import ops, testing
from zrw.bench._timing import (
    best_of,
    best_of_interleaved,
    cpu_model,
    fresh_pages,
    print_table,
    stamp,
    warm_heap,
)


def _torchao_to_mx():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception:  # torchao is optional: the benchmark says so instead of failing
        return None
    return lambda x: to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)


# Bytes each kernel reads and writes per element of the weight (data, plus one scale byte per
# 32 elements per plane, or per 1024 for 32x32 tiles): what "bytes moved" counts.
_BF16, _FP32 = 2, 4
BYTES_PER_ELEM = {
    "copy": _BF16 + _BF16,
    "dual": _BF16 + 2 * (1 + 1 / 32),
    "block": _BF16 + 1 + 1 / 1024,
    "single_dim_-1": _BF16 + 1 + 1 / 32,
    "single_dim_0": _BF16 + 1 + 1 / 32,
    "copy_fp32": _FP32 + _FP32,
    "dual_from_master": _FP32 + 2 * (1 + 1 / 32),
    "block_from_master": _FP32 + 1 + 1 / 1024,
    "single_dim_-1_from_master": _FP32 + 1 + 1 / 32,
    # the cast writes and rereads a bf16 copy
    "cast_then_dual": _FP32 + _BF16 + _BF16 + 2 * (1 + 1 / 32),
}


def _matmul_fp32_path(mm: int) -> dict | None:
    """mx_matmul with a bf16 result on the FP32 GEMM path (what a CPU without native BF16 runs),
    against an fp32 torch.matmul of the same shape: measured in a child process started with
    ZRW_CPU_GEMM=fp32, since the GEMM path is chosen once per process."""
    import os
    import subprocess
    import sys

    code = (
        "import json, torch\n"
        "from zrw import ops\n"
        "from zrw.bench._timing import best_of\n"
        f"mm = {mm}\n"
        "torch.manual_seed(0)\n"
        "a = torch.randn(mm, mm, dtype=torch.bfloat16)\n"
        "b = torch.randn(mm, mm, dtype=torch.bfloat16)\n"
        "qa, sa = ops.mx_quantize(a, -1); qb, sb = ops.mx_quantize(b, -1)\n"
        "a32, b32 = a.float(), b.float()\n"
        "t32 = best_of(lambda: torch.matmul(a32, b32.t()), 3, 1)\n"
        "tmx = best_of(lambda: ops.mx_matmul(qa, sa, qb, sb, torch.bfloat16), 3, 1)\n"
        "print(json.dumps({'matmul_fp32': t32 * 1e3, 'mx_matmul': tmx * 1e3}))\n"
    )
    env = dict(os.environ, ZRW_CPU_GEMM="fp32")
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
        )
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception:  # a figure the benchmark cannot get is shown as missing, not fatal
        return None


def run(
    n: int = 4096, k: int = 4096, mm: int = 2048, repeat: int = 7, fp32_gemm_child: bool = True
) -> dict:
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
        "block_from_master": lambda: ops.mx_quantize_block_from_master(master, bf16, e4m3, "floor"),
        "single_dim_-1_from_master": lambda: ops.mx_quantize_from_master(
            master, -1, bf16, e4m3, "floor"
        ),
        "cast_then_dual": lambda: ops.mx_quantize_dual(master.to(bf16), e4m3, "floor"),
    }
    every = {**kernels, **master_kernels}

    warm = warm_heap()
    # Every kernel on 1 thread and on all of them, each count in rounds of its own.
    by_threads: dict[int, dict[str, float]] = {}
    for nt in sorted({1, threads}):
        torch.set_num_threads(nt)
        try:
            by_threads[nt] = best_of_interleaved(every, repeat)
        finally:
            torch.set_num_threads(threads)
    t_all = by_threads[threads]
    t = {name: t_all[name] for name in kernels}
    t_master = {name: t_all[name] for name in master_kernels}
    t_copy, t_copy32 = t["copy"], t_master["copy_fp32"]
    t1 = by_threads[1]
    t_dual_fresh = None
    if fresh_pages():
        t_dual_fresh = best_of_interleaved(
            {"copy": kernels["copy"], "dual": kernels["dual"]}, repeat
        )["dual"]
        warm_heap()

    # Bytes moved per second, and that rate against the copy's in the same rounds (the copy of
    # the same source dtype: bf16 for the bf16 ops, fp32 for the master ops).
    elems = n * k
    bandwidth = {}
    for nt, times in by_threads.items():
        rows = {}
        for name, sec in times.items():
            copy_name = "copy" if name in kernels else "copy_fp32"
            gbs = BYTES_PER_ELEM[name] * elems / sec / 1e9
            copy_gbs = BYTES_PER_ELEM[copy_name] * elems / times[copy_name] / 1e9
            rows[name] = {
                "ms": sec * 1e3,
                "gb_per_s": gbs,
                "x_copy_time": sec / times[copy_name],
                "of_copy_bandwidth": gbs / copy_gbs,
            }
        bandwidth[str(nt)] = rows

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
    fp32_path = _matmul_fp32_path(mm) if fp32_gemm_child else None

    def ratio(x, y):
        return None if x is None or y is None else x / y

    return {
        "bench": "quant",
        "stamp": stamp(),
        "shape": [n, k],
        "threads": threads,
        "cpu_model": cpu_model(),
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
            "matmul_fp32": None if fp32_path is None else fp32_path["matmul_fp32"],
            "mx_matmul_fp32_gemm": None if fp32_path is None else fp32_path["mx_matmul"],
        },
        "bytes_per_element": BYTES_PER_ELEM,
        # {"1": ..., "<threads>": ...}: per kernel ms, GB/s moved, time and bandwidth vs copy
        "bandwidth": bandwidth,
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
        # every kernel's time on 1 thread over its time on all threads (>= 1: threads help)
        "thread_speedup": {name: t1[name] / t_all[name] for name in every},
        "matmul_shape": [mm, mm, mm],
        "mx_matmul_over_bf16_matmul": t_mm_mx / t_mm_bf16,
        # the FP32 GEMM path (ZRW_CPU_GEMM=fp32, bf16 result) over an fp32 torch.matmul
        "mx_matmul_fp32_gemm_over_fp32_matmul": None
        if fp32_path is None
        else fp32_path["mx_matmul"] / fp32_path["matmul_fp32"],
    }


ISAS = ("avx512", "avx2", "base")
# zrw's own kernels (not the copies the ratios divide by, nor the two-pass cast + dual)
ZRW_KERNELS = (
    "dual",
    "block",
    "single_dim_-1",
    "single_dim_0",
    "dual_from_master",
    "block_from_master",
    "single_dim_-1_from_master",
)

# The kernels' speed targets: kernel -> the largest time over the copy on all threads.
TARGETS = {
    "single_dim_-1": 1.0,
    "single_dim_0": 1.0,
    "dual": 1.3,
    "block": 1.1,
    "dual_from_master": 1.2,
}


def run_isas(isas, n: int, k: int, mm: int, repeat: int) -> dict:
    """run() once per kernel build, each in a child process started with ZRW_CPU_ISA=isa (the
    build is chosen once per process). {isa: run()'s dict, or {"skipped": why}}."""
    import os
    import subprocess
    import sys

    out = {}
    for isa in isas:
        env = dict(os.environ, ZRW_CPU_ISA=isa)
        cmd = [
            sys.executable,
            "-m",
            "zrw.bench",
            "quant",
            "--json",
            "--n",
            str(n),
            "--k",
            str(k),
            "--mm",
            str(mm),
            "--repeat",
            str(repeat),
        ]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            out[isa] = {"skipped": last}
            continue
        out[isa] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def target_rows(results: dict) -> list:
    """One row per build: each target kernel's time over the copy on all threads, marked "ok" or
    "MISSED" against TARGETS, and the smallest thread speed-up over every kernel."""
    rows = []
    for isa, r in results.items():
        if "skipped" in r:
            rows.append([isa] + ["skipped"] * (len(TARGETS) + 1))
            continue
        bw = r["bandwidth"][str(r["threads"])]
        row = [isa]
        for name, limit in TARGETS.items():
            x = bw[name]["x_copy_time"]
            row.append(f"{x:.2f} {'ok' if x <= limit else 'MISSED'}")
        slowest = min(x for name, x in r["thread_speedup"].items() if name in ZRW_KERNELS)
        row.append(f"{slowest:.2f} {'ok' if slowest >= 1.0 else 'MISSED'}")
        rows.append(row)
    return rows


def print_targets(results: dict, threads: int) -> None:
    header = (
        ["ISA"]
        + [f"{name} (<= {limit})" for name, limit in TARGETS.items()]
        + ["min thr speed-up (>= 1)"]
    )
    print_table(
        f"\n  targets: time over the copy on {threads} threads, per kernel build",
        header,
        target_rows(results),
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m zrw.bench quant",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--n", type=int, default=4096, help="weight rows (out_features)")
    p.add_argument("--k", type=int, default=4096, help="weight columns (in_features)")
    p.add_argument("--mm", type=int, default=2048, help="M = N = K of the matmul comparison")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument(
        "--isa",
        default="",
        help="comma-separated kernel builds to run each in its own process "
        f"({', '.join(ISAS)}), or 'all'; default: the one this process picks",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    if args.isa:
        isas = ISAS if args.isa == "all" else [x for x in args.isa.split(",") if x]
        unknown = sorted(set(isas) - set(ISAS))
        if unknown:
            p.error(
                f"--isa: unknown kernel build(s) {unknown}; expected some of {list(ISAS)} or 'all'"
            )
        results = run_isas(isas, args.n, args.k, args.mm, args.repeat)
        if args.json:
            print(json.dumps(results))
            return
        for isa, r in results.items():
            if "skipped" in r:
                print(f"ZRW_CPU_ISA={isa}: skipped ({r['skipped']})\n")
                continue
            print_report(r, args)
            print()
        threads = next((r["threads"] for r in results.values() if "threads" in r), 0)
        print_targets(results, threads)
        return
    r = run(args.n, args.k, args.mm, args.repeat)
    if args.json:
        print(json.dumps(r))
        return
    print_report(r, args)
    print_targets({r["cpu_isa"]: r}, r["threads"])


def print_report(r: dict, args) -> None:
    ms, sp = r["ms"], r["speedup_vs_torchao"]
    print(
        f"zrw {zrw.__version__}: MX quantization of a {args.n}x{args.k} weight "
        f"(bf16, and an fp32 master), kernel ISA {r['cpu_isa']}, CPU {r['cpu_model']}"
    )
    counts = sorted(r["bandwidth"], key=int)
    header = ["kernel", "B/elem"]
    for nt in counts:
        tag = f"{nt}t"
        header += [f"{tag} ms", f"{tag} GB/s", f"{tag} x copy", f"{tag} BW/copy"]
    header += ["thr speed-up"]
    labels = {
        "copy": "copy_ bf16 (baseline)",
        "dual": "dual-axis (mxfp8)",
        "block": "32x32 block",
        "single_dim_-1": "one axis, dim -1",
        "single_dim_0": "one axis, dim 0",
        "copy_fp32": "copy_ fp32 (baseline)",
        "dual_from_master": "dual-axis from master",
        "block_from_master": "32x32 from master",
        "single_dim_-1_from_master": "one axis -1 from master",
        "cast_then_dual": "cast to bf16, then dual",
    }
    rows = []
    for name, label in labels.items():
        row = [label, r["bytes_per_element"][name]]
        for nt in counts:
            b = r["bandwidth"][nt][name]
            row += [b["ms"], b["gb_per_s"], b["x_copy_time"], b["of_copy_bandwidth"]]
        row.append(r["thread_speedup"][name])
        rows.append(row)
    print_table(
        "\n  x copy: time over the copy_ of the same source dtype in the same rounds "
        "(bf16 ops vs bf16 copy_, master ops vs fp32 copy_); BW/copy: bytes moved per "
        "second over the copy's; thr speed-up: 1-thread time / "
        f"{r['threads']}-thread time",
        header,
        rows,
    )
    if r["speedup_vs_torchao"]["dual"] is not None:
        print(
            f"\n  torchao to_mx: dual {ms['torchao_to_mx_dual']:.4g} ms "
            f"(zrw {sp['dual']:.0f}x faster), one axis {ms['torchao_to_mx_single']:.4g} ms "
            f"(zrw {sp['single_dim_-1']:.0f}x faster)"
        )
    print(f"  output memory: {r['allocator']}")
    if ms["dual_fresh_output_pages"] is not None:
        fresh = ms["dual_fresh_output_pages"]
        print(
            f"  dual-axis with fresh output pages: {fresh:.3g} ms "
            f"({fresh / ms['copy']:.2f}x copy; +{fresh - ms['dual']:.3g} ms of page faults)"
        )
    print(
        f"  mx_matmul {args.mm}^3: {ms['mx_matmul']:.4g} ms vs bf16 torch.matmul "
        f"{ms['matmul_bf16']:.4g} ms -> {r['mx_matmul_over_bf16_matmul']:.2f}x the bf16 time "
        f"(inner GEMM: {'/'.join(r['mx_matmul_gemm_ran'])}; native BF16: "
        f"{'yes' if r['native_bf16'] else 'no'})"
    )
    if r["mx_matmul_fp32_gemm_over_fp32_matmul"] is not None:
        print(
            f"  mx_matmul {args.mm}^3 on the FP32 GEMM path (ZRW_CPU_GEMM=fp32, bf16 result): "
            f"{ms['mx_matmul_fp32_gemm']:.4g} ms vs fp32 torch.matmul {ms['matmul_fp32']:.4g} "
            f"ms -> {r['mx_matmul_fp32_gemm_over_fp32_matmul']:.2f}x the fp32 time"
        )
