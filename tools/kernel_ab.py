"""A/B of the CPU quantization kernel: this working tree against a git revision, in one process.

    python tools/kernel_ab.py --against HEAD [--isa avx2] [--threads 1] [--n 4096] [--rounds 40]

On a shared VM the time of a memory-bound kernel moves by 10-30% between processes (a process
can land in a slower state for its whole life), so comparing two builds process against process
needs many runs and still leans. This tool builds the quantization kernel of both sources
(``csrc/mx/mx_cpu_quant_kernel.cpp`` for one ISA, or for a revision before the unified kernel,
the former per-ISA code behind ``csrc/mx/mx_cpu_kernels.h``) into two small shared libraries,
loads both into one process, checks that they write the same bytes, and times them on the same
input and output buffers with their rounds interleaved (the order alternating each round). It
prints, per kernel, the median over rounds of (this tree's time / the revision's time).

Developer tool, not part of the package: it needs g++, git and the installed torch's headers
(for at::parallel_for; the libraries are built with -fopenmp like torch's thread pool). The
kernels: one axis (row, col), dual-axis, 32x32 (block), and the same from an FP32 master
(row_m, dual_m, block_m); --isa avx512 runs fp32 sources through the AVX2 kernels, as the
dispatcher does. What it measured: docs/benchmarks.md, "The unified kernel against the former code".
"""

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ISA_FLAGS = {  # as CMakeLists.txt's ZRW_ISA_FLAGS_*
    "base": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
}

# The per-ISA entry points of the unified kernel (csrc/mx/mx_cpu_isa.h): Src 0 = bf16, 3 = an
# fp32 master rounded to bf16. An AVX-512 build compiles bf16 sources only (fp32 goes to AVX2).
WRAP_UNIFIED = r"""
#include <ATen/Parallel.h>
#include "mx/mx_cpu_isa.h"
namespace zrw::cpu {
void parallel_for(int64_t b, int64_t e, int64_t g, const std::function<void(int64_t, int64_t)>& f) {
  at::parallel_for(b, e, g, f);
}
}  // namespace zrw::cpu
extern "C" __attribute__((visibility("default"))) void ab_quant(const void* src, int kind,
    int64_t n, int64_t k, uint8_t** o) {
  zrw::cpu::QuantOutputs out{o[0], o[1], o[2], o[3], o[4], o[5]};
  const auto s = static_cast<zrw::cpu::Src>(kind);
  const auto f = zrw::mx::ElemFormat::E4M3;
  const auto m = zrw::mx::ScaleMode::Floor;
#if defined(AB_BASE)
  zrw::cpu::base::quantize_matrices(src, s, 1, n, k, f, m, out);
#elif defined(AB_AVX512)
  if (kind == 0) zrw::cpu::avx512::quantize_matrices(src, s, 1, n, k, f, m, out);
  else zrw::cpu::avx2::quantize_matrices(src, s, 1, n, k, f, m, out);
#else
  zrw::cpu::avx2::quantize_matrices(src, s, 1, n, k, f, m, out);
#endif
}
"""
# The former per-ISA code (before e203f3a): entry points on at::ScalarType.
WRAP_FORMER = r"""
#include "mx/mx_cpu_kernels.h"
extern "C" __attribute__((visibility("default"))) void ab_quant(const void* src, int kind,
    int64_t n, int64_t k, uint8_t** o) {
  zrw::cpu::QuantOutputs out{};
  out.row_data = o[0]; out.row_scale = o[1]; out.col_data = o[2]; out.col_scale = o[3];
  out.tile_data = o[4]; out.tile_scale = o[5];
  const at::ScalarType st = kind == 0 ? at::kBFloat16 : at::kFloat;
  const at::ScalarType rt = kind == 3 ? at::kBFloat16 : at::ScalarType::Undefined;
  const auto f = zrw::mx::ElemFormat::E4M3;
  const auto m = zrw::mx::ScaleMode::Floor;
#if defined(AB_BASE)
  zrw::cpu::base::quantize_matrices(src, st, rt, 1, n, k, f, m, out);
#elif defined(AB_AVX512)
  zrw::cpu::avx512::quantize_matrices(src, st, rt, 1, n, k, f, m, out);
#else
  zrw::cpu::avx2::quantize_matrices(src, st, rt, 1, n, k, f, m, out);
#endif
}
"""


def run(cmd, **kw):
    subprocess.run(cmd, check=True, **kw)


