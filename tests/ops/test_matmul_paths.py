"""mx_matmul's two CPU GEMM paths: the FP32 GEMM on fp32 tiles, and the BF16 GEMM
on bf16 tiles where the CPU has native BF16 dot products. Both are run on every machine, each in
its own process with ZRW_CPU_GEMM forcing it (the choice is made once per process):

- the BF16 path gives the FP32 path's results up to the order of the fp32 sums (one bf16 rounding
  of the same fp32 dot products), for all four operand layouts and K not a multiple of 32;
- fp16/fp32 results and scales at the extremes of the e8m0 range (or NaN blocks) run the FP32
  GEMM on the BF16 path too, and are then bitwise the FP32 path's;
- a call's peak memory is its result plus the documented tile bound on both paths, also for a
  weight gradient from few tokens (the product tile is bounded, not the whole (M, N) in fp32);
- the tiles live in a workspace that persists between calls: a repeated call allocates only its
  result, the workspace stays within the bound, zrw.memory counts it, and
  zrw.ops.free_matmul_workspace() returns it; calls from several threads at once stay exact.
"""

import os
import subprocess
import sys

import pytest
import torch

import zrw  # noqa: F401
import zrw.testing
from helpers.bitwise import same_bits

CASES_SCRIPT = r"""
import sys, torch, zrw, zrw.testing
from zrw import ops
torch.manual_seed(0)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

def operand(rows, k, transposed, elem, scale, zero_rows=()):
    x = torch.randn(rows, k)
    if scale == "nan":
        x[0, 0] = float("nan")
    else:
        x = x * scale
    for r in zero_rows:
        x[r] = 0
    if transposed:  # the .t() of a tensor blocked along its other axis (dgrad / wgrad)
        d, s = ops.mx_quantize(x.t().contiguous(), 0, elem)
        return d.t(), s.t()
    return ops.mx_quantize(x, -1, elem)

results = {}
cases = []
for elem in (E4M3, E5M2):
    for a_t in (False, True):
        for b_t in (False, True):
            for (m, n, k) in ((48, 40, 113), (64, 96, 256)):
                cases.append((f"{elem}-{a_t}-{b_t}-{m}x{n}x{k}", elem, a_t, b_t, m, n, k, 1.0,
                              1.0, ()))
# An all-zero row (a masked token's gradient): zero blocks do not force the FP32 GEMM.
cases.append(("zero-blocks", E4M3, False, False, 64, 64, 128, 1.0, 1.0, (3, 17)))
# Extremes of the e8m0 range: values whose bf16 form would be subnormal, products that would
# underflow or overflow fp32, and a NaN block.
cases.append(("tiny-elements", E4M3, False, False, 32, 32, 64, 2.0 ** -121, 1.0, ()))
cases.append(("tiny-products", E4M3, True, False, 32, 32, 64, 2.0 ** -60, 2.0 ** -60, ()))
cases.append(("huge-products", E5M2, False, True, 32, 32, 64, 2.0 ** 64, 2.0 ** 64, ()))
cases.append(("nan-block", E4M3, False, False, 32, 32, 64, "nan", 1.0, ()))
for name, elem, a_t, b_t, m, n, k, sa_, sb_, zr in cases:
    qa, sa = operand(m, k, a_t, elem, sa_, zr)
    qb, sb = operand(n, k, b_t, elem, sb_)
    for out in (torch.bfloat16, torch.float16, torch.float32):
        zrw.testing.reset_gemm_counts()
        y = ops.mx_matmul(qa, sa, qb, sb, out)
        counts = zrw.testing.gemm_counts()
        ran = [key for key, v in counts.items() if v]
        ref = (ops.mx_dequantize(qa.contiguous(), sa.contiguous(), -1, torch.float32).double()
               @ ops.mx_dequantize(qb.contiguous(), sb.contiguous(), -1,
                                   torch.float32).double().t())
        results[(name, str(out))] = (y, ran, ref)
torch.save({"gemm": zrw._C.cpu_gemm(), "results": results}, sys.argv[1])
"""

