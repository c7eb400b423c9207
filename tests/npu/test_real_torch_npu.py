"""zrw's NPU adapter and the stand-in operators, checked against the real torch_npu 2.13.0.

torch_npu 2.13.0 is the release for torch 2.13 (the only torch zrw builds against). Its wheel is
obtained as a user's machine would obtain it, ``pip download --no-deps torch-npu==2.13.0``, into
a cache directory (torch_npu_wheel.py; ``.ci/run`` prepares it), and read as files: it cannot be
imported without CANN. Every test here skips, saying why, only when the wheel is not cached and
pip cannot reach the package index.

What is checked, against the wheel's own files:
- the schema of every ``npu::`` operator the adapter calls and the stand-ins register is, after
  torch's schema parser, the one in ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``
  (argument names, types, defaults, keyword-only markers, returns);
- the meta functions of ``torch_npu/op_plugin/meta/_meta_registrations.py``, run on meta tensors
  with exactly the arguments the adapter passed in every case of the adapter tests (the stand-ins
  record them), give the output dtypes and shapes the stand-ins gave;
- the operators zrw reports (``zrw.backends()``) and calls are ones torch_npu registers, and the
  dtype codes the adapter passes mean in torch_npu what the adapter means;
- the pairing that docs/npu.md and the README pin.
"""

import itertools
import re
from pathlib import Path

import pytest
import torch

import zrw
from helpers import npu_cases as cases
from helpers import torch_npu_wheel
from helpers.npu_standins import (
    E8M0_CODE,
    FP4_CODE,
    FP8_BY_CODE,
    OUT_DTYPE_BY_CODE,
    PINNED,
    SCHEMAS,
    StandInError,
    StandIns,
    as_meta,
    ignores_dst_type,
    signature,
)
from helpers.torch_npu_wheel import META_FILE, SCHEMA_FILE, VERSION
from zrw import reference as ref
from zrw.backends import NPU_OPERATORS

ROOT = Path(__file__).resolve().parents[2]
ASCEND_RELEASE = "26.2.0"  # Ascend Extension for PyTorch: the wheel's source branch v2.13.0-26.2.0
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture(scope="module")
def wheel():
    try:
        path = torch_npu_wheel.obtain()
    except torch_npu_wheel.RegistryUnreachable as e:
        pytest.skip(
            f"torch_npu {VERSION}'s wheel is not in the cache "
            f"{torch_npu_wheel.cache_dir()} and the package index cannot be reached "
            f"({str(e).splitlines()[0]}); the checks against the real torch_npu did "
            "not run"
        )
    return torch_npu_wheel.Wheel(path)


@pytest.fixture(scope="module")
def meta(wheel):
    return wheel.meta()


