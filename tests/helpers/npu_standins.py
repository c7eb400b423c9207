"""Stand-in torch_npu MX operators for the CPU tests of zrw's NPU adapter.

No NPU, torch_npu or CANN exists here. These register the `npu::` operators the adapter calls, with
the schema strings of a given torch_npu release (the pinned one, 2.13.0, copied from its wheel), and
implement them for CPU from their documented semantics (docs/npu.md §5, and the docstrings of
torch_npu 2.13.0): the output shapes and dtypes are those of torch_npu 2.13.0's meta functions
(test_real_torch_npu.py runs them on every call the adapter tests make and compares), the numbers
come from ``zrw.reference`` (floor = ``scale_alg=0``, rceil = ``scale_alg=1``), the layouts are
torch_npu's (uint8 paired scales, written here after the aclnn golden, independently of the
adapter's C++), and the documented constraints are enforced, so that a wrong argument from the
adapter fails: FP8 only through an explicit ``dst_type`` (the default, 296, is FP4),
``round_mode="rint"``, block 32, input dtypes and ranks, and for ``npu_quant_matmul`` in MX mode
``K % 64 == 0``, paired scale shapes, and the same transpose attribute for each data tensor and its
scale (op-plugin's stride test, ported from its QuantMatmulKernelNpuOpApi.cpp).

Each call is logged (``StandIns.calls``) with the argument values it received, so tests can check
what the adapter passed, and recorded in full (``StandIns.records``: the arguments as meta tensors,
the outputs' dtypes and shapes), so that the real meta functions can be run on exactly what the
adapter passed.
"""

import sys
from typing import NamedTuple

import pytest
import torch

from zrw import reference as ref

E8M0_CODE = 293  # torch_npu.float8_e8m0fnu
FP4_CODE = 296  # torch_npu.float4_e2m1fn_x2, every quant op's default dst_type
FP8_BY_CODE = {
    23: torch.float8_e5m2,
    24: torch.float8_e4m3fn,
    291: torch.float8_e5m2,  # torch_npu's own codes for the same formats
    292: torch.float8_e4m3fn,
}
OUT_DTYPE_BY_CODE = {15: torch.bfloat16, 5: torch.float16, 6: torch.float32}

# The schema strings of torch_npu 2.13.0, the release for torch 2.13 (the only torch zrw builds
# against): copied from its wheel's torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml and
# checked against it, string for string after torch's schema parser, by test_real_torch_npu.py.
_MX_QUANT_2_13 = (
    'npu_dynamic_mx_quant(Tensor input, *, int axis=-1, str round_mode="rint", int dst_type=296, '
    "int block_size=32, int? scale_alg=0, float dst_type_max=0.0, float max_low_bound=0.0) "
    "-> (Tensor, Tensor)"
)
_DUAL_2_13 = (
    'npu_dynamic_mx_quant_with_dual_axis(Tensor input, *, str round_mode="rint", '
    "int dst_type=296, int scale_alg=0, float? dst_type_max=0.0) "
    "-> (Tensor, Tensor, Tensor, Tensor)"
)
_BLOCK_2_13 = (
    'npu_dynamic_block_mx_quant(Tensor input, *, str round_mode="rint", int dst_type=296, '
    "int scale_alg=0, float dst_type_max=0.0) -> (Tensor, Tensor, Tensor)"
)
_QMM_2_13 = (
    "npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, "
    "Tensor? pertoken_scale=None, Tensor? bias=None, int? output_dtype=None, "
    "int? x1_dtype=None, int? x2_dtype=None, int? pertoken_scale_dtype=None, "
    "int? scale_dtype=None, int[]? group_sizes=None, Tensor? y_scale=None) -> Tensor"
)
# Older schemas, from op-plugin's tags only (op_plugin_functions.yaml, docs/npu.md §5.2): no
# torch_npu for torch 2.13 has them, so they cannot be checked against a wheel here. They stay as
# tests of the adapter's by-name argument placement. op-plugin tag 26.0.0 lacks max_low_bound and
# the dual-axis op's dst_type_max (that section records no other difference).
_MX_QUANT_26_0 = (
    'npu_dynamic_mx_quant(Tensor input, *, int axis=-1, str round_mode="rint", int dst_type=296, '
    "int block_size=32, int? scale_alg=0, float dst_type_max=0.0) -> (Tensor, Tensor)"
)
_DUAL_26_0 = (
    'npu_dynamic_mx_quant_with_dual_axis(Tensor input, *, str round_mode="rint", '
    "int dst_type=296, int scale_alg=0) -> (Tensor, Tensor, Tensor, Tensor)"
)
# 7.x: no MX operators; npu_quant_matmul takes a ScalarType output_dtype and no *_dtype arguments.
# (op-plugin's 7.x tags give this difference; the rest is the prototype that torch_npu 2.13.0's
# own, older, docstring of npu_quant_matmul still shows, docs/npu.md §5.2.)
_QMM_7X = (
    "npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, "
    "Tensor? pertoken_scale=None, Tensor? bias=None, ScalarType? output_dtype=None) -> Tensor"
)

