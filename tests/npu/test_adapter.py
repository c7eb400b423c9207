"""The NPU adapter, driven by the stand-in torch_npu operators, gives zrw's canonical results.

Every result is compared bit for bit with ``zrw.reference`` (the elements of 0xFF blocks aside,
which the spec leaves unspecified and the stand-ins, like torch_npu's golden, write as +0), for
both recipes (dual-axis ``mxfp8`` and ``mxfp8-32x32``), both scale rules (``scale_alg`` 0 and 1)
and both fp8 formats, under the pinned torch_npu 2.13.0's schemas and op-plugin 26.0.0's (the
``npu_ops`` fixture). test_real_torch_npu.py runs torch_npu 2.13.0's own meta functions on every
operator call these cases make (the case lists below are shared with it).

The adapter's kernels are reached through ``torch.ops.zrw_npu_test``: the same C++ functions that
zrw registers for PrivateUse1, registered for CPU in a mirror namespace (csrc/npu/npu_test_ops.cpp
says why) by the test library libzrw_npu_test_ops, which zrw does not ship (npu_test_ops.py loads
it; the ``adapter`` fixture). The last tests check that mirror against zrw's own registrations, and
that the mirror stays out of ``import zrw``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import npu_test_ops
import pytest
import torch

import zrw
from helpers.bitwise import assert_bitwise
from helpers.npu_cases import (
    BLOCK_SHAPES,
    DUAL_FLOAT32_SHAPE,
    DUAL_SHAPES,
    ELEMS,
    FLOAT32_SHORT_AXIS_CASES,
    FROM_MASTER_SHAPE,
    LAYOUTS,
    MATMUL_KS,
    MATMUL_MN,
    MODES,
    OTHER_DTYPE_SHAPE,
    PARAM_DTYPES,
    QUANTIZE_CASES,
    SINGLE_ROW_KS,
    SINGLE_ROW_MN,
    dtype_id,
    exact_values,
    master_weights,
    matmul_elems,
    operand,
    weights,
)
from helpers.npu_standins import torch_npu_loaded
from zrw import reference as ref

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu
U8 = torch.uint8
MX_OPS = (
    "mx_quantize",
    "mx_quantize_dual",
    "mx_quantize_block",
    "mx_quantize_from_master",
    "mx_quantize_dual_from_master",
    "mx_quantize_block_from_master",
    "mx_dequantize",
    "mx_matmul",
)


def nan_block_mask(scale, dim, length):
    """Elements of blocks whose scale byte is 0xFF (unspecified bytes, masked in comparisons)."""
    nan = scale.view(U8) == ref.E8M0_NAN_BYTE
    return nan.repeat_interleave(ref.BLOCK, dim).narrow(dim, 0, length)


def assert_same_mx(got, expected, dim, what=""):
    (data, scale), (ref_data, ref_scale) = got, expected
    assert data.dtype == ref_data.dtype and data.shape == ref_data.shape, what
    assert scale.dtype == E8M0 and scale.shape == ref_scale.shape, what
    assert scale.is_contiguous(), what
    assert torch.equal(scale.view(U8), ref_scale.view(U8)), f"{what}: scale bytes differ"
    keep = ~nan_block_mask(ref_scale, dim % data.dim(), data.shape[dim])
    assert torch.equal(data.view(U8)[keep], ref_data.view(U8)[keep]), f"{what}: data bytes differ"


# ------------------------------------------------------------------------------------------------
# one-axis quantization: npu_dynamic_mx_quant


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("elem", ELEMS, ids=dtype_id)
@pytest.mark.parametrize("case", QUANTIZE_CASES, ids=lambda c: f"{c[0]}-dim{c[1]}")
def test_mx_quantize(npu_ops, adapter, case, elem, mode):
    shape, dim = case
    x = weights(shape, seed=len(shape) + dim)
    got = adapter.mx_quantize(x, dim, elem, mode)
    assert_same_mx(got, ref.mx_quantize(x, dim, elem, mode), dim, f"{shape} dim {dim}")
    call = npu_ops.last("npu_dynamic_mx_quant")
    assert call["scale_alg"] == {"floor": 0, "rceil": 1}[mode]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=dtype_id)
def test_mx_quantize_other_input_dtypes(npu_pinned, adapter, dtype):
    x = weights(OTHER_DTYPE_SHAPE, dtype)
    for dim in (-1, 0):
        got = adapter.mx_quantize(x, dim, E4M3, "floor")
        assert_same_mx(got, ref.mx_quantize(x, dim, E4M3, "floor"), dim)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", FLOAT32_SHORT_AXIS_CASES, ids=lambda c: f"{c[0]}-dim{c[1]}")
def test_mx_quantize_float32_short_axis(npu_pinned, adapter, case, mode):
    shape, dim = case
    x = weights(shape, torch.float32, specials=False)
    x.view(-1)[1] = float("nan")
    data, scale = adapter.mx_quantize(x, dim, E4M3, mode)
    assert data.is_contiguous()
    assert_same_mx((data, scale), ref.mx_quantize(x, dim, E4M3, mode), dim, f"{shape} dim {dim}")
    # the operator got one full block along the axis: (outer, 32) or (outer, 32, inner)
    assert npu_pinned.last("npu_dynamic_mx_quant")["shape"][1] == 32


def test_mx_quantize_dual_float32_short_axes(npu_pinned, adapter):
    w = weights((7, 20), torch.float32, specials=False)
    got = adapter.mx_quantize_dual(w, E5M2, "rceil")
    rf = ref.mx_quantize_dual(w, E5M2, "rceil")
    assert_same_mx(got[0:2], rf[0:2], -1)
    assert_same_mx(got[2:4], rf[2:4], -2)


def test_mx_quantize_non_contiguous_input(npu_pinned, adapter):
    x = weights((96, 70)).t()  # (70, 96) view
    expected = ref.mx_quantize(x, 1, E4M3, "floor")
    assert_same_mx(adapter.mx_quantize(x, 1, E4M3, "floor"), expected, 1)


def test_mx_quantize_empty(npu_pinned, adapter):
    data, scale = adapter.mx_quantize(torch.empty(0, 64, dtype=torch.bfloat16), -1, E4M3, "floor")
    assert data.shape == (0, 64) and scale.shape == (0, 2) and scale.dtype == E8M0
    assert not npu_pinned.calls  # nothing to hand to the operator


# ------------------------------------------------------------------------------------------------
# dual-axis (mxfp8): npu_dynamic_mx_quant_with_dual_axis


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("elem", ELEMS, ids=dtype_id)
@pytest.mark.parametrize("shape", DUAL_SHAPES, ids=str)
def test_mx_quantize_dual(npu_ops, adapter, shape, elem, mode):
    w = weights(shape, seed=shape[-1])
    data_fwd, scale_fwd, data_bwd, scale_bwd = adapter.mx_quantize_dual(w, elem, mode)
    rf = ref.mx_quantize_dual(w, elem, mode)
    assert_same_mx((data_fwd, scale_fwd), rf[0:2], -1, "fwd")
    assert_same_mx((data_bwd, scale_bwd), rf[2:4], -2, "bwd")
    call = npu_ops.last("npu_dynamic_mx_quant_with_dual_axis")
    assert call["scale_alg"] == {"floor": 0, "rceil": 1}[mode]


def test_mx_quantize_dual_float32_takes_two_one_axis_calls(npu_pinned, adapter):
    # The dual-axis operator takes fp16/bf16 only; fp32 goes through the one-axis operator twice.
    w = weights(DUAL_FLOAT32_SHAPE, torch.float32)
    got = adapter.mx_quantize_dual(w, E4M3, "rceil")
    rf = ref.mx_quantize_dual(w, E4M3, "rceil")
    assert_same_mx(got[0:2], rf[0:2], -1)
    assert_same_mx(got[2:4], rf[2:4], -2)
    assert [op for op, _ in npu_pinned.calls] == ["npu_dynamic_mx_quant"] * 2


# ------------------------------------------------------------------------------------------------
# 32x32 blocks (mxfp8-32x32): npu_dynamic_block_mx_quant


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("elem", ELEMS, ids=dtype_id)
@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=str)
def test_mx_quantize_block(npu_ops, adapter, shape, elem, mode):
    w = weights(shape, seed=shape[0])
    data, block = adapter.mx_quantize_block(w, elem, mode)
    ref_data, ref_block = ref.mx_quantize_block(w, elem, mode)
    assert block.dtype == E8M0 and block.shape == ref_block.shape and block.is_contiguous()
    assert torch.equal(block.view(U8), ref_block.view(U8))
    row_scale = ref.expand_block_scale(ref_block, w.shape, -1)
    assert_same_mx((data, ref.expand_block_scale(block, w.shape, -1)), (ref_data, row_scale), -1)
    assert npu_ops.last("npu_dynamic_block_mx_quant")["scale_alg"] == {"floor": 0, "rceil": 1}[mode]


def test_mx_quantize_block_refuses_float32(npu_pinned, adapter):
    with pytest.raises(TypeError, match="npu_dynamic_block_mx_quant takes no float32"):
        adapter.mx_quantize_block(weights((64, 64), torch.float32), E4M3, "floor")


# ------------------------------------------------------------------------------------------------
# from an FP32 master: cast to param_dtype (one aten kernel), then the bf16/fp16 operators above
# (torch_npu has no MX quantization that rounds fp32 on the way; docs/npu.md §4)


@pytest.mark.parametrize("param_dtype", PARAM_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("elem", ELEMS, ids=dtype_id)
def test_from_master_is_cast_then_quantize(npu_ops, adapter, elem, mode, param_dtype):
    master = master_weights(FROM_MASTER_SHAPE, seed=7)
    param = master.to(param_dtype)
    for dim in (-1, 0):
        got = adapter.mx_quantize_from_master(master, dim, param_dtype, elem, mode)
        assert_same_mx(got, ref.mx_quantize(param, dim, elem, mode), dim, f"dim {dim}")
    got = adapter.mx_quantize_dual_from_master(master, param_dtype, elem, mode)
    rf = ref.mx_quantize_dual(param, elem, mode)
    assert_same_mx(got[0:2], rf[0:2], -1, "dual fwd")
    assert_same_mx(got[2:4], rf[2:4], -2, "dual bwd")
    data, block = adapter.mx_quantize_block_from_master(master, param_dtype, elem, mode)
    ref_data, ref_block = ref.mx_quantize_block(param, elem, mode)
    assert torch.equal(block.view(U8), ref_block.view(U8))
    row_scale = ref.expand_block_scale(ref_block, master.shape, -1)
    assert_same_mx((data, row_scale), (ref_data, row_scale), -1, "block")
    # Every operator got the parameter (cast by aten), none the fp32 master: the fp32 dual-axis
    # fallback (two one-axis calls) and the block operator's fp32 refusal never apply.
    assert [c.op for c in npu_ops.records] == ["npu_dynamic_mx_quant"] * 2 + [
        "npu_dynamic_mx_quant_with_dual_axis",
        "npu_dynamic_block_mx_quant",
    ]
    assert all(c.args[0].dtype == param_dtype for c in npu_ops.records)


def test_from_master_argument_errors_name_the_argument(npu_pinned, adapter):
    master = master_weights((4, 64))
    with pytest.raises(
        TypeError,
        match=r"zrw\.mx_quantize_from_master: master must be "
        r"torch\.float32 \(the FP32 master weight\), got BFloat16",
    ):
        adapter.mx_quantize_from_master(master.bfloat16(), -1, torch.bfloat16, E4M3, "floor")
    with pytest.raises(
        TypeError,
        match=r"zrw\.mx_quantize_dual_from_master: param_dtype must be "
        r"torch\.bfloat16 or torch\.float16, got Float",
    ):
        adapter.mx_quantize_dual_from_master(master, torch.float32, E4M3, "floor")
    with pytest.raises(
        ValueError,
        match=r"zrw\.mx_quantize_block_from_master: master must be "
        r"2-d \(N, K\) or 3-d",
    ):
        adapter.mx_quantize_block_from_master(master[0], torch.bfloat16, E4M3, "floor")
    with pytest.raises(IndexError, match=r"zrw\.mx_quantize_from_master: dim must be in"):
        adapter.mx_quantize_from_master(master, 2, torch.float16, E4M3, "floor")
    assert not npu_pinned.calls  # refused before reaching torch_npu


# ------------------------------------------------------------------------------------------------
# dequantization: ATen ops, no torch_npu operator


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("elem", ELEMS, ids=dtype_id)
@pytest.mark.parametrize(
    "case", [((5, 70), -1), ((96, 6), 0), ((3, 40, 33), 1)], ids=lambda c: f"{c[0]}-dim{c[1]}"
)
def test_mx_dequantize(adapter, case, elem, out_dtype):
    shape, dim = case
    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, shape, generator=gen, dtype=U8).view(elem)  # NaN codes too
    scale_shape = list(shape)
    scale_shape[dim] = -(-shape[dim] // 32)
    scale = torch.randint(0, 256, scale_shape, generator=gen, dtype=U8)
    scale.view(-1)[:3] = torch.tensor([0x00, 0xFF, 0xFE], dtype=U8)  # 2^-127, NaN, 2^127
    scale = scale.view(E8M0)
    got = adapter.mx_dequantize(data, scale, dim, out_dtype)
    assert_bitwise(got, ref.mx_dequantize(data, scale, dim, out_dtype), nan_equal=True)


# ------------------------------------------------------------------------------------------------
# mx_matmul: npu_quant_matmul in MX mode


@pytest.mark.parametrize("k", MATMUL_KS)
@pytest.mark.parametrize("b_layout", LAYOUTS)
@pytest.mark.parametrize("a_layout", LAYOUTS)
def test_mx_matmul(npu_ops, adapter, a_layout, b_layout, k):
    m, n = MATMUL_MN
    a_elem, b_elem = matmul_elems(k)
    a, a_scale = operand(exact_values(m, k, seed=k), a_layout, a_elem)
    b, b_scale = operand(exact_values(n, k, seed=k + 1), b_layout, b_elem)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = adapter.mx_matmul(a, a_scale, b, b_scale, out_dtype)
        assert_bitwise(
            got, ref.mx_matmul(a, a_scale, b, b_scale, out_dtype), str(out_dtype), nan_equal=True
        )

    call = npu_ops.last("npu_quant_matmul")
    k_padded = -(-k // 64) * 64
    assert call["x1_shape"] == (m, k_padded) and call["x2_shape"] == (k_padded, n)
    # x1 = a keeps a's transpose attribute; x2 = b.t() has the opposite of b's (a copied
    # row_step operand is row-major)
    assert call["x1_transposed"] == (a_layout == "t")
    assert call["x2_transposed"] == (b_layout != "t")
    if k % 64 == 0:  # no padding: the rows and .t() operands reach the operator uncopied
        assert (call["x1_ptr"] == a.data_ptr()) == (a_layout != "row_step")
        assert (call["x2_ptr"] == b.data_ptr()) == (b_layout != "row_step")
    assert call["scale_dtype"] == call["pertoken_scale_dtype"] == 293
    assert list(call["group_sizes"]) == [1, 1, 32]
    assert call["output_dtype"] == 15  # the last out_dtype, bfloat16


@pytest.mark.parametrize("k", SINGLE_ROW_KS)
@pytest.mark.parametrize("mn", SINGLE_ROW_MN, ids=str)
@pytest.mark.parametrize("b_layout", ["rows", "t"])
@pytest.mark.parametrize("a_layout", ["rows", "t"])
def test_mx_matmul_single_rows(npu_pinned, adapter, a_layout, b_layout, mn, k):
    # A size-1 dim leaves contiguity ambiguous (a (1, K) view may carry any stride on dim 0),
    # while op-plugin reads the transpose attribute from raw strides: the adapter must still
    # pass data and scale with the same attribute.
    m, n = mn
    a, a_scale = operand(exact_values(m, k, seed=m), a_layout, E4M3)
    b, b_scale = operand(exact_values(n, k, seed=n + 7), b_layout, E4M3)
    got = adapter.mx_matmul(a, a_scale, b, b_scale, torch.float32)
    assert_bitwise(got, ref.mx_matmul(a, a_scale, b, b_scale, torch.float32), nan_equal=True)


def test_mx_matmul_randn_and_nan_blocks(npu_pinned, adapter):
    # General values: equal to the reference within fp32 accumulation order; a NaN/Inf block
    # (scale 0xFF) makes its row NaN and nothing else, padded blocks included.
    x = weights((8, 96), seed=3, specials=False)
    x[2, 40] = float("inf")
    a, a_scale = ref.mx_quantize(x, -1, E4M3, "floor")
    b, b_scale = ref.mx_quantize(weights((5, 96), seed=4, specials=False), -1, E4M3, "floor")
    got = adapter.mx_matmul(a, a_scale, b, b_scale, torch.float32)
    expected = ref.mx_matmul(a, a_scale, b, b_scale, torch.float32)
    assert bool(torch.isnan(got[2]).all()) and not bool(torch.isnan(got[[0, 1, 3]]).any())
    atol = 1e-5 * expected.abs().nan_to_num(0.0).max().item()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=atol, equal_nan=True)


def test_mx_matmul_empty(npu_pinned, adapter):
    a, a_scale = ref.mx_quantize(torch.ones(3, 0, dtype=torch.bfloat16), -1, E4M3, "floor")
    b, b_scale = ref.mx_quantize(torch.ones(4, 0, dtype=torch.bfloat16), -1, E4M3, "floor")
    got = adapter.mx_matmul(a, a_scale, b, b_scale, torch.bfloat16)
    assert got.shape == (3, 4) and bool((got == 0).all())


def test_argument_errors_name_the_argument(npu_pinned, adapter):
    x = weights((4, 64))
    with pytest.raises(TypeError, match="elem_dtype must be"):
        adapter.mx_quantize(x, -1, torch.float16, "floor")
    with pytest.raises(ValueError, match="scale_mode must be"):
        adapter.mx_quantize(x, -1, E4M3, "ceil")
    with pytest.raises(IndexError, match="dim must be in"):
        adapter.mx_quantize(x, 2, E4M3, "floor")
    with pytest.raises(ValueError, match="w must be 2-d"):
        adapter.mx_quantize_dual(weights((64,)), E4M3, "floor")
    a, a_scale = ref.mx_quantize(x, -1, E4M3, "floor")
    with pytest.raises(ValueError, match="b_scale must have shape"):
        adapter.mx_matmul(a, a_scale, a, a_scale[:, :1], torch.float32)
    with pytest.raises(ValueError, match="scale must have shape"):
        adapter.mx_dequantize(a, a_scale[:, :1], -1, torch.float32)
    assert not npu_pinned.calls  # refused before reaching torch_npu


# ------------------------------------------------------------------------------------------------
# the mirror namespace is zrw's PrivateUse1 registration


def test_zrw_ops_have_npu_kernels():
    for op in MX_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"zrw::{op}", "PrivateUse1"), op


def test_mirror_schemas_are_zrw_schemas(adapter):
    for op in MX_OPS:
        mirror = str(torch._C._get_schema(f"zrw_npu_test::{op}", ""))
        zrw_schema = str(torch._C._get_schema(f"zrw::{op}", ""))
        assert mirror.replace("zrw_npu_test::", "zrw::") == zrw_schema


@pytest.mark.skipif(torch_npu_loaded(), reason="expects the npu:: operators to be missing")
@pytest.mark.parametrize("op", [op for op in MX_OPS if op != "mx_dequantize"])
def test_the_npu_key_reaches_the_adapter(op):
    # With PrivateUse1 added to the thread's dispatch keys, CPU tensors dispatch to zrw's NPU
    # kernels; without torch_npu they stop at the operator lookup, which comes before any aten op
    # (which would find no PrivateUse1 kernel either), with the adapter's own message.
    x = weights((64, 64), specials=False)
    args = {
        "mx_quantize": (x, -1, E4M3, "floor"),
        "mx_quantize_dual": (x, E4M3, "floor"),
        "mx_quantize_block": (x, E4M3, "floor"),
        # the operator is looked up before the master is cast (an aten op, which would find no
        # PrivateUse1 kernel here)
        "mx_quantize_from_master": (x.float(), -1, torch.bfloat16, E4M3, "floor"),
        "mx_quantize_dual_from_master": (x.float(), torch.bfloat16, E4M3, "floor"),
        "mx_quantize_block_from_master": (x.float(), torch.float16, E4M3, "floor"),
        "mx_matmul": (
            *ref.mx_quantize(x, -1, E4M3, "floor"),
            *ref.mx_quantize(x, -1, E4M3, "floor"),
            torch.float32,
        ),
    }[op]
    with torch._C._IncludeDispatchKeyGuard(torch._C.DispatchKey.PrivateUse1):
        with pytest.raises(
            RuntimeError,
            match=r"calls torch_npu's operator npu::npu_\w+, which is "
            r"not registered.*torch_npu 2\.13\.0",
        ):
            getattr(torch.ops.zrw, op)(*args)


# ------------------------------------------------------------------------------------------------
# the mirror lives in the test library only

# Run in a fresh process: what `import zrw` registers, then what loading the test library changes.
REGISTRATIONS = """
import json, sys
import torch, zrw

