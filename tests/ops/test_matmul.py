"""zrw.ops.mx_matmul against zrw.reference.mx_matmul (dequantize to fp32, fp32 matmul).

The kernel accumulates in fp32 in its own order, so results agree within fp32 rounding: each entry
within 1e-5 of the magnitude sum(|a_ik| |b_jk|) it was accumulated from (the error bound of an fp32
dot product scales with that sum, not with the result, which may cancel to ~0).

Operands come in the four layouts training uses (docs/design.md §4): "rows" is a (R, K) tensor
quantized along K; "t" is the ``.t()`` view of a (K, R) tensor quantized along dim 0 (with its
scale's ``.t()``): dgrad passes ``W_bwd.t()``, wgrad ``Q_M(dy).t()`` and ``Q_M(x).t()``. The op
takes these strided views as they are.
"""

import pytest
import torch

import zrw  # noqa: F401  (registers torch.ops.zrw.*)
from zrw import ops
from zrw import reference as ref

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E8M0 = torch.float8_e8m0fnu
F32 = torch.float32
RTOL = 1e-5


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


def operand(rows, k, layout, elem_dtype=E4M3, seed=0, spread=8):
    """An MX operand (R, K) blocked along K, with its scale, in the given memory layout."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.exp2(
        torch.randint(-spread, spread + 1, (rows, k), generator=gen)
    )
    x = x.to(torch.bfloat16)
    if layout == "rows":
        return ops.mx_quantize(x, -1, elem_dtype, "floor")
    if layout == "t":
        data, scale = ops.mx_quantize(x.t().contiguous(), 0, elem_dtype, "floor")  # (K, R)
        return data.t(), scale.t()
    if layout == "row_step":  # every other row of a taller tensor
        data, scale = ops.mx_quantize(
            torch.cat([x, x.flip(0)], 1).view(2 * rows, k), -1, elem_dtype, "floor"
        )
        return data[::2], scale[::2]
    raise AssertionError(layout)


def magnitude(a, a_scale, b, b_scale):
    """sum_k |a_ik| |b_jk| in float64: the scale of an fp32 dot product's rounding error."""
    a64 = ref.mx_dequantize(a, a_scale, -1, F32).double().abs()
    b64 = ref.mx_dequantize(b, b_scale, -1, F32).double().abs()
    return a64 @ b64.T


def assert_within_fp32_rounding(got, expected, mag, what=""):
    err = (got.double() - expected.double()).abs()
    assert bool((err <= RTOL * mag + 1e-38).all()), (
        f"{what}: worst |got - expected| / magnitude = {(err / (mag + 1e-38)).max().item():.3g}"
    )


def assert_matmul_matches_reference(a, a_scale, b, b_scale, what=""):
    expected = ref.mx_matmul(a, a_scale, b, b_scale, out_dtype=F32)
    got = ops.mx_matmul(a, a_scale, b, b_scale, F32)
    assert got.shape == expected.shape == (a.shape[0], b.shape[0]), what
    assert got.dtype == F32, what
    mag = magnitude(a, a_scale, b, b_scale)
    # fp32-tight: per-entry tolerance from the accumulated magnitude, nothing relative to |result|.
    assert_within_fp32_rounding(got, expected, mag, what)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=RTOL * mag.max().item())
    # bf16 and fp16 outputs: the fp32 result rounded once more (loose: one half-ulp of the output
    # dtype on top of the fp32 tolerance).
    for out_dtype, ulp in ((torch.bfloat16, 2**-8), (torch.float16, 2**-11)):
        low = ops.mx_matmul(a, a_scale, b, b_scale, out_dtype)
        assert low.dtype == out_dtype and low.shape == got.shape, what
        err = (low.double() - expected.double()).abs()
        finite = expected.abs() < torch.finfo(out_dtype).max / 2
        bound = ulp * expected.double().abs() + RTOL * mag + 2 * torch.finfo(out_dtype).tiny
        assert bool((err <= bound)[finite].all()), f"{what}: {out_dtype} output off"
    return got


LAYOUTS = ["rows", "t"]