MEMORY_SCRIPT = r"""
import sys, torch, zrw
zrw.memory.install()
from zrw import ops
out = []
# A weight gradient from 64 tokens of a wide layer: a = Q_M(dy).t() (8192, 64), b = Q_M(x).t()
# (4096, 64), both column-major views; the bf16 result is (8192, 4096): 64 MiB.
T, N_out, K_in = 64, 8192, 4096
qdy, sdy = ops.mx_quantize(torch.randn(T, N_out, dtype=torch.bfloat16), 0)
qx, sx = ops.mx_quantize(torch.randn(T, K_in, dtype=torch.bfloat16), 0)
with zrw.memory.window() as m:
    y = ops.mx_matmul(qdy.t(), sdy.t(), qx.t(), sx.t(), torch.bfloat16)
out.append(m["peak"] - m["start"])
del y
# A forward GEMM: (1024, 4096) activations times a (4096, 4096) weight.
qa, sa = ops.mx_quantize(torch.randn(1024, 4096, dtype=torch.bfloat16), -1)
qb, sb = ops.mx_quantize(torch.randn(4096, 4096, dtype=torch.bfloat16), -1)
with zrw.memory.window() as m:
    y = ops.mx_matmul(qa, sa, qb, sb, torch.bfloat16)
out.append(m["peak"] - m["start"])
print(zrw._C.cpu_gemm(), *out)
"""

WORKSPACE_SCRIPT = r"""
import sys, threading, torch, zrw
zrw.memory.install()
from zrw import ops
torch.manual_seed(0)
qa, sa = ops.mx_quantize(torch.randn(1024, 4096, dtype=torch.bfloat16), -1)
qb, sb = ops.mx_quantize(torch.randn(3072, 4096, dtype=torch.bfloat16), -1)
assert ops.matmul_workspace_bytes() == 0
before = zrw.memory.current()
y0 = ops.mx_matmul(qa, sa, qb, sb, torch.bfloat16)
held = ops.matmul_workspace_bytes()
grown = zrw.memory.current() - before - y0.numel() * 2  # what the first call kept
with zrw.memory.window() as m:
    y1 = ops.mx_matmul(qa, sa, qb, sb, torch.bfloat16)
again = m["peak"] - m["start"]
same = torch.equal(y0, y1)
del y1
# What torch's GEMM itself allocates for one tile product of this call (the A tile, 1024 x 4096,
# times a B tile of 8 MiB / 4096: 512 fp32 or 1024 bf16 rows, in the path's tile dtype, into a
# slice of the result or into the fp32 product tile): the GEMM library's scratch, outside zrw's
# control.
tile = torch.bfloat16 if zrw._C.cpu_gemm() == "bf16" else torch.float32
nb = 1024 if tile == torch.bfloat16 else 512
ta, tb = torch.randn(1024, 4096).to(tile), torch.randn(nb, 4096).to(tile)
tout = torch.empty(1024, 3072, dtype=tile)
torch.mm(ta, tb.t(), out=tout[:, :nb])
with zrw.memory.window() as m:
    torch.mm(ta, tb.t(), out=tout[:, :nb])
scratch = m["peak"] - m["start"]
del ta, tb, tout
# Two threads at once: one holds the workspace, the other gets tiles of its own; both exact.
outs = {}
def run(i):
    outs[i] = [ops.mx_matmul(qa, sa, qb, sb, torch.bfloat16) for _ in range(4)]
threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
for t in threads: t.start()
for t in threads: t.join()
threaded = all(torch.equal(y, y0) for ys in outs.values() for y in ys)
del outs
current = zrw.memory.current()
freed = ops.free_matmul_workspace()
dropped = current - zrw.memory.current()
print(zrw._C.cpu_gemm(), held, grown, again, scratch, int(same), int(threaded), freed, dropped,
      ops.matmul_workspace_bytes(), ops.free_matmul_workspace())
"""

PATHS = ("fp32", "bf16")


def run_child(script, path, *args):
    env = dict(os.environ, ZRW_CPU_GEMM=path)
    r = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for path in PATHS:
        f = tmp_path_factory.mktemp(path) / "results.pt"
        run_child(CASES_SCRIPT, path, str(f))
        saved = torch.load(f, weights_only=False)
        assert saved["gemm"] == path  # the override took effect
        out[path] = saved["results"]
    return out


def _extreme(name):
    return name in ("tiny-elements", "tiny-products", "huge-products", "nan-block")


def test_fp32_path_runs_the_fp32_gemm_everywhere(results):
    for key, (_, ran, _) in results["fp32"].items():
        assert ran == ["fp32"], key


def test_bf16_path_runs_bf16_gemm_for_bf16_results_and_hands_extremes_to_fp32(results):
    for (name, out), (_, ran, _) in results["bf16"].items():
        if out != "torch.bfloat16":
            assert ran == ["fp32"], (name, out)  # fp16/fp32 results keep the FP32 GEMM
        elif _extreme(name):
            assert ran == ["bf16_to_fp32"], name  # never flushed: handed over
        else:
            assert ran == ["bf16"], name