# Schema strings per torch_npu release. "2.13.0" is the pinned release (docs/npu.md §2, §5.1).
PINNED = "2.13.0"
SCHEMAS = {
    PINNED: {
        "npu_dynamic_mx_quant": _MX_QUANT_2_13,
        "npu_dynamic_mx_quant_with_dual_axis": _DUAL_2_13,
        "npu_dynamic_block_mx_quant": _BLOCK_2_13,
        "npu_quant_matmul": _QMM_2_13,
    },
    "26.0.0": {
        "npu_dynamic_mx_quant": _MX_QUANT_26_0,
        "npu_dynamic_mx_quant_with_dual_axis": _DUAL_26_0,
        "npu_dynamic_block_mx_quant": _BLOCK_2_13,
        "npu_quant_matmul": _QMM_2_13,
    },
    "7.x": {"npu_quant_matmul": _QMM_7X},
}


def torch_npu_loaded():
    """Whether the real torch_npu is in this process (torch may autoload it as a device backend):
    then its operators own the npu namespace and the stand-ins cannot be registered."""
    return "torch_npu" in sys.modules or any(
        torch._C._dispatch_has_kernel(f"npu::{name}") for name in SCHEMAS[PINNED]
    )


# ------------------------------------------------------------------------------------------------
# torch_npu's paired scale layout (docs/npu.md §5.5), after the aclnn golden
# (quant/dynamic_mx_quant_with_dual_axis/tests/assets/golden.py): tail axis, consecutive blocks in
# pairs; another axis, (Mb/2, 2, N) transposed to (Mb/2, N, 2). Odd block counts are padded with
# 0x00.


def golden_pair(scale, axis):
    """Canonical scale (uint8 or float8_e8m0fnu), blocked along ``axis`` -> torch_npu's pairs."""
    s = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale
    axis = axis % s.dim()
    nb = s.shape[axis]
    if nb % 2:
        pad_shape = list(s.shape)
        pad_shape[axis] = 1
        s = torch.cat([s, torch.zeros(pad_shape, dtype=torch.uint8)], axis)
    pairs = s.shape[axis] // 2
    if axis == s.dim() - 1:
        return s.reshape(*s.shape[:-1], pairs, 2).contiguous()
    split = s.reshape(*s.shape[:axis], pairs, 2, *s.shape[axis + 1 :])
    return split.movedim(axis + 1, -1).contiguous()


def golden_unpair(paired, axis, num_blocks):
    """torch_npu's pairs -> canonical uint8 scale with ``num_blocks`` blocks along ``axis``."""
    p = paired.view(torch.uint8) if paired.dtype == torch.float8_e8m0fnu else paired
    axis = axis % (p.dim() - 1)
    split = p.movedim(-1, axis + 1)
    merged = split.reshape(*split.shape[:axis], -1, *split.shape[axis + 2 :])
    return merged.narrow(axis, 0, num_blocks).contiguous()


# ------------------------------------------------------------------------------------------------
# argument checks of the documented operators


class StandInError(RuntimeError):
    """What a stand-in raises where the real operator would refuse its arguments."""


def _fp8(op, dst_type):
    if dst_type not in FP8_BY_CODE:
        raise StandInError(
            f"npu::{op}: dst_type={dst_type} is not an FP8 type (the default, {FP4_CODE}, is "
            "float4_e2m1fn_x2); these stand-ins emulate FP8 outputs only"
        )
    return FP8_BY_CODE[dst_type]


def _scale_mode(op, scale_alg):
    modes = {0: "floor", 1: "rceil"}  # scale_alg=2 is FP4_E2M1 only
    if scale_alg not in modes:
        raise StandInError(f"npu::{op}: scale_alg={scale_alg} is not valid for FP8 output")
    return modes[scale_alg]