@pytest.mark.parametrize("b_layout", LAYOUTS)
@pytest.mark.parametrize("a_layout", LAYOUTS)
@pytest.mark.parametrize(
    "m, n, k",
    [
        (17, 23, 70),
        (1, 40, 64),
        (40, 1, 33),
        (1, 1, 1),
        (33, 31, 33),
        (5, 7, 1000),
        (256, 384, 512),
        (64, 300, 96),
        # K = 65536: both operands go through several fp32 row tiles (64 rows each at this K)
        (100, 70, 65536),
    ],
    ids=lambda v: str(v),
)
def test_matmul_all_transpose_combinations(m, n, k, a_layout, b_layout):
    a, a_scale = operand(m, k, a_layout, seed=m * 7 + k)
    b, b_scale = operand(n, k, b_layout, seed=n * 11 + k + 1)
    if a_layout == "t" and m > 1:
        assert a.stride() == (1, m) and not a.is_contiguous()
    assert_matmul_matches_reference(a, a_scale, b, b_scale, f"{a_layout} x {b_layout}")


@pytest.mark.parametrize(
    "a_fmt, b_fmt",
    [(E5M2, E5M2), (E5M2, E4M3), (E4M3, E5M2)],
    ids=["e5m2", "e5m2xe4m3", "e4m3xe5m2"],
)
@pytest.mark.parametrize(
    "layouts",
    [("rows", "rows"), ("t", "rows"), ("rows", "t"), ("t", "t")],
    ids=lambda v: "x".join(v),
)
def test_matmul_e5m2_and_mixed_operands(a_fmt, b_fmt, layouts):
    a, a_scale = operand(24, 70, layouts[0], a_fmt, seed=1, spread=12)
    b, b_scale = operand(40, 70, layouts[1], b_fmt, seed=2, spread=12)
    assert_matmul_matches_reference(a, a_scale, b, b_scale)


def test_matmul_other_strided_views():
    # Row-stepped views and row offsets: still blocked along K, not contiguous.
    a, a_scale = operand(30, 96, "row_step", seed=3)
    b, b_scale = operand(20, 96, "rows", seed=4)
    assert not a.is_contiguous()
    assert_matmul_matches_reference(a, a_scale, b, b_scale)
    assert_matmul_matches_reference(a[3:], a_scale[3:], b[1:], b_scale[1:])
    # A scale with its own layout (column-major copy) under a row-major operand.
    col_major_scale = b_scale.t().contiguous().t()
    assert_matmul_matches_reference(a, a_scale, b, col_major_scale)


def test_matmul_training_layouts():
    # The three GEMMs of an MX linear layer, y = x W^T, with every operand as training makes it.
    gen = torch.Generator().manual_seed(5)
    m, n, k = 48, 40, 70
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    dy = torch.randn(m, n, generator=gen).to(torch.bfloat16)
    w_fwd, w_fwd_scale, w_bwd, w_bwd_scale = ops.mx_quantize_dual(w)

    # forward: y (M, N) = Q_K(x) @ W_fwd^T
    xq, xq_scale = ops.mx_quantize(x, -1)
    y = assert_matmul_matches_reference(xq, xq_scale, w_fwd, w_fwd_scale, "fwd")
    assert y.shape == (m, n)

    # dgrad: dx (M, K) = Q_N(dy) @ W, W's backward plane (blocked along N) as its .t() (K, N)
    dyq, dyq_scale = ops.mx_quantize(dy, -1)
    dx = assert_matmul_matches_reference(dyq, dyq_scale, w_bwd.t(), w_bwd_scale.t(), "dgrad")
    assert dx.shape == (m, k)
    dy_values = ops.mx_dequantize(dyq, dyq_scale, -1, torch.float32).double()
    w_values = ops.mx_dequantize(w_bwd, w_bwd_scale, -2, torch.float32).double()
    expected_dx = dy_values @ w_values
    expected_dx_magnitude = dy_values.abs() @ w_values.abs()
    assert_within_fp32_rounding(dx, expected_dx, expected_dx_magnitude)

    # wgrad: dW (N, K) = Q_M(dy)^T @ Q_M(x): both quantized along tokens (dim 0), passed as .t()
    dy_m, dy_m_scale = ops.mx_quantize(dy, 0)
    x_m, x_m_scale = ops.mx_quantize(x, 0)
    dw = assert_matmul_matches_reference(dy_m.t(), dy_m_scale.t(), x_m.t(), x_m_scale.t(), "wgrad")
    assert dw.shape == (n, k)
    dy_values = ops.mx_dequantize(dy_m, dy_m_scale, 0, torch.float32).double()
    x_values = ops.mx_dequantize(x_m, x_m_scale, 0, torch.float32).double()
    assert_within_fp32_rounding(dw, dy_values.T @ x_values, dy_values.abs().T @ x_values.abs())