def registered():
    names = torch._C._dispatch_get_all_op_names()
    return {n: torch._C._dispatch_dump(n) for n in names
            if n.split("::")[0] in ("zrw", "zrw_npu_test")}

before = registered()
torch.ops.load_library(sys.argv[1])
after = registered()
print(json.dumps({"zrw": zrw.__file__, "before": before, "after": after}))
"""


@pytest.fixture(scope="module")
def registrations(tmp_path_factory):
    assert npu_test_ops.LIBRARY.exists(), "the test library is not built (npu_test_ops.py)"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(zrw.__file__).parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }
    r = subprocess.run(
        [sys.executable, "-c", REGISTRATIONS, str(npu_test_ops.LIBRARY)],
        cwd=tmp_path_factory.mktemp("fresh"),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["zrw"] == zrw.__file__  # the zrw under test, not another install
    return out


def test_import_zrw_registers_no_test_ops(registrations):
    before = registrations["before"]
    assert {f"zrw::{op}" for op in MX_OPS} <= set(before)
    assert not [name for name in before if name.startswith("zrw_npu_test::")]


def test_the_test_library_adds_the_mirror_and_nothing_else(registrations):
    before, after = registrations["before"], registrations["after"]
    mirror = {name for name in after if name.startswith("zrw_npu_test::")}
    assert {f"zrw_npu_test::{op}" for op in MX_OPS} <= mirror
    # zrw's kernels are registered once, by zrw._C: the library registers none again (a second
    # PrivateUse1 kernel would show in the dump, the first one as "inactive").
    assert {name: after[name] for name in before} == before
    assert set(after) == set(before) | mirror
