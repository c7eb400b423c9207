"""The adapter reads torch_npu's schemas at run time: arguments by name, defaults filled in.

Against the schema strings of the pinned torch_npu 2.13.0 (from its wheel) and of op-plugin 26.0.0
(from op-plugin's tags, docs/npu.md §5.2; the ``npu_ops`` fixture), a synthetic
future one (arguments reordered, new defaulted ones), the 7.x releases (no MX operators) and broken
variants: a missing operator, a missing or retyped argument, or an operator that ignores
``dst_type`` each give an error naming the operator, the argument and the torch_npu needed.
"""

import pytest
import torch

from helpers.npu_standins import (
    FP4_CODE,
    PINNED,
    SCHEMAS,
    StandInError,
    StandIns,
    golden_pair,
    ignores_dst_type,
)
from zrw import reference as ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def bf16(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


def schema_of(name):
    return str(torch._C._get_schema(f"npu::{name}", ""))


def run_all_ops(adapter, elem=E4M3, mode="floor"):
    """One call of every adapter op that reaches torch_npu; the results against the reference."""
    w = bf16(64, 96)
    got = adapter.mx_quantize(w, -1, elem, mode)
    assert torch.equal(
        got[1].view(torch.uint8), ref.mx_quantize(w, -1, elem, mode)[1].view(torch.uint8)
    )
    adapter.mx_quantize(w, 0, elem, mode)
    dual = adapter.mx_quantize_dual(w, elem, mode)
    assert torch.equal(
        dual[0].view(torch.uint8), ref.mx_quantize_dual(w, elem, mode)[0].view(torch.uint8)
    )
    block = adapter.mx_quantize_block(w, elem, mode)
    assert torch.equal(
        block[1].view(torch.uint8), ref.mx_quantize_block(w, elem, mode)[1].view(torch.uint8)
    )
    a, a_scale = ref.mx_quantize(w, -1, elem, mode)
    out = adapter.mx_matmul(a, a_scale, a, a_scale, torch.bfloat16)
    torch.testing.assert_close(out, ref.mx_matmul(a, a_scale, a, a_scale, torch.bfloat16))


def test_the_fixtures_register_the_documented_schemas(npu_ops):
    mx_quant = schema_of("npu_dynamic_mx_quant")
    dual = schema_of("npu_dynamic_mx_quant_with_dual_axis")
    if npu_ops.variant == "26.0.0":
        assert "max_low_bound" not in mx_quant and "dst_type_max" not in dual
    else:
        assert "max_low_bound" in mx_quant and "dst_type_max" in dual
    assert "dst_type=296" in mx_quant  # FP4 by default: the adapter must pass its own


@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("elem", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_arguments_passed_by_name(npu_ops, adapter, elem, mode):
    run_all_ops(adapter, elem, mode)
    code = {E4M3: 24, E5M2: 23}[elem]
    alg = {"floor": 0, "rceil": 1}[mode]
    quant = [args for op, args in npu_ops.calls if op == "npu_dynamic_mx_quant"]
    assert [c["axis"] for c in quant] == [-1, -2]  # (outer, D) along -1, (outer, D, inner) along -2
    assert [c["shape"] for c in quant] == [(64, 96), (1, 64, 96)]
    for op in (
        "npu_dynamic_mx_quant",
        "npu_dynamic_mx_quant_with_dual_axis",
        "npu_dynamic_block_mx_quant",
    ):
        call = npu_ops.last(op)
        assert call["dst_type"] == code != FP4_CODE, op
        assert call["scale_alg"] == alg, op
        assert call["round_mode"] == "rint", op
    assert npu_ops.last("npu_dynamic_mx_quant")["block_size"] == 32
    mm = npu_ops.last("npu_quant_matmul")
    assert mm["output_dtype"] == 15  # bfloat16's ScalarType code
    assert mm["scale_dtype"] == mm["pertoken_scale_dtype"] == 293  # torch_npu.float8_e8m0fnu
    assert list(mm["group_sizes"]) == [1, 1, 32]


def test_reordered_schema_with_new_arguments(adapter):
    # A future release that reorders the keyword arguments and adds defaulted ones: the adapter
    # maps by name and leaves the new ones at their defaults.
    schemas = dict(SCHEMAS[PINNED])
    schemas["npu_dynamic_mx_quant"] = (
        "npu_dynamic_mx_quant(Tensor input, *, int? scale_alg=0, int dst_type=296, "
        'float max_low_bound=0.0, int block_size=32, str round_mode="rint", int axis=-1, '
        "bool future_flag=False) -> (Tensor, Tensor)"
    )
    schemas["npu_quant_matmul"] = (
        "npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, int[]? group_sizes=None, "
        "int? scale_dtype=None, int? pertoken_scale_dtype=None, Tensor? pertoken_scale=None, "
        "int? output_dtype=None, Tensor? bias=None, Tensor? offset=None, int? x1_dtype=None, "
        "int? x2_dtype=None, Tensor? y_scale=None, int? new_mode=None) -> Tensor"
    )
    with StandIns(schemas) as ops:
        run_all_ops(adapter, E5M2, "rceil")
        assert ops.last("npu_dynamic_mx_quant")["dst_type"] == 23


def test_torch_npu_7x_has_no_mx_operators(adapter):
    w = bf16(64, 64)
    a, a_scale = ref.mx_quantize(w, -1, E4M3, "floor")
    with StandIns(SCHEMAS["7.x"]):
        for call, name in (
            (lambda: adapter.mx_quantize(w, -1, E4M3, "floor"), "npu_dynamic_mx_quant"),
            (
                lambda: adapter.mx_quantize_dual(w, E4M3, "floor"),
                "npu_dynamic_mx_quant_with_dual_axis",
            ),
            (lambda: adapter.mx_quantize_block(w, E4M3, "floor"), "npu_dynamic_block_mx_quant"),
        ):
            with pytest.raises(
                RuntimeError,
                match=rf"npu::{name}, which is not registered"
                r".*torch_npu 2\.13\.0 \(the release for "
                r"torch 2\.13",
            ):
                call()
        # 7.x's npu_quant_matmul exists, without MX mode's arguments
        with pytest.raises(
            RuntimeError,
            match=r"npu::npu_quant_matmul has no argument "
            r"'scale_dtype'.*installed schema"
            r".*torch_npu 2\.13\.0",
        ):
            adapter.mx_matmul(a, a_scale, a, a_scale, torch.float32)


def test_missing_scale_alg_is_fine_for_floor_only(adapter):
    # An operator without scale_alg quantizes with its documented default, floor (scale_alg=0).
    schemas = {
        "npu_dynamic_mx_quant": (
            'npu_dynamic_mx_quant(Tensor input, *, int axis=-1, str round_mode="rint", '
            "int dst_type=296, int block_size=32) -> (Tensor, Tensor)"
        )
    }
    w = bf16(8, 64)
    with StandIns(schemas):
        data, scale = adapter.mx_quantize(w, -1, E4M3, "floor")
        assert torch.equal(
            scale.view(torch.uint8), ref.mx_quantize(w, -1, E4M3, "floor")[1].view(torch.uint8)
        )
        with pytest.raises(
            RuntimeError, match="has no argument 'scale_alg', which the requested behaviour needs"
        ):
            adapter.mx_quantize(w, -1, E4M3, "rceil")


def assert_quantize_refused(adapter, schema, match):
    """mx_quantize against an npu_dynamic_mx_quant of `schema` raises a RuntimeError matching
    `match`."""
    with StandIns({"npu_dynamic_mx_quant": schema}):
        with pytest.raises(RuntimeError, match=match):
            adapter.mx_quantize(bf16(8, 64), -1, E4M3, "floor")


def test_unknown_required_argument(adapter):
    schema = (
        "npu_dynamic_mx_quant(Tensor input, int group, *, int axis=-1, int dst_type=296, "
        "int? scale_alg=0) -> (Tensor, Tensor)"
    )
    assert_quantize_refused(
        adapter, schema, "has a required argument 'group' that zrw does not know"
    )


def test_argument_of_another_type(adapter):
    schema = (
        'npu_dynamic_mx_quant(Tensor input, *, int axis=-1, str dst_type="fp8", '
        "int? scale_alg=0) -> (Tensor, Tensor)"
    )
    assert_quantize_refused(adapter, schema, "takes argument 'dst_type' as str, but zrw passes int")


def test_operator_that_ignores_dst_type(adapter):
    # What FP4 output looks like (uint8, two elements per byte): caught, not passed on.
    with StandIns(SCHEMAS[PINNED], overrides={"npu_dynamic_mx_quant": ignores_dst_type}):
        with pytest.raises(
            RuntimeError,
            match=r"npu::npu_dynamic_mx_quant returned data of dtype "
            r"Byte and shape \[8, 32\], expected "
            r"Float8_e4m3fn and \[8, 64\]",
        ):
            adapter.mx_quantize(bf16(8, 64), -1, E4M3, "floor")


# ------------------------------------------------------------------------------------------------
# the stand-ins enforce the documented constraints, so the adapter's handling is really exercised


def test_stand_in_refuses_the_fp4_default(npu_pinned):
    with pytest.raises(StandInError, match="296"):
        torch.ops.npu.npu_dynamic_mx_quant(bf16(8, 64))


def mx_quant_matmul(x1, x2, scale, pertoken_scale):
    """npu::npu_quant_matmul in MX mode (FP8 e8m0 scales of 32-element groups), BF16 output."""
    return torch.ops.npu.npu_quant_matmul(
        x1,
        x2,
        scale,
        pertoken_scale=pertoken_scale,
        output_dtype=6,
        scale_dtype=293,
        pertoken_scale_dtype=293,
        group_sizes=[1, 1, 32],
    )


def test_stand_in_refuses_k_not_divisible_by_64(npu_pinned):
    a, a_scale = ref.mx_quantize(bf16(4, 96), -1, E4M3, "floor")
    pairs = golden_pair(a_scale, -1)  # (4, 2, 2)
    with pytest.raises(StandInError, match="K divisible by 64, got K=96"):
        mx_quant_matmul(a, a.t(), pairs.transpose(0, 1), pairs)


def test_stand_in_refuses_mismatched_transpose(npu_pinned):
    a, a_scale = ref.mx_quantize(bf16(4, 128), -1, E4M3, "floor")
    pairs = golden_pair(a_scale, -1)  # (4, 2, 2)
    with pytest.raises(StandInError, match="x2 tensor and scale tensor's transpose are not same"):
        # x2 = a.t() is transposed, its scale a contiguous copy of the transposed pairs
        mx_quant_matmul(a, a.t(), pairs.transpose(0, 1).contiguous(), pairs)