def test_bf16_path_equals_fp32_path_up_to_summation_order(results):
    for key, (y_bf16, ran, ref) in results["bf16"].items():
        y_fp32 = results["fp32"][key][0]
        assert y_bf16.dtype == y_fp32.dtype and y_bf16.shape == y_fp32.shape
        if ran != ["bf16"]:
            # Same GEMM, same tiles: bitwise (NaNs where the FP32 path has them).
            assert same_bits(y_bf16, y_fp32), key
            continue
        # One rounding of the same fp32 dot products to bf16: both within half a bf16 ulp of
        # the exact (float64) product, up to the fp32 summation error.
        for y in (y_bf16, y_fp32):
            err = (y.double() - ref).abs()
            bound = ref.abs() * 2.0**-8 + 1e-6 * ref.abs().max()
            assert bool((err <= bound).all()), (key, float((err - bound).max()))
        # ...and at most one bf16 ulp from each other.
        diff = (y_bf16.double() - y_fp32.double()).abs()
        assert bool((diff <= y_fp32.double().abs() * 2.0**-7 + 1e-6 * ref.abs().max()).all()), key


@pytest.mark.parametrize("path", PATHS)
def test_peak_is_the_result_plus_the_tile_bound(path):
    # The documented bound: an A tile of at most 16 MiB, a B tile of 8 MiB and an fp32 product
    # tile of 16 MiB (the FP32 path's, for a bf16 result).
    gemm, wgrad, fwd = run_child(MEMORY_SCRIPT, path).split()
    assert gemm == path
    tiles = (16 + 8 + 16) << 20
    result = 8192 * 4096 * 2
    assert result <= int(wgrad) <= result + tiles + (1 << 20), (path, int(wgrad))
    result = 1024 * 4096 * 2
    assert result <= int(fwd) <= result + tiles + (1 << 20), (path, int(fwd))


@pytest.mark.parametrize("path", PATHS)
def test_the_tile_workspace_persists_within_its_bound_and_is_freed(path):
    out = run_child(WORKSPACE_SCRIPT, path).split()
    gemm = out[0]
    held, grown, again, scratch, same, threaded, freed, dropped, after, freed_again = map(
        int, out[1:]
    )
    assert gemm == path
    # The first call kept the tiles: the workspace is counted by zrw.memory, within the bound
    # (A tile 16 MiB, B tile 8 MiB, and on the FP32 path a 16 MiB fp32 product tile for the bf16
    # result; the BF16 path writes straight into the result).
    bound = (16 + 8 + (16 if path == "fp32" else 0)) << 20
    assert 0 < held <= bound + 256, held
    assert grown == held
    # A repeated call allocates its result only, plus what torch's GEMM allocates for a tile
    # product of the same shape on its own, and gives the same bytes.
    result = 1024 * 3072 * 2
    assert result <= again <= result + scratch + (64 << 10), (again, scratch)
    assert same and threaded
    # free_matmul_workspace() returns the bytes it freed; the allocator gets them back.
    assert freed == held and dropped == held
    assert after == 0 and freed_again == 0


def test_backends_reports_the_gemm_path():
    cpu = zrw.backends()["cpu"]
    assert cpu["gemm"] == zrw._C.cpu_gemm() in PATHS
    assert isinstance(cpu["native_bf16"], bool)
    if "ZRW_CPU_GEMM" not in os.environ:
        assert cpu["gemm"] == ("bf16" if cpu["native_bf16"] else "fp32")


def test_an_unknown_gemm_override_is_refused():
    env = dict(os.environ, ZRW_CPU_GEMM="int8")
    r = subprocess.run(
        [sys.executable, "-c", "import zrw; print(zrw._C.cpu_gemm())"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode != 0
    assert 'ZRW_CPU_GEMM must be "fp32", "bf16" or "auto", got "int8"' in r.stderr


def test_grouped_experts_take_the_same_gemm_path():
    # MXGroupedLinear's per-expert GEMMs are mx_matmul calls: they run this process's path.
    from zrw.nn import MXGroupedLinear

    layer = MXGroupedLinear(4, 64, 96, release=False, dtype=torch.bfloat16)
    x = torch.randn(40, 64).to(torch.bfloat16).requires_grad_(True)
    zrw.testing.reset_gemm_counts()
    layer(x, [10, 0, 25, 5]).float().sum().backward()
    counts = zrw.testing.gemm_counts()
    assert counts[zrw._C.cpu_gemm()] == 3 * 3  # 3 experts with tokens x (fwd, dgrad, wgrad)
    assert sum(counts.values()) == 9
    zrw.cache.cache_clear()