@pytest.mark.parametrize("shape", [(40, 70), (64, 64), (33, 100)], ids=["40x70", "64x64", "33x100"])
def test_matmul_with_32x32_block_operands(shape):
    # The 32x32 recipe: one data tensor; forward uses expand_block_scale(.., -1), dgrad the .t()
    # of the data with the .t() of expand_block_scale(.., -2).
    gen = torch.Generator().manual_seed(6)
    n, k = shape
    spread = torch.exp2(torch.randint(-6, 7, shape, generator=gen))
    w = (torch.randn(shape, generator=gen) * spread).to(torch.bfloat16)
    data, block_scale = ops.mx_quantize_block(w)
    fwd_scale = ops.expand_block_scale(block_scale, w.shape, -1)
    bwd_scale = ops.expand_block_scale(block_scale, w.shape, -2)
    x, x_scale = operand(19, k, "rows", seed=7)
    assert_matmul_matches_reference(x, x_scale, data, fwd_scale, "fwd")
    dy, dy_scale = operand(21, n, "rows", seed=8)
    dx = assert_matmul_matches_reference(dy, dy_scale, data.t(), bwd_scale.t(), "dgrad")
    # Both directions read the same weight values.
    w_values = ops.mx_dequantize(data, fwd_scale, -1, torch.float32).double()
    dy_values = ops.mx_dequantize(dy, dy_scale, -1, torch.float32).double()
    assert_within_fp32_rounding(dx, dy_values @ w_values, dy_values.abs() @ w_values.abs())


def test_matmul_specials():
    # A 0xFF scale block poisons exactly the rows (of a) / columns (of b) that read it; scale
    # byte 0 (2^-127) operands are exact; byte 254 (2^127) products overflow like the reference.
    a, a_scale = operand(9, 70, "rows", seed=9)
    b, b_scale = operand(11, 70, "t", seed=10)
    a_scale = a_scale.view(torch.uint8).clone()
    a_scale[3, 1] = 0xFF
    a_scale = a_scale.view(E8M0)
    got = ops.mx_matmul(a, a_scale, b, b_scale, F32)
    expected = ref.mx_matmul(a, a_scale, b, b_scale, F32)
    assert torch.equal(got.isnan(), expected.isnan())
    assert got[3].isnan().all() and got.isnan().sum() == 11

    tiny = torch.zeros_like(a_scale.view(torch.uint8)).view(E8M0)
    big = torch.full((11, 3), 127 + 100, dtype=torch.uint8).view(E8M0)
    assert_matmul_matches_reference(a, tiny, b.contiguous(), big)

    huge = torch.full((11, 3), 254, dtype=torch.uint8).view(E8M0)
    got = ops.mx_matmul(a, a_scale.view(torch.uint8).clamp(max=200).view(E8M0), b, huge, F32)
    expected = ref.mx_matmul(a, a_scale.view(torch.uint8).clamp(max=200).view(E8M0), b, huge, F32)
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.isinf(), expected.isinf())
    assert got.isinf().any() or got.isnan().any()