def build(src_root, isa, out_dir):
    """The kernel of the tree at src_root for isa, as out_dir/ab.so."""
    torch_dir = os.path.dirname(torch.__file__)
    inc = ["-I", f"{torch_dir}/include", "-I", f"{torch_dir}/include/torch/csrc/api/include"]
    cflags = ["-O3", "-DNDEBUG", "-fPIC", "-std=gnu++17", "-fvisibility=hidden", "-w", "-fopenmp"]
    abi = ["-D_GLIBCXX_USE_CXX11_ABI=" + str(int(torch.compiled_with_cxx11_abi()))]
    unified = os.path.exists(os.path.join(src_root, "csrc/mx/mx_cpu_isa.h"))
    isas = [isa] + (["avx2"] if isa == "avx512" and unified else [])
    objs = []
    for i in isas:
        obj = os.path.join(out_dir, f"quant_{i}.o")
        extra = [] if unified else inc + abi  # the former kernels include torch headers
        run(
            [
                "g++",
                *cflags,
                *extra,
                "-I",
                f"{src_root}/csrc",
                f"-DZRW_CPU_ISA={i}",
                *ISA_FLAGS[i],
                "-c",
                f"{src_root}/csrc/mx/mx_cpu_quant_kernel.cpp",
                "-o",
                obj,
            ]
        )
        objs.append(obj)
    wrap = os.path.join(out_dir, "wrap.cpp")
    with open(wrap, "w") as f:
        f.write(WRAP_UNIFIED if unified else WRAP_FORMER)
    define = {"base": "-DAB_BASE", "avx512": "-DAB_AVX512", "avx2": "-DAB_AVX2"}[isa]
    wobj = os.path.join(out_dir, "wrap.o")
    run(["g++", *cflags, *inc, *abi, define, "-I", f"{src_root}/csrc", "-c", wrap, "-o", wobj])
    lib = os.path.join(out_dir, "ab.so")
    run(
        [
            "g++",
            "-shared",
            "-o",
            lib,
            wobj,
            *objs,
            f"-L{torch_dir}/lib",
            "-ltorch_cpu",
            "-lc10",
            f"-Wl,-rpath,{torch_dir}/lib",
            "-Wl,-Bsymbolic",
            "-fopenmp",
        ]
    )
    return lib


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", default="HEAD", help="git revision to compare with (HEAD)")
    p.add_argument("--isa", default="avx2", choices=sorted(ISA_FLAGS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--n", type=int, default=4096, help="the weight is n x n (4096)")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--repeat", type=int, default=1, help="measure this many times")
    args = p.parse_args()
    if args.n % 32:
        sys.exit(f"--n: expected a multiple of 32, found {args.n}")

    with tempfile.TemporaryDirectory(prefix="zrw_kernel_ab_") as tmp:
        rev_root = os.path.join(tmp, "rev")
        os.makedirs(rev_root)
        archive = subprocess.run(
            ["git", "-C", ROOT, "archive", args.against, "csrc"], check=True, capture_output=True
        ).stdout
        run(["tar", "-x", "-C", rev_root], input=archive)
        libs = {}
        for name, root in (("rev", rev_root), ("tree", ROOT)):
            d = os.path.join(tmp, name + "_build")
            os.makedirs(d)
            print(
                f"building {name} ({args.against if name == 'rev' else 'working tree'}, "
                f"{args.isa}) ...",
                flush=True,
            )
            libs[name] = ctypes.CDLL(build(root, args.isa, d))
        for _ in range(args.repeat):
            measure(libs, args)


def measure(libs, args):
    torch.set_num_threads(args.threads)
    n = args.n
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(n, n, generator=gen)
    w = master.to(torch.bfloat16)
    u8 = lambda *s: torch.empty(*s, dtype=torch.uint8)  # noqa: E731
    planes = [u8(n, n), u8(n, n // 32), u8(n, n), u8(n // 32, n), u8(n, n), u8(n // 32, n // 32)]

    def outs(row=False, col=False, tile=False):
        on = (row, row, col, col, tile, tile)
        return (ctypes.c_void_p * 6)(*[t.data_ptr() if o else 0 for t, o in zip(planes, on)])

    kernels = {
        "row": (w, 0, outs(row=True)),
        "col": (w, 0, outs(col=True)),
        "dual": (w, 0, outs(True, True)),
        "block": (w, 0, outs(tile=True)),
        "row_m": (master, 3, outs(row=True)),
        "dual_m": (master, 3, outs(True, True)),
        "block_m": (master, 3, outs(tile=True)),
    }

    def call(lib, k):
        src, kind, o = kernels[k]
        libs[lib].ab_quant(
            ctypes.c_void_p(src.data_ptr()), kind, ctypes.c_int64(n), ctypes.c_int64(n), o
        )

    for k in kernels:  # both write the same bytes
        got = {}
        for lib in libs:
            for t in planes:
                t.zero_()
            call(lib, k)
            got[lib] = [t.clone() for t in planes]
        if not all(torch.equal(a, b) for a, b in zip(got["rev"], got["tree"])):
            sys.exit(f"{k}: the working tree's bytes differ from {args.against}'s")
    times = {(k, lib): [] for k in kernels for lib in libs}
    for r in range(args.rounds):
        for k in kernels:
            for lib in ("rev", "tree") if r % 2 else ("tree", "rev"):
                t0 = time.perf_counter()
                call(lib, k)
                times[(k, lib)].append(time.perf_counter() - t0)
    print(
        f"{args.isa}, {args.threads} thread(s), {n}x{n}, {args.rounds} interleaved rounds; "
        f"tree / {args.against}: median of per-round ratios (min-time ratio; min ms)"
    )
    for k in kernels:
        a, b = times[(k, "rev")], times[(k, "tree")]
        ratio = statistics.median(y / x for x, y in zip(a, b))
        print(
            f"  {k:8s} {ratio:.3f} ({min(b) / min(a):.3f}; {min(b) * 1e3:.2f} vs "
            f"{min(a) * 1e3:.2f} ms)"
        )


if __name__ == "__main__":
    main()
