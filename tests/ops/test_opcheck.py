"""torch.library.opcheck for every zrw op, and torch.compile(fullgraph=True) against eager.

opcheck (torch 2.13) compares tensors with tools that do not understand float8:
* test_schema's mutation check (SchemaCheckMode) calls ``torch.allclose(before, after,
  equal_nan=True)`` on every input, which raises NotImplementedError ("mul_cpu_reduced_float" not
  implemented for 'Float8_e4m3fn') as soon as an input is fp8 — mx_dequantize and mx_matmul;
* test_aot_dispatch_* compare eager and AOT outputs with ``torch.testing.assert_close``, which for
  float8 compares values with equal_nan=False: a 0xFF block (NaN scale byte, NaN elements) is never
  "close" to itself.
Neither is a fault of the ops. ``fp8_aware_comparisons`` (a fixture of tests/ops/conftest.py)
swaps both for FP8-aware versions for the duration of one opcheck call: float8 tensors (elements
and E8M0 scales) are compared as their uint8 bytes with torch.equal — stricter than allclose, and
exactly "was it mutated" / "same output" — and NaN in float outputs counts as equal to NaN. Every
other comparison goes to the original functions unchanged, so opcheck runs all of its default
tests.
"""

import math

import pytest
import torch

import zrw  # noqa: F401  (registers torch.ops.zrw.*)
from helpers.quant import bytes_if_fp8, is_fp8
from zrw import ops

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def _weights():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 70, generator=gen).to(torch.bfloat16)
    w_nan = w.clone()
    w_nan[3, 40] = math.nan  # a 0xFF block: NaN scale and NaN elements in the outputs
    return [
        ("bf16", w, E4M3, "floor"),
        ("bf16nan", w_nan, E5M2, "rceil"),
        ("fp32-3d", torch.randn(2, 33, 65, generator=gen), E5M2, "floor"),
        ("fp16-t", torch.randn(70, 40, generator=gen).to(torch.float16).t(), E4M3, "rceil"),
    ]


def _quantize_cases():
    cases = []
    for tag, w, elem_dtype, scale_mode in _weights():
        cases.append((f"{tag}-dim-1", "mx_quantize", (w, -1, elem_dtype, scale_mode)))
        cases.append((f"{tag}-dim0", "mx_quantize", (w, 0, elem_dtype, scale_mode)))
        cases.append((tag, "mx_quantize_dual", (w, elem_dtype, scale_mode)))
        cases.append((tag, "mx_quantize_block", (w, elem_dtype, scale_mode)))
    cases.append(("3d-dim1", "mx_quantize", (torch.randn(3, 4, 40), 1, E4M3, "floor")))
    cases.append(("empty", "mx_quantize", (torch.empty(0, 64), -1, E4M3, "floor")))
    return cases


def _dequantize_and_matmul_cases():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(24, 70, generator=gen).to(torch.bfloat16)
    x[2, 5] = math.nan
    w = torch.randn(40, 70, generator=gen).to(torch.bfloat16)
    xq, xs = ops.mx_quantize(x, -1)
    xq0, xs0 = ops.mx_quantize(x, 0, E5M2, "rceil")
    wq, ws = ops.mx_quantize(w, -1)
    _, _, w_bwd, w_bwd_scale = ops.mx_quantize_dual(w)
    dy, dy_scale = ops.mx_quantize(torch.randn(5, 40, generator=gen), -1)
    return [
        ("bf16", "mx_dequantize", (xq, xs, -1, torch.bfloat16)),
        ("dim0-e5m2", "mx_dequantize", (xq0, xs0, 0, torch.float32)),
        ("t-fp16", "mx_dequantize", (xq0.t(), xs0.t(), 1, torch.float16)),
        ("fp32", "mx_matmul", (xq, xs, wq, ws, torch.float32)),
        ("bf16", "mx_matmul", (xq, xs, wq, ws, torch.bfloat16)),
        # dgrad: dy (M, N=40) times W's backward plane as its .t() view (K=70, N=40)
        ("dgrad", "mx_matmul", (dy, dy_scale, w_bwd.t(), w_bwd_scale.t(), torch.float32)),
        ("t-t-e5m2", "mx_matmul", (xq0.t(), xs0.t(), xq0.t(), xs0.t(), torch.float32)),
    ]


CASES = _quantize_cases() + _dequantize_and_matmul_cases()


@pytest.mark.parametrize("case", CASES, ids=[f"{name}-{tag}" for tag, name, _ in CASES])
def test_opcheck(case, fp8_aware_comparisons):
    _, name, args = case
    op = getattr(torch.ops.zrw, name).default
    result = torch.library.opcheck(op, args)
    assert set(result.values()) == {"SUCCESS"}, result


def test_opcheck_without_fp8_workaround_fails_only_on_fp8_comparison():
    # Documents why the workaround exists: if torch learns to compare float8, this test fails and
    # the fixture in conftest.py can go.
    xq, xs = ops.mx_quantize(torch.randn(4, 64), -1)
    result = torch.library.opcheck(
        torch.ops.zrw.mx_dequantize.default, (xq, xs, -1, torch.float32), raise_exception=False
    )
    assert isinstance(result["test_schema"], NotImplementedError)
    assert "Float8" in str(result["test_schema"])
    # And a NaN block makes eager and AOT outputs "different" under plain assert_close.
    w = torch.ones(4, 64)
    w[0, 0] = math.nan
    result = torch.library.opcheck(
        torch.ops.zrw.mx_quantize.default, (w, -1, E4M3, "floor"), raise_exception=False
    )
    assert result["test_schema"] == "SUCCESS"
    assert isinstance(result["test_aot_dispatch_dynamic"], AssertionError)


# ------------------------------------------------------------------------------------------------
# torch.compile


def _quantize_roundtrip(x):
    data, scale = torch.ops.zrw.mx_quantize(x, -1, E4M3, "rceil")
    fwd, fwd_scale, bwd, bwd_scale = torch.ops.zrw.mx_quantize_dual(x, E5M2, "floor")
    restored = torch.ops.zrw.mx_dequantize(data, scale, -1, torch.float32)
    back = torch.ops.zrw.mx_dequantize(bwd, bwd_scale, -2, torch.bfloat16)
    product = torch.ops.zrw.mx_matmul(data, scale, fwd, fwd_scale, torch.float32)
    return data, scale, restored * 2, back, product


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    compiled = torch.compile(_quantize_roundtrip, backend="aot_eager", fullgraph=True)
    gen = torch.Generator().manual_seed(2)
    for shape in ((40, 70), (33, 64)):
        x = torch.randn(shape, generator=gen).to(torch.bfloat16)
        x[1, 1] = math.nan
        eager = _quantize_roundtrip(x)
        got = compiled(x)
        for g, e in zip(got, eager):
            assert g.dtype == e.dtype and g.shape == e.shape
            if g.dtype.is_floating_point and not is_fp8(g):
                assert torch.equal(g.isnan(), e.isnan())
                g, e = g.nan_to_num(0.0), e.nan_to_num(0.0)
            assert torch.equal(bytes_if_fp8(g), bytes_if_fp8(e))