def _rint(op, round_mode):
    if round_mode != "rint":
        raise StandInError(
            f"npu::{op}: FP8 output accepts round_mode='rint' only, got {round_mode!r}"
        )


BF16_FP16 = (torch.float16, torch.bfloat16)


def _input(op, x, dtypes, ranks):
    if x.dtype not in dtypes:
        raise StandInError(f"npu::{op}: input dtype {x.dtype} is not supported, expected {dtypes}")
    if x.dim() not in ranks:
        raise StandInError(f"npu::{op}: input rank {x.dim()} is not supported, expected {ranks}")


def ignores_dst_type(input, *, axis=-1, **extra):
    """An npu_dynamic_mx_quant that ignores the dst_type it is given and returns its default,
    FP4 (296), shaped as torch_npu 2.13.0's meta function shapes it: uint8 data with half the last
    dim (two elements a byte) and uint8 paired scales. What the adapter must refuse."""
    data = torch.zeros(*input.shape[:-1], input.shape[-1] // 2, dtype=torch.uint8)
    scale_shape = list(input.shape)
    scale_shape[axis] = -(-input.shape[axis] // ref.BLOCK)
    return data, golden_pair(torch.zeros(scale_shape, dtype=torch.uint8), axis)


def _zero_nan_blocks(data, scale, axis):
    """The golden writes +0 for the elements of a NaN/Inf block (scale byte 0xFF)."""
    axis = axis % data.dim()
    nan_block = scale.view(torch.uint8) == ref.E8M0_NAN_BYTE
    nan_elem = nan_block.repeat_interleave(ref.BLOCK, axis).narrow(axis, 0, data.shape[axis])
    data.view(torch.uint8)[nan_elem] = 0
    return data


# ------------------------------------------------------------------------------------------------
# the operators


class Call(NamedTuple):
    """One call of a stand-in operator as the dispatcher made it (defaults filled in)."""

    op: str
    args: tuple  # tensors as meta tensors of the same sizes, strides and dtypes
    kwargs: dict
    outputs: tuple  # ((dtype, shape), ...) of what the stand-in returned


def as_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(as_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: as_meta(v) for k, v in value.items()}
    return value


def signature(outputs):
    """((dtype, shape), ...) of an operator's outputs."""
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return tuple((t.dtype, tuple(t.shape)) for t in outputs)


class StandIns:
    """Registers the stand-in ``npu::`` operators of one schema variant while entered.

    ``schemas``: {operator name: schema string}; ``dispatch_keys``: where to implement them (CPU
    for the adapter tests; PrivateUse1 too to look like torch_npu to ``zrw.backends()``).
    ``overrides``: {operator name: implementation} replacing a documented one (broken variants).
    The implementations take ``**extra`` so that a synthetic schema may add defaulted arguments.
    """

    def __init__(self, schemas, dispatch_keys=("CPU",), overrides=None):
        self.schemas = dict(schemas)
        self.dispatch_keys = dispatch_keys
        self.overrides = overrides or {}
        self.calls = []
        self.records = []
        self._lib = None

    def __enter__(self):
        if torch_npu_loaded():
            pytest.skip("torch_npu is loaded: its npu:: operators replace the stand-ins")
        self._lib = torch.library.Library("npu", "FRAGMENT")
        for name, schema in self.schemas.items():
            self._lib.define(schema)
            impl = self._recorded(name, self.overrides.get(name) or getattr(self, name))
            for key in self.dispatch_keys:
                self._lib.impl(name, impl, key)
        return self

    def __exit__(self, *exc):
        self._lib._destroy()
        self._lib = None

    def _recorded(self, name, impl):
        def call(*args, **kwargs):
            outputs = impl(*args, **kwargs)
            self.records.append(Call(name, as_meta(args), as_meta(kwargs), signature(outputs)))
            return outputs

        return call

    def _log(self, name, **args):
        self.calls.append((name, args))

    def last(self, name):
        return [args for op, args in self.calls if op == name][-1]

    def _quant_call(self, op, input, dtypes, ranks, **args):
        """A quantization call: logged, its input and its FP8 output arguments (`args` holds
        round_mode and dst_type) checked; returns the element dtype."""
        self._log(op, shape=tuple(input.shape), **args)
        _input(op, input, dtypes, ranks)
        elem = _fp8(op, args["dst_type"])
        _rint(op, args["round_mode"])
        return elem

    # -- npu_dynamic_mx_quant -------------------------------------------------------------------
    def npu_dynamic_mx_quant(
        self,
        input,
        *,
        axis=-1,
        round_mode="rint",
        dst_type=FP4_CODE,
        block_size=32,
        scale_alg=0,
        dst_type_max=0.0,
        max_low_bound=0.0,
        **extra,
    ):
        op = "npu_dynamic_mx_quant"
        elem = self._quant_call(
            op,
            input,
            (torch.float16, torch.bfloat16, torch.float32),
            range(1, 8),
            axis=axis,
            round_mode=round_mode,
            dst_type=dst_type,
            block_size=block_size,
            scale_alg=scale_alg,
        )
        if block_size != 32:
            raise StandInError(f"npu::{op}: block_size={block_size} is not emulated (32 only)")
        if input.dtype == torch.float32 and input.shape[axis] < 32:
            # torch_npu 2.13.0's docstring: float32 input needs block_size 32 and an axis of at
            # least 32 elements
            raise StandInError(
                f"npu::{op}: a float32 input needs at least 32 elements along the "
                f"quantized axis, got {input.shape[axis]}"
            )
        data, scale = ref.mx_quantize(input, axis, elem, _scale_mode(op, scale_alg))
        return _zero_nan_blocks(data, scale, axis), golden_pair(scale, axis)

    # -- npu_dynamic_mx_quant_with_dual_axis ----------------------------------------------------
    def npu_dynamic_mx_quant_with_dual_axis(
        self, input, *, round_mode="rint", dst_type=FP4_CODE, scale_alg=0, dst_type_max=0.0, **extra
    ):
        op = "npu_dynamic_mx_quant_with_dual_axis"
        fp8 = dict(round_mode=round_mode, dst_type=dst_type, scale_alg=scale_alg)
        elem = self._quant_call(op, input, BF16_FP16, range(2, 8), **fp8)
        mode = _scale_mode(op, scale_alg)
        y1, s1 = ref.mx_quantize(input, -1, elem, mode)
        y2, s2 = ref.mx_quantize(input, -2, elem, mode)
        return (
            _zero_nan_blocks(y1, s1, -1),
            golden_pair(s1, -1),
            _zero_nan_blocks(y2, s2, -2),
            golden_pair(s2, -2),
        )

    # -- npu_dynamic_block_mx_quant -------------------------------------------------------------
    def npu_dynamic_block_mx_quant(
        self, input, *, round_mode="rint", dst_type=FP4_CODE, scale_alg=0, dst_type_max=0.0, **extra
    ):
        op = "npu_dynamic_block_mx_quant"
        fp8 = dict(round_mode=round_mode, dst_type=dst_type, scale_alg=scale_alg)
        elem = self._quant_call(op, input, BF16_FP16, (2, 3), **fp8)
        y, block = ref.mx_quantize_block(input, elem, _scale_mode(op, scale_alg))
        # One scale per 32x32 tile, broadcast over its 32 rows (scale1) and 32 columns (scale2).
        s1 = ref.expand_block_scale(block, input.shape, -1)
        s2 = ref.expand_block_scale(block, input.shape, -2)
        return _zero_nan_blocks(y, s1, -1), golden_pair(s1, -1), golden_pair(s2, -2)

    # -- npu_quant_matmul ------------------------------------------------------------------------
    def npu_quant_matmul(
        self,
        x1,
        x2,
        scale,
        *,
        offset=None,
        pertoken_scale=None,
        bias=None,
        output_dtype=None,
        x1_dtype=None,
        x2_dtype=None,
        pertoken_scale_dtype=None,
        scale_dtype=None,
        group_sizes=None,
        y_scale=None,
        **extra,
    ):
        op = "npu_quant_matmul"
        self._log(
            op,
            x1_shape=tuple(x1.shape),
            x2_shape=tuple(x2.shape),
            x1_ptr=x1.data_ptr(),
            x2_ptr=x2.data_ptr(),
            x1_transposed=_data_transposed(x1),
            x2_transposed=_data_transposed(x2),
            output_dtype=output_dtype,
            scale_dtype=scale_dtype,
            pertoken_scale_dtype=pertoken_scale_dtype,
            group_sizes=group_sizes,
        )
        if scale_dtype != E8M0_CODE:
            raise StandInError(
                f"npu::{op}: only MX mode (scale_dtype={E8M0_CODE}) is emulated, "
                f"got scale_dtype={scale_dtype}"
            )
        if pertoken_scale_dtype != E8M0_CODE or pertoken_scale is None:
            raise StandInError(
                f"npu::{op}: MX mode needs pertoken_scale (x1's scale) with "
                f"pertoken_scale_dtype={E8M0_CODE}, got {pertoken_scale_dtype}"
            )
        if list(group_sizes or []) != [1, 1, 32]:
            raise StandInError(
                f"npu::{op}: MX mode needs group_sizes=[1, 1, 32], got {group_sizes}"
            )
        if any(t is not None for t in (offset, bias, y_scale)):
            raise StandInError(f"npu::{op}: offset, bias and y_scale are not emulated")
        if output_dtype not in OUT_DTYPE_BY_CODE:
            raise StandInError(
                f"npu::{op}: output_dtype={output_dtype}: MX mode outputs "
                "float16, bfloat16 or float32"
            )
        for name, t, code in (("x1", x1, x1_dtype), ("x2", x2, x2_dtype)):
            if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or t.dim() != 2:
                raise StandInError(
                    f"npu::{op}: {name} must be a 2-d FP8 tensor, got {t.dtype} {tuple(t.shape)}"
                )
            if code is not None:
                # torch_npu 2.13.0's meta function takes x1_dtype/x2_dtype only for dtypes torch
                # lacks (FP4, HiFloat8), never for a native float8 tensor
                raise StandInError(
                    f"npu::{op}: pass {name}_dtype only when {name} is not a "
                    f"native PyTorch dtype, got {name}_dtype={code} for {t.dtype}"
                )
        (m, k), (k2, n) = x1.shape, x2.shape
        if k != k2:
            raise StandInError(f"npu::{op}: x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)}: K")
        if k % 64:
            raise StandInError(f"npu::{op}: MX mode needs K divisible by 64, got K={k}")
        for name, t, shape in (
            ("pertoken_scale", pertoken_scale, (m, k // 64, 2)),
            ("scale", scale, (k // 64, n, 2)),
        ):
            if t.dtype != torch.uint8 or tuple(t.shape) != shape:
                raise StandInError(
                    f"npu::{op}: {name} must be uint8 {shape}, got {t.dtype} {tuple(t.shape)}"
                )
        for name, data, s in (("x1", x1, pertoken_scale), ("x2", x2, scale)):
            # stricter than op-plugin, which takes other strides too: the adapter promises one
            # of these two
            if not (data.is_contiguous() or _data_transposed(data)):
                raise StandInError(
                    f"npu::{op}: {name} is neither contiguous nor transposed "
                    f"(strides {data.stride()})"
                )
            if not _same_transpose(data, s):
                raise StandInError(
                    f"Input {name} tensor and scale tensor's transpose are not "
                    "same, please check input."
                )
        # out[m, n] = sum_j (sum_{k in block j} x1 x2) * x1Scale[m, j] * x2Scale[j, n]
        s1 = golden_unpair(pertoken_scale, 1, k // 32).view(torch.float8_e8m0fnu)  # (M, K/32)
        s2 = golden_unpair(scale, 0, k // 32).view(torch.float8_e8m0fnu)  # (K/32, N)
        return ref.mx_matmul(x1, s1, x2.t(), s2.t(), OUT_DTYPE_BY_CODE[output_dtype])


# op-plugin's transpose attributes (docs/npu.md §5.7), after its QuantMatmulKernelNpuOpApi.cpp
# (is_transpose_last_two_dims, is_transpose_certain_two_dims, is_x_scale_same_transpose; MX mode
# compares the data's last two dims with the scale's first two). Read from strides as they are,
# size-1 dims included.


def _data_transposed(t):
    """is_transpose_last_two_dims of a matrix (the operand's trans_x attribute)."""
    if t.dim() != 2:
        return False
    if t.stride(0) == 1 and t.stride(1) == t.size(0):
        return not (t.size(0) == 1 and t.size(1) == 1)
    return False


def _transposed_at(t, dim):
    """is_transpose_certain_two_dims."""
    return t.stride(dim + 1) == t.stride(dim) * t.size(dim)


def _same_transpose(data, scale):
    """is_x_scale_same_transpose(data, scale, dim_x=data.dim()-2, dim_scale=0) in MX mode."""
    if data.size(0) == 1 and data.size(1) == 1:
        return True
    if scale.size(0) == 1 and scale.size(1) == 1:
        return True
    return _transposed_at(data, 0) == _transposed_at(scale, 0)