@pytest.mark.parametrize("m, n, k", [(0, 5, 64), (5, 0, 64), (5, 7, 0), (0, 0, 0), (0, 3, 33)])
@pytest.mark.parametrize("layouts", [("rows", "rows"), ("t", "t")], ids=lambda v: "x".join(v))
def test_matmul_empty(m, n, k, layouts):
    a, a_scale = operand(m, k, layouts[0]) if m * k else _empty_operand(m, k, layouts[0])
    b, b_scale = operand(n, k, layouts[1]) if n * k else _empty_operand(n, k, layouts[1])
    for out_dtype in (torch.float32, torch.bfloat16):
        got = ops.mx_matmul(a, a_scale, b, b_scale, out_dtype)
        assert got.shape == (m, n) and got.dtype == out_dtype
        assert torch.equal(got.float(), torch.zeros(m, n))
        assert torch.equal(got, ref.mx_matmul(a, a_scale, b, b_scale, out_dtype))


def _empty_operand(rows, k, layout):
    kb = -(-k // 32)
    if layout == "rows":
        return torch.empty(rows, k, dtype=E4M3), torch.empty(rows, kb, dtype=E8M0)
    return torch.empty(k, rows, dtype=E4M3).t(), torch.empty(kb, rows, dtype=E8M0).t()


def test_matmul_does_not_modify_operands():
    a, a_scale = operand(20, 70, "t", seed=11)
    b, b_scale = operand(30, 70, "t", seed=12)
    before = [t.view(torch.uint8).clone() for t in (a, a_scale, b, b_scale)]
    strides = [t.stride() for t in (a, a_scale, b, b_scale)]
    ops.mx_matmul(a, a_scale, b, b_scale, F32)
    for t, saved, stride in zip((a, a_scale, b, b_scale), before, strides):
        assert torch.equal(t.view(torch.uint8), saved) and t.stride() == stride


MEMORY_SCRIPT = """
import sys, torch, zrw
zrw.memory.install()            # before any tensor exists, so that every byte is counted
from zrw import ops
M, K, N = 1024, 4096, 4096
for a_t, b_t in ((False, False), (True, True)):
    x = torch.randn(M, K, dtype=torch.bfloat16)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    if a_t:
        qa, sa = (t.t() for t in ops.mx_quantize(x.t().contiguous(), 0))
    else:
        qa, sa = ops.mx_quantize(x, -1)
    if b_t:
        qb, sb = (t.t() for t in ops.mx_quantize(w.t().contiguous(), 0))
    else:
        qb, sb = ops.mx_quantize(w, -1)
    del x, w
    with zrw.memory.window() as m:
        out = ops.mx_matmul(qa, sa, qb, sb, torch.bfloat16)
    print(m["peak"] - m["start"])
del qa, sa, qb, sb, out
qa, sa = ops.mx_quantize(torch.randn(4096, 4096, dtype=torch.bfloat16), -1)
qb, sb = ops.mx_quantize(torch.randn(1024, 4096, dtype=torch.bfloat16), -1)
with zrw.memory.window() as m:
    out = ops.mx_matmul(qa, sa, qb, sb, torch.bfloat16)
print(m["peak"] - m["start"])
"""


def test_matmul_memory_is_fp32_tiles_plus_the_result():
    # DESIGN §4: no fp32 copy of the weight-side operand, no fp32 (M, N) product, and (zrw's own
    # bound) no fp32 copy of a large activation either: what a call holds at its peak is one
    # activation tile of at most 16 MiB of fp32, one weight tile of 512 rows (~8 MiB of fp32 for
    # K = 4096), their fp32 product tile and the bf16 result. A full fp32 b would add 64 MiB.
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    M, K, N, tile = 1024, 4096, 4096, 512
    budget = M * K * 4 + tile * K * 4 + M * tile * 4 + M * N * 2
    peaks = list(map(int, out.stdout.split()))
    assert len(peaks) == 3
    for peak in peaks[:2]:
        assert peak <= budget + (1 << 20), (peak, budget)
        assert peak >= M * N * 2  # the result itself is counted: the allocator sees the call
    # An activation of 4096 x 4096: dequantized 1024 rows (16 MiB of fp32) at a time, not whole
    # (64 MiB); the (1024, 4096) weight in tiles of 512 rows.
    M, K, N = 4096, 4096, 1024
    budget = 1024 * K * 4 + 512 * K * 4 + 1024 * 512 * 4 + M * N * 2
    assert M * N * 2 <= peaks[2] <= budget + (1 << 20), (peaks[2], budget)