def test_the_pinned_pairing(wheel):
    assert VERSION == PINNED == "2.13.0"
    assert wheel.metadata_field("Version") == [VERSION]
    assert wheel.path.name.startswith(f"torch_npu-{VERSION}-")
    # torch_npu 2.13.0 needs torch 2.13.0, the torch zrw builds against
    assert "torch==2.13.0.*" in wheel.metadata_field("Requires-Dist")
    assert re.match(r"2\.13\.0($|\+)", torch.__version__), torch.__version__
    assert wheel.source_branch() == f"v{VERSION}-{ASCEND_RELEASE}"
    docs = (ROOT / "docs" / "npu.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for text in (docs, readme):
        assert f"torch_npu {VERSION}" in text and ASCEND_RELEASE in text
    for name in (SCHEMA_FILE, META_FILE, f"torch_npu-{VERSION}-"):
        assert name in docs
    # zrw's errors name the release they need
    header = (ROOT / "csrc" / "npu" / "npu_operator.h").read_text()
    needed = re.search(r"kTorchNpuNeeded =\s*((?:\"[^\"]*\"\s*)+);", header).group(1)
    assert f"torch_npu {VERSION}" in needed and ASCEND_RELEASE in needed


# ------------------------------------------------------------------------------------------------
# operators and schemas


def describe(schema):
    """What the adapter depends on in a schema, field by field (for a readable difference)."""
    return {
        "name": schema.name,
        "arguments": [
            (a.name, str(a.type), repr(a.default_value), a.kwarg_only) for a in schema.arguments
        ],
        "returns": [str(r.type) for r in schema.returns],
    }


@pytest.mark.parametrize("name", sorted(SCHEMAS[PINNED]))
def test_stand_in_schema_is_the_real_one(wheel, name):
    real = wheel.custom_schemas()
    assert name in real, f"torch_npu {VERSION} has no npu::{name}"
    ours = describe(torch._C.parse_schema(SCHEMAS[PINNED][name]))
    theirs = describe(torch._C.parse_schema(real[name]))
    differ = [
        (o, t) for o, t in itertools.zip_longest(ours["arguments"], theirs["arguments"]) if o != t
    ]
    assert not differ, (
        f"npu::{name}: arguments (name, type, default, keyword-only) of the "
        f"stand-in vs torch_npu {VERSION}: {differ}"
    )
    assert ours == theirs
    assert str(torch._C.parse_schema(SCHEMAS[PINNED][name])) == str(
        torch._C.parse_schema(real[name])
    )


def test_the_adapter_calls_operators_torch_npu_registers(wheel, meta):
    real = wheel.custom_schemas()
    # the adapter's operators (test_backends.py checks these are the ones mx_npu.cpp calls) are
    # the stand-ins', and torch_npu declares each and registers a meta function for it in npu::
    assert set(NPU_OPERATORS) == set(SCHEMAS[PINNED])
    for name in NPU_OPERATORS:
        assert name in real, f"torch_npu {VERSION} declares no npu::{name}"
        assert ("npu", name) in meta.functions, f"no meta function for npu::{name}"
    assert set(zrw.backends()["npu"]["operators"]) == set(NPU_OPERATORS)


def test_dtype_codes(wheel, meta):
    codes = wheel.npu_dtype_codes()
    source = (ROOT / "csrc" / "npu" / "mx_npu.cpp").read_text()
    # npu_quant_matmul's scale_dtype / pertoken_scale_dtype: torch_npu.float8_e8m0fnu
    assert codes["float8_e8m0fnu"] == E8M0_CODE
    assert int(re.search(r"kNpuFloat8E8M0 = (\d+);", source).group(1)) == E8M0_CODE
    assert meta.TORCH_NPU_DTYPE_TO_STRING_MAP[E8M0_CODE] == "torch_npu.float8_e8m0fnu"
    # every quantization operator's default dst_type is FP4
    assert codes["float4_e2m1fn_x2"] == FP4_CODE
    for name in (
        "npu_dynamic_mx_quant",
        "npu_dynamic_mx_quant_with_dual_axis",
        "npu_dynamic_block_mx_quant",
    ):
        schema = torch._C.parse_schema(wheel.custom_schemas()[name])
        assert [a.default_value for a in schema.arguments if a.name == "dst_type"] == [FP4_CODE]
    # the fp8 codes the stand-ins take: torch's (the adapter passes these) and torch_npu's own
    assert FP8_BY_CODE[codes["float8_e5m2"]] == E5M2
    assert FP8_BY_CODE[codes["float8_e4m3fn"]] == E4M3
    to_dtype = meta.TORCH_DTYPE_ENUM_VALUE_TO_SCALAR_TYPE_MAP
    for code, dtype in FP8_BY_CODE.items():
        assert to_dtype[code] == dtype
    # output_dtype codes of npu_quant_matmul (ScalarType values, as the adapter passes them)
    for code, dtype in OUT_DTYPE_BY_CODE.items():
        assert to_dtype[code] == dtype and dtype in meta.TORCH_DTYPE_MAP


# ------------------------------------------------------------------------------------------------
# meta functions: every operator call of the adapter tests' cases


def _quantize(shape, dim, elem, mode, dtype=torch.bfloat16):
    return lambda adapter: adapter.mx_quantize(cases.weights(shape, dtype), dim, elem, mode)


def _matmul(a_layout, b_layout, k, mn, elems, out_dtypes):
    def run(adapter):
        (m, n), (a_elem, b_elem) = mn, elems
        a, a_scale = cases.operand(cases.exact_values(m, k, seed=k), a_layout, a_elem)
        b, b_scale = cases.operand(cases.exact_values(n, k, seed=k + 1), b_layout, b_elem)
        for out_dtype in out_dtypes:
            adapter.mx_matmul(a, a_scale, b, b_scale, out_dtype)

    return run


def _dual_or_block(kind, shapes, elems):
    """The cases of mx_quantize_dual ("dual") or mx_quantize_block ("block"): each shape, element
    format and scale rule."""
    for shape in shapes:
        for elem, e in elems:
            for mode in cases.MODES:
                yield (
                    f"{kind}-{shape}-{e}-{mode}",
                    lambda adapter, k=kind, s=shape, el=elem, m=mode: getattr(
                        adapter, f"mx_quantize_{k}"
                    )(cases.weights(s), el, m),
                )


def adapter_cases():
    """(id, run(adapter)) for every case of test_adapter.py that reaches a torch_npu operator."""
    elems = [(e, cases.dtype_id(e)) for e in cases.ELEMS]
    for shape, dim in cases.QUANTIZE_CASES:
        for elem, e in elems:
            for mode in cases.MODES:
                yield f"quantize-{shape}-dim{dim}-{e}-{mode}", _quantize(shape, dim, elem, mode)
    for dtype in (torch.float16, torch.float32):
        for dim in (-1, 0):
            yield (
                f"quantize-{cases.OTHER_DTYPE_SHAPE}-dim{dim}-{cases.dtype_id(dtype)}",
                _quantize(cases.OTHER_DTYPE_SHAPE, dim, E4M3, "floor", dtype),
            )
    for shape, dim in cases.FLOAT32_SHORT_AXIS_CASES:
        yield (
            f"quantize-{shape}-dim{dim}-float32",
            _quantize(shape, dim, E4M3, "floor", torch.float32),
        )
    yield (
        "quantize-transposed-input",
        lambda adapter: adapter.mx_quantize(cases.weights((96, 70)).t(), 1, E4M3, "floor"),
    )
    yield from _dual_or_block("dual", cases.DUAL_SHAPES, elems)
    for shape in (cases.DUAL_FLOAT32_SHAPE, (7, 20)):
        yield (
            f"dual-{shape}-float32",
            lambda adapter, s=shape: adapter.mx_quantize_dual(
                cases.weights(s, torch.float32), E4M3, "rceil"
            ),
        )
    yield from _dual_or_block("block", cases.BLOCK_SHAPES, elems)
    for param_dtype in cases.PARAM_DTYPES:
        p = cases.dtype_id(param_dtype)
        yield (
            f"from-master-{p}",
            lambda adapter, pd=param_dtype: (
                adapter.mx_quantize_from_master(
                    cases.master_weights(cases.FROM_MASTER_SHAPE), 0, pd, E4M3, "floor"
                ),
                adapter.mx_quantize_dual_from_master(
                    cases.master_weights(cases.FROM_MASTER_SHAPE), pd, E4M3, "rceil"
                ),
                adapter.mx_quantize_block_from_master(
                    cases.master_weights(cases.FROM_MASTER_SHAPE), pd, E5M2, "floor"
                ),
            ),
        )
    out_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    for k in cases.MATMUL_KS:
        for a_layout in cases.LAYOUTS:
            for b_layout in cases.LAYOUTS:
                yield (
                    f"matmul-{a_layout}-{b_layout}-k{k}",
                    _matmul(
                        a_layout, b_layout, k, cases.MATMUL_MN, cases.matmul_elems(k), out_dtypes
                    ),
                )
    for k in cases.SINGLE_ROW_KS:
        for mn in cases.SINGLE_ROW_MN:
            for a_layout in ("rows", "t"):
                for b_layout in ("rows", "t"):
                    yield (
                        f"matmul-{a_layout}-{b_layout}-k{k}-{mn}",
                        _matmul(a_layout, b_layout, k, mn, (E4M3, E4M3), (torch.float32,)),
                    )


ADAPTER_CASES = dict(adapter_cases())


@pytest.mark.parametrize("case", list(ADAPTER_CASES))
def test_real_meta_functions_agree_with_the_stand_ins(meta, adapter, case):
    # The stand-ins record each call before the adapter sees its outputs: a stand-in that
    # disagrees with torch_npu is reported as such even where the adapter then refuses it.
    adapter_error = None
    with StandIns(SCHEMAS[PINNED]) as ops:
        try:
            ADAPTER_CASES[case](adapter)
        except RuntimeError as e:
            adapter_error = e
    assert ops.records, "the case reached no torch_npu operator"
    for call in ops.records:
        real = meta.functions[("npu", call.op)](*call.args, **call.kwargs)
        assert signature(real) == call.outputs, (
            f"npu::{call.op}({', '.join(map(describe_arg, call.args))}, "
            f"{ {k: describe_arg(v) for k, v in call.kwargs.items()} }): torch_npu {VERSION}'s "
            f"meta function gives {signature(real)}, the stand-in {call.outputs}"
        )
    if adapter_error is not None:
        raise adapter_error


def describe_arg(value):
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{list(value.shape)}"
    return repr(value)


def test_the_fp4_default_is_what_the_stand_ins_refuse(meta, npu_pinned):
    # Without an explicit dst_type, the real operators return FP4: uint8 elements, two a byte.
    # The stand-ins refuse that default; the adapter always passes dst_type, and refuses FP4
    # output (test_schema_variants.py, with ignores_dst_type, which must look like the real one).
    x = torch.empty(8, 64, dtype=torch.bfloat16, device="meta")
    functions = meta.functions
    y, scale = functions[("npu", "npu_dynamic_mx_quant")](x, dst_type=FP4_CODE)
    assert (y.dtype, tuple(y.shape)) == (torch.uint8, (8, 32))
    assert signature(ignores_dst_type(torch.zeros(8, 64, dtype=torch.bfloat16))) == signature(
        (y, scale)
    )
    y1, _, y2, _ = functions[("npu", "npu_dynamic_mx_quant_with_dual_axis")](x, dst_type=FP4_CODE)
    y, _, _ = functions[("npu", "npu_dynamic_block_mx_quant")](x, dst_type=FP4_CODE)
    assert {(t.dtype, tuple(t.shape)) for t in (y1, y2, y)} == {(torch.uint8, (8, 32))}
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    for op in (
        "npu_dynamic_mx_quant",
        "npu_dynamic_mx_quant_with_dual_axis",
        "npu_dynamic_block_mx_quant",
    ):
        with pytest.raises(StandInError, match=str(FP4_CODE)):
            getattr(torch.ops.npu, op)(w)


def test_the_real_matmul_meta_checks_pass_on_what_the_adapter_passes(meta, npu_pinned, adapter):
    # npu_quant_matmul's meta function checks MX mode's arguments: scale_dtype and
    # pertoken_scale_dtype are torch_npu.float8_e8m0fnu, the scales' K dims agree
    # (pertoken_scale dim -2, scale dim -3), group_sizes [1, 1, 32]. A wrong one fails there.
    a, a_scale = ref.mx_quantize(cases.exact_values(4, 128, seed=1), -1, E4M3, "floor")
    adapter.mx_matmul(a, a_scale, a, a_scale, torch.float32)
    call = npu_pinned.records[-1]
    qmm = meta.functions[("npu", "npu_quant_matmul")]
    assert signature(qmm(*call.args, **call.kwargs)) == ((torch.float32, (4, 4)),)
    broken = [
        dict(call.kwargs, scale_dtype=E8M0_CODE - 1),
        dict(call.kwargs, pertoken_scale=as_meta(torch.zeros(4, 1, 2, dtype=torch.uint8))),
    ]
    for kwargs in broken:
        with pytest.raises(RuntimeError):
            qmm(*call.args, **kwargs)


def test_npu_anti_mx_quant_leaves_the_scale_layout_open(wheel, meta):
    # Why mx_dequantize does not call npu_anti_mx_quant (docs/npu.md §4.1): its meta function takes
    # any mxscale shape, and the wheel documents neither the layout nor the rounding.
    anti = meta.functions[("npu", "npu_anti_mx_quant")]
    x = torch.empty(64, 96, dtype=E4M3, device="meta")
    for scale_shape in [(64, 3), (64, 2, 2), (2, 96, 2), (5,)]:
        s = torch.empty(scale_shape, dtype=torch.uint8, device="meta")
        y = anti(x, s, axis=-1, dst_type=15, src_type=24)
        assert (y.dtype, tuple(y.shape)) == (torch.bfloat16, (64, 96))
    docs = wheel.read("torch_npu/_op_plugin_docs.py")
    assert '"npu_dynamic_mx_quant"' in docs and '"npu_anti_mx_quant"' not in docs
    assert "npu_anti_mx_quant" not in NPU_OPERATORS
