"""Every bad input to a zrw op raises a Python exception naming the argument, the expectation and
what was found (docs/design.md §8), never a crash and never a silent result.

Exception types follow csrc/common/checks.h: TORCH_CHECK_TYPE -> TypeError (dtypes),
TORCH_CHECK_VALUE -> ValueError (shapes, ranks, scale_mode), TORCH_CHECK_INDEX -> IndexError (dim),
TORCH_CHECK -> RuntimeError (device). The C++ side spells a found dtype the c10 way ("Double",
"Char"); the patterns also accept the torch spelling ("torch.float64"), so that either one passes.
"""

import re

import pytest
import torch

import zrw  # noqa: F401  (registers torch.ops.zrw.*)
from helpers.bitwise import same_bits
from zrw import ops

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E8M0 = torch.float8_e8m0fnu

# c10 name of each dtype that appears below as the "found" value.
C10_NAME = {
    torch.int32: "Int",
    torch.float64: "Double",
    torch.float16: "Half",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.bfloat16: "BFloat16",
    torch.float32: "Float",
    E4M3: "Float8_e4m3fn",
    E8M0: "Float8_e8m0fnu",
    torch.bool: "Bool",
}


def found(dtype):
    """A pattern matching `dtype` as found: either its c10 or its torch spelling, then the end."""
    return f"got ({C10_NAME[dtype]}|{re.escape(str(dtype))})$"


def shape_pattern(*dims):
    """A shape as C++ prints it ([4, 64]) or as Python does ((4, 64))."""
    inner = ", ".join(map(str, dims))
    tuple_inner = inner + ("," if len(dims) == 1 else "")
    return rf"(\[{re.escape(inner)}\]|\({re.escape(tuple_inner)}\))"


X = torch.ones(4, 64)
W3 = torch.ones(2, 4, 64)
DATA, SCALE = ops.mx_quantize(X, -1)  # (4, 64) e4m3, (4, 2)
DATA0, SCALE0 = ops.mx_quantize(X, 0)  # (4, 64) e4m3, (1, 64)

INPUT_DTYPES = r"torch\.bfloat16, torch\.float16 or torch\.float32"
ELEM_DTYPES = r"torch\.float8_e4m3fn or torch\.float8_e5m2"


# (id, call, exception type, pattern)
CASES = [
    # ---- mx_quantize
    (
        "quantize-int32",
        lambda: ops.mx_quantize(X.int()),
        TypeError,
        rf"zrw\.mx_quantize: x must be {INPUT_DTYPES}, {found(torch.int32)}",
    ),
    (
        "quantize-float64",
        lambda: ops.mx_quantize(X.double()),
        TypeError,
        rf"zrw\.mx_quantize: x must be {INPUT_DTYPES}, {found(torch.float64)}",
    ),
    (
        "quantize-fp8-input",
        lambda: ops.mx_quantize(DATA),
        TypeError,
        rf"zrw\.mx_quantize: x must be {INPUT_DTYPES}, {found(E4M3)}",
    ),
    (
        "quantize-bool",
        lambda: ops.mx_quantize(X.bool()),
        TypeError,
        rf"zrw\.mx_quantize: x must be {INPUT_DTYPES}, {found(torch.bool)}",
    ),
    (
        "quantize-scale-mode",
        lambda: ops.mx_quantize(X, -1, E4M3, "round"),
        ValueError,
        r'zrw\.mx_quantize: scale_mode must be "floor" or "rceil", got "round"$',
    ),
    (
        "quantize-scale-mode-case",
        lambda: ops.mx_quantize(X, -1, E4M3, "Floor"),
        ValueError,
        r'scale_mode must be "floor" or "rceil", got "Floor"$',
    ),
    (
        "quantize-dim-high",
        lambda: ops.mx_quantize(X, 2),
        IndexError,
        r"zrw\.mx_quantize: dim must be in \[-2, 1\] for a 2-d x, got 2$",
    ),
    (
        "quantize-dim-low",
        lambda: ops.mx_quantize(W3, -4),
        IndexError,
        r"zrw\.mx_quantize: dim must be in \[-3, 2\] for a 3-d x, got -4$",
    ),
    (
        "quantize-0d",
        lambda: ops.mx_quantize(torch.tensor(1.0)),
        IndexError,
        r"zrw\.mx_quantize: x must have at least one dimension, got a 0-d tensor$",
    ),
    (
        "quantize-elem-fp16",
        lambda: ops.mx_quantize(X, -1, torch.float16),
        TypeError,
        rf"zrw\.mx_quantize: elem_dtype must be {ELEM_DTYPES}, {found(torch.float16)}",
    ),
    (
        "quantize-elem-int8",
        lambda: ops.mx_quantize(X, -1, torch.int8),
        TypeError,
        rf"zrw\.mx_quantize: elem_dtype must be {ELEM_DTYPES}, {found(torch.int8)}",
    ),
    (
        "quantize-elem-e8m0",
        lambda: ops.mx_quantize(X, -1, E8M0),
        TypeError,
        rf"zrw\.mx_quantize: elem_dtype must be {ELEM_DTYPES}, {found(E8M0)}",
    ),
    # ---- mx_quantize_dual / mx_quantize_block
    *[
        case
        for name, fn in (("dual", ops.mx_quantize_dual), ("block", ops.mx_quantize_block))
        for case in [
            (
                f"{name}-1d",
                lambda fn=fn: fn(X[0]),
                ValueError,
                rf"zrw\.mx_quantize_{name}: w must be 2-d \(N, K\) or 3-d \(E, N, K\), got shape "
                + shape_pattern(64)
                + "$",
            ),
            (
                f"{name}-4d",
                lambda fn=fn: fn(W3[None]),
                ValueError,
                rf"zrw\.mx_quantize_{name}: w must be 2-d \(N, K\) or 3-d \(E, N, K\), got shape "
                + shape_pattern(1, 2, 4, 64)
                + "$",
            ),
            (
                f"{name}-0d",
                lambda fn=fn: fn(torch.tensor(1.0)),
                ValueError,
                rf"zrw\.mx_quantize_{name}: w must be 2-d \(N, K\) or 3-d \(E, N, K\), got shape "
                + r"(\[\]|\(\))$",
            ),
            (
                f"{name}-float64",
                lambda fn=fn: fn(X.double()),
                TypeError,
                rf"zrw\.mx_quantize_{name}: w must be {INPUT_DTYPES}, {found(torch.float64)}",
            ),
            (
                f"{name}-fp8-input",
                lambda fn=fn: fn(DATA),
                TypeError,
                rf"zrw\.mx_quantize_{name}: w must be {INPUT_DTYPES}, {found(E4M3)}",
            ),
            (
                f"{name}-elem-int8",
                lambda fn=fn: fn(X, torch.int8),
                TypeError,
                rf"zrw\.mx_quantize_{name}: elem_dtype must be {ELEM_DTYPES}, {found(torch.int8)}",
            ),
            (
                f"{name}-scale-mode",
                lambda fn=fn: fn(X, E4M3, "round"),
                ValueError,
                rf'zrw\.mx_quantize_{name}: scale_mode must be "floor" or "rceil", got "round"$',
            ),
        ]
    ],
    # ---- mx_dequantize
    (
        "dequantize-scale-shape",
        lambda: ops.mx_dequantize(DATA, SCALE, 0),
        ValueError,
        r"zrw\.mx_dequantize: scale must have shape "
        + shape_pattern(1, 64)
        + r" for data of shape "
        + shape_pattern(4, 64)
        + r" blocked along dim 0, got "
        + shape_pattern(4, 2)
        + "$",
    ),
    (
        "dequantize-scale-shape-transposed",
        lambda: ops.mx_dequantize(DATA, SCALE0, -1),
        ValueError,
        r"zrw\.mx_dequantize: scale must have shape "
        + shape_pattern(4, 2)
        + r" .*got "
        + shape_pattern(1, 64)
        + "$",
    ),
    (
        "dequantize-scale-rank",
        lambda: ops.mx_dequantize(DATA, SCALE[None], -1),
        ValueError,
        r"zrw\.mx_dequantize: scale must have shape .* got " + shape_pattern(1, 4, 2) + "$",
    ),
    (
        "dequantize-scale-uint8",
        lambda: ops.mx_dequantize(DATA, SCALE.view(torch.uint8)),
        TypeError,
        rf"zrw\.mx_dequantize: scale must be torch\.float8_e8m0fnu, {found(torch.uint8)}",
    ),
    (
        "dequantize-scale-float32",
        lambda: ops.mx_dequantize(DATA, SCALE.float()),
        TypeError,
        rf"zrw\.mx_dequantize: scale must be torch\.float8_e8m0fnu, {found(torch.float32)}",
    ),
    (
        "dequantize-data-bf16",
        lambda: ops.mx_dequantize(DATA.bfloat16(), SCALE),
        TypeError,
        rf"zrw\.mx_dequantize: data must be {ELEM_DTYPES}, {found(torch.bfloat16)}",
    ),
    (
        "dequantize-data-uint8",
        lambda: ops.mx_dequantize(DATA.view(torch.uint8), SCALE),
        TypeError,
        rf"zrw\.mx_dequantize: data must be {ELEM_DTYPES}, {found(torch.uint8)}",
    ),
    (
        "dequantize-out-float64",
        lambda: ops.mx_dequantize(DATA, SCALE, -1, torch.float64),
        TypeError,
        rf"zrw\.mx_dequantize: out_dtype must be {INPUT_DTYPES}, {found(torch.float64)}",
    ),
    (
        "dequantize-out-int32",
        lambda: ops.mx_dequantize(DATA, SCALE, -1, torch.int32),
        TypeError,
        rf"zrw\.mx_dequantize: out_dtype must be {INPUT_DTYPES}, {found(torch.int32)}",
    ),
    (
        "dequantize-out-fp8",
        lambda: ops.mx_dequantize(DATA, SCALE, -1, E4M3),
        TypeError,
        rf"zrw\.mx_dequantize: out_dtype must be {INPUT_DTYPES}, {found(E4M3)}",
    ),
    (
        "dequantize-dim",
        lambda: ops.mx_dequantize(DATA, SCALE, 3),
        IndexError,
        r"zrw\.mx_dequantize: dim must be in \[-2, 1\] for a 2-d data, got 3$",
    ),
    (
        "dequantize-0d",
        lambda: ops.mx_dequantize(DATA[0, 0], SCALE[0, 0]),
        IndexError,
        r"zrw\.mx_dequantize: data must have at least one dimension, got a 0-d tensor$",
    ),
    # ---- mx_matmul
    (
        "matmul-k-mismatch",
        lambda: ops.mx_matmul(DATA, SCALE, DATA[:, :32], SCALE[:, :1]),
        ValueError,
        r"zrw\.mx_matmul: a \(M, K\) and b \(N, K\) must share K.*got a "
        + shape_pattern(4, 64)
        + " and b "
        + shape_pattern(4, 32)
        + "$",
    ),
    (
        "matmul-a-3d",
        lambda: ops.mx_matmul(DATA[None], SCALE[None], DATA, SCALE),
        ValueError,
        r"zrw\.mx_matmul: a must be 2-d \(M, K\), got shape " + shape_pattern(1, 4, 64) + "$",
    ),
    (
        "matmul-b-1d",
        lambda: ops.mx_matmul(DATA, SCALE, DATA[0], SCALE[0]),
        ValueError,
        r"zrw\.mx_matmul: b must be 2-d \(N, K\), got shape " + shape_pattern(64) + "$",
    ),
    (
        "matmul-a-scale-shape",
        lambda: ops.mx_matmul(DATA, SCALE[:, :1], DATA, SCALE),
        ValueError,
        r"zrw\.mx_matmul: a_scale must have shape "
        + shape_pattern(4, 2)
        + " for a of shape "
        + shape_pattern(4, 64)
        + r" .*got "
        + shape_pattern(4, 1)
        + "$",
    ),
    (
        "matmul-b-scale-shape",
        lambda: ops.mx_matmul(DATA, SCALE, DATA, SCALE.t()),
        ValueError,
        r"zrw\.mx_matmul: b_scale must have shape "
        + shape_pattern(4, 2)
        + " for b of shape "
        + shape_pattern(4, 64)
        + r" .*got "
        + shape_pattern(2, 4)
        + "$",
    ),
    (
        "matmul-b-scale-of-other-axis",
        lambda: ops.mx_matmul(DATA, SCALE, DATA0, SCALE0),
        ValueError,
        r"zrw\.mx_matmul: b_scale must have shape "
        + shape_pattern(4, 2)
        + r" .*got "
        + shape_pattern(1, 64)
        + "$",
    ),
    (
        "matmul-a-scale-uint8",
        lambda: ops.mx_matmul(DATA, SCALE.view(torch.uint8), DATA, SCALE),
        TypeError,
        rf"zrw\.mx_matmul: a_scale must be torch\.float8_e8m0fnu, {found(torch.uint8)}",
    ),
    (
        "matmul-b-scale-float32",
        lambda: ops.mx_matmul(DATA, SCALE, DATA, SCALE.float()),
        TypeError,
        rf"zrw\.mx_matmul: b_scale must be torch\.float8_e8m0fnu, {found(torch.float32)}",
    ),
    (
        "matmul-a-bf16",
        lambda: ops.mx_matmul(DATA.bfloat16(), SCALE, DATA, SCALE),
        TypeError,
        rf"zrw\.mx_matmul: a must be {ELEM_DTYPES}, {found(torch.bfloat16)}",
    ),
    (
        "matmul-b-uint8",
        lambda: ops.mx_matmul(DATA, SCALE, DATA.view(torch.uint8), SCALE),
        TypeError,
        rf"zrw\.mx_matmul: b must be {ELEM_DTYPES}, {found(torch.uint8)}",
    ),
    (
        "matmul-out-int32",
        lambda: ops.mx_matmul(DATA, SCALE, DATA, SCALE, torch.int32),
        TypeError,
        rf"zrw\.mx_matmul: out_dtype must be {INPUT_DTYPES}, {found(torch.int32)}",
    ),
    (
        "matmul-out-float64",
        lambda: ops.mx_matmul(DATA, SCALE, DATA, SCALE, torch.float64),
        TypeError,
        rf"zrw\.mx_matmul: out_dtype must be {INPUT_DTYPES}, {found(torch.float64)}",
    ),
    # ---- mx_expand_block_scale (zrw.ops.expand_block_scale checks shape and leading dims)
    (
        "expand-block-scale-dim",
        lambda: ops.expand_block_scale(SCALE[:1, :2][None], (1, 4, 64), 0),
        IndexError,
        r"zrw\.mx_expand_block_scale: dim must be -1 .* or -2 .*, got 0$",
    ),
    (
        "expand-block-scale-negative-n",
        lambda: torch.ops.zrw.mx_expand_block_scale(SCALE[:1, :2], -1, 64, -1),
        ValueError,
        r"zrw\.mx_expand_block_scale: the weight's N and K must be non-negative, got N=-1, K=64",
    ),
]


def by_case(cases):
    """Parametrize a test over (id, call, exc_type, pattern) cases."""
    return pytest.mark.parametrize(
        "call, exc_type, pattern", [c[1:] for c in cases], ids=[c[0] for c in cases]
    )


@by_case(CASES)
def test_bad_argument_raises_with_a_message_naming_it(call, exc_type, pattern):
    with pytest.raises(exc_type, match=pattern):
        call()


def test_every_case_id_is_unique():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))


# ------------------------------------------------------------------------------------------------
# devices and layouts without a kernel


NO_KERNEL_CASES = [
    ("quantize-sparse", lambda: ops.mx_quantize(X.to_sparse()), "mx_quantize", "SparseCPU"),
    ("quantize-mkldnn", lambda: ops.mx_quantize(X.to_mkldnn()), "mx_quantize", "MkldnnCPU"),
    ("dual-sparse", lambda: ops.mx_quantize_dual(X.to_sparse()), "mx_quantize_dual", "SparseCPU"),
    (
        "block-sparse",
        lambda: ops.mx_quantize_block(X.to_sparse()),
        "mx_quantize_block",
        "SparseCPU",
    ),
    (
        "dequantize-sparse-scale",
        lambda: ops.mx_dequantize(DATA, SCALE.float().to_sparse()),
        "mx_dequantize",
        "SparseCPU",
    ),
    (
        "matmul-sparse-b",
        lambda: ops.mx_matmul(DATA, SCALE, DATA.float().to_sparse(), SCALE),
        "mx_matmul",
        "SparseCPU",
    ),
]


@pytest.mark.parametrize(
    "call, op, backend", [c[1:] for c in NO_KERNEL_CASES], ids=[c[0] for c in NO_KERNEL_CASES]
)
def test_tensor_without_a_kernel_raises_naming_op_and_backend(call, op, backend):
    # The dispatcher's error for a backend zrw has no kernel for (how a CUDA or NPU tensor fails
    # on a build without that backend): a Python exception, never a crash.
    pattern = rf"Could not run 'zrw::{op}' .*'{backend}' backend"
    with pytest.raises(NotImplementedError, match=pattern):
        call()


def test_meta_tensors_go_to_the_fake_kernels():
    # Meta tensors (deferred init, shape inference) get outputs of the right shapes and dtypes.
    x = torch.empty(3, 40, 70, device="meta", dtype=torch.bfloat16)
    data, scale = ops.mx_quantize(x, 1, E5M2, "rceil")
    assert (data.device.type, data.shape, data.dtype) == ("meta", x.shape, E5M2)
    assert (scale.device.type, scale.shape, scale.dtype) == ("meta", (3, 2, 70), E8M0)
    outs = ops.mx_quantize_dual(x)
    assert [tuple(t.shape) for t in outs] == [(3, 40, 70), (3, 40, 3), (3, 40, 70), (3, 2, 70)]
    assert all(t.device.type == "meta" for t in outs)
    data, block_scale = ops.mx_quantize_block(x)
    assert block_scale.shape == (3, 2, 3) and block_scale.device.type == "meta"
    bwd_scale = ops.expand_block_scale(block_scale, x.shape, -2)
    out = ops.mx_dequantize(data, bwd_scale, -2, torch.float16)
    assert (out.device.type, out.shape, out.dtype) == ("meta", x.shape, torch.float16)
    a = torch.empty(5, 70, device="meta", dtype=E4M3)
    a_scale = torch.empty(5, 3, device="meta", dtype=E8M0)
    out = ops.mx_matmul(a, a_scale, data[0], ops.expand_block_scale(block_scale, x.shape, -1)[0])
    assert (out.device.type, out.shape, out.dtype) == ("meta", (5, 40), torch.bfloat16)


MIXED_DEVICE_CASES = [
    ("dequantize-scale-meta", lambda: ops.mx_dequantize(DATA, SCALE.to("meta")), "scale"),
    ("dequantize-data-meta", lambda: ops.mx_dequantize(DATA.to("meta"), SCALE), "data|scale"),
    ("matmul-b-meta", lambda: ops.mx_matmul(DATA, SCALE, DATA.to("meta"), SCALE), "b"),
    ("matmul-a-scale-meta", lambda: ops.mx_matmul(DATA, SCALE.to("meta"), DATA, SCALE), "a_scale"),
]


@pytest.mark.parametrize(
    "call, arg", [c[1:] for c in MIXED_DEVICE_CASES], ids=[c[0] for c in MIXED_DEVICE_CASES]
)
def test_mixed_cpu_and_meta_operands_raise(call, arg):
    # One meta operand among CPU ones routes the call to the Meta (fake) kernel. It must refuse
    # rather than return a tensor: the fake allocates its output with new_empty on the first
    # argument, so with CPU data it would hand back uninitialized CPU memory as a result.
    with pytest.raises((RuntimeError, ValueError), match=rf"({arg}).*(meta|cpu|device)"):
        result = call()
        pytest.fail(f"returned a {result.device} tensor of shape {tuple(result.shape)}")


META = torch.device("meta")
FAKE_CASES = [
    ("quantize-int32", lambda: ops.mx_quantize(X.int().to(META)), TypeError, r"x must be"),
    (
        "quantize-elem-fp16",
        lambda: ops.mx_quantize(X.to(META), -1, torch.float16),
        TypeError,
        r"elem_dtype must be",
    ),
    (
        "quantize-scale-mode",
        lambda: ops.mx_quantize(X.to(META), -1, E4M3, "round"),
        ValueError,
        r"scale_mode must be",
    ),
    ("dual-4d", lambda: ops.mx_quantize_dual(W3[None].to(META)), ValueError, r"w must be 2-d"),
    (
        "dequantize-scale-shape",
        lambda: ops.mx_dequantize(DATA.to(META), SCALE.to(META), 0),
        ValueError,
        r"scale must have shape",
    ),
    (
        "dequantize-dim",
        lambda: ops.mx_dequantize(DATA.to(META), SCALE.to(META), 5),
        IndexError,
        r"dim must be in",
    ),
    (
        "matmul-k-mismatch",
        lambda: ops.mx_matmul(
            DATA.to(META), SCALE.to(META), DATA[:, :32].to(META), SCALE[:, :1].to(META)
        ),
        ValueError,
        r"must share K",
    ),
]


@by_case(FAKE_CASES)
def test_fake_kernels_reject_what_the_cpu_kernels_reject(call, exc_type, pattern):
    # The fakes are what torch.compile traces and what meta tensors run: a bad argument must fail
    # there with the kernel's error, not trace into a graph that fails (or, for shapes, silently
    # mis-sizes) later.
    with pytest.raises(exc_type, match=pattern):
        call()


# ------------------------------------------------------------------------------------------------
# None and other non-tensor arguments: the wrappers name the argument (the dispatcher's own
# message for a None tensor names neither the op nor the argument)

NOT_A = {"Tensor": "a torch\\.Tensor", "int": "an int", "dtype": "a torch\\.dtype", "str": "a str"}
TYPE_CASES = [
    ("quantize-x-none", lambda: ops.mx_quantize(None), "mx_quantize", "x", "Tensor", "NoneType"),
    ("quantize-x-list", lambda: ops.mx_quantize([1.0] * 32), "mx_quantize", "x", "Tensor", "list"),
    (
        "quantize-dim-none",
        lambda: ops.mx_quantize(X, None),
        "mx_quantize",
        "dim",
        "int",
        "NoneType",
    ),
    ("quantize-dim-float", lambda: ops.mx_quantize(X, 1.0), "mx_quantize", "dim", "int", "float"),
    ("quantize-dim-bool", lambda: ops.mx_quantize(X, True), "mx_quantize", "dim", "int", "bool"),
    (
        "quantize-elem-none",
        lambda: ops.mx_quantize(X, -1, None),
        "mx_quantize",
        "elem_dtype",
        "dtype",
        "NoneType",
    ),
    (
        "quantize-elem-str",
        lambda: ops.mx_quantize(X, -1, "e4m3"),
        "mx_quantize",
        "elem_dtype",
        "dtype",
        "str",
    ),
    (
        "quantize-mode-none",
        lambda: ops.mx_quantize(X, -1, E4M3, None),
        "mx_quantize",
        "scale_mode",
        "str",
        "NoneType",
    ),
    (
        "dual-w-none",
        lambda: ops.mx_quantize_dual(None),
        "mx_quantize_dual",
        "w",
        "Tensor",
        "NoneType",
    ),
    (
        "dual-elem-none",
        lambda: ops.mx_quantize_dual(X, None),
        "mx_quantize_dual",
        "elem_dtype",
        "dtype",
        "NoneType",
    ),
    (
        "block-w-none",
        lambda: ops.mx_quantize_block(None),
        "mx_quantize_block",
        "w",
        "Tensor",
        "NoneType",
    ),
    (
        "block-mode-none",
        lambda: ops.mx_quantize_block(X, E4M3, None),
        "mx_quantize_block",
        "scale_mode",
        "str",
        "NoneType",
    ),
    (
        "dequantize-data-none",
        lambda: ops.mx_dequantize(None, SCALE),
        "mx_dequantize",
        "data",
        "Tensor",
        "NoneType",
    ),
    (
        "dequantize-scale-none",
        lambda: ops.mx_dequantize(DATA, None),
        "mx_dequantize",
        "scale",
        "Tensor",
        "NoneType",
    ),
    (
        "dequantize-dim-none",
        lambda: ops.mx_dequantize(DATA, SCALE, None),
        "mx_dequantize",
        "dim",
        "int",
        "NoneType",
    ),
    (
        "dequantize-out-none",
        lambda: ops.mx_dequantize(DATA, SCALE, -1, None),
        "mx_dequantize",
        "out_dtype",
        "dtype",
        "NoneType",
    ),
    (
        "matmul-a-none",
        lambda: ops.mx_matmul(None, SCALE, DATA, SCALE),
        "mx_matmul",
        "a",
        "Tensor",
        "NoneType",
    ),
    (
        "matmul-a-scale-none",
        lambda: ops.mx_matmul(DATA, None, DATA, SCALE),
        "mx_matmul",
        "a_scale",
        "Tensor",
        "NoneType",
    ),
    (
        "matmul-b-none",
        lambda: ops.mx_matmul(DATA, SCALE, None, SCALE),
        "mx_matmul",
        "b",
        "Tensor",
        "NoneType",
    ),
    (
        "matmul-b-scale-none",
        lambda: ops.mx_matmul(DATA, SCALE, DATA, None),
        "mx_matmul",
        "b_scale",
        "Tensor",
        "NoneType",
    ),
    (
        "matmul-out-none",
        lambda: ops.mx_matmul(DATA, SCALE, DATA, SCALE, None),
        "mx_matmul",
        "out_dtype",
        "dtype",
        "NoneType",
    ),
    (
        "expand-dim-none",
        lambda: ops.expand_block_scale(SCALE[:1, :2], (4, 64), None),
        "mx_expand_block_scale",
        "dim",
        "int",
        "NoneType",
    ),
]


@pytest.mark.parametrize(
    "call, op, arg, expected, got", [c[1:] for c in TYPE_CASES], ids=[c[0] for c in TYPE_CASES]
)
def test_none_or_wrong_typed_argument_is_a_type_error_naming_it(call, op, arg, expected, got):
    with pytest.raises(
        TypeError,
        match=rf"^zrw\.{op}: {arg} must be {NOT_A[expected]}, got "
        rf"{got}$",
    ):
        call()


def test_expand_block_scale_none_arguments_are_named():
    with pytest.raises(
        TypeError,
        match=r"expand_block_scale: block_scale must be a "
        r"torch\.Tensor, got NoneType",
    ):
        ops.expand_block_scale(None, (4, 64), -1)
    with pytest.raises(
        TypeError,
        match=r"expand_block_scale: shape must be a sequence of ints, "
        r"got None",
    ):
        ops.expand_block_scale(SCALE[:1, :2], None, -1)


def test_integer_like_dims_are_accepted():
    # numpy integers are ints to the dispatcher too; only bool (an int subclass) is refused.
    np = pytest.importorskip("numpy")
    for a, b in zip(ops.mx_quantize(X, np.int64(-1)), ops.mx_quantize(X, -1)):
        assert same_bits(a, b)


# ------------------------------------------------------------------------------------------------
# The MX ops are not differentiable: an input that requires grad is refused under grad mode,
# never a gradient that silently vanishes.

W_BLOCK = torch.randn(64, 96)
_, BLOCK_SCALE = ops.mx_quantize_block(W_BLOCK)


def _requiring(t):
    return t.detach().clone().requires_grad_()


GRAD_CASES = [
    ("mx_quantize", "x", lambda t: ops.mx_quantize(t), X),
    ("mx_quantize_dual", "w", lambda t: ops.mx_quantize_dual(t, E5M2, "rceil"), X),
    ("mx_quantize_block", "w", lambda t: ops.mx_quantize_block(t), X),
    ("mx_dequantize", "data", lambda t: ops.mx_dequantize(t, SCALE), DATA),
    ("mx_dequantize", "scale", lambda t: ops.mx_dequantize(DATA, t), SCALE),
    ("mx_matmul", "a", lambda t: ops.mx_matmul(t, SCALE, DATA, SCALE), DATA),
    ("mx_matmul", "b_scale", lambda t: ops.mx_matmul(DATA, SCALE, DATA, t), SCALE),
    (
        "mx_expand_block_scale",
        "block_scale",
        lambda t: ops.expand_block_scale(t, W_BLOCK.shape, -2),
        BLOCK_SCALE,
    ),
]


def _as_list(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.mark.parametrize(
    "op, arg, call, value", [c for c in GRAD_CASES], ids=[f"{c[0]}-{c[1]}" for c in GRAD_CASES]
)
def test_input_requiring_grad_is_refused_naming_op_and_argument(op, arg, call, value):
    with pytest.raises(
        RuntimeError,
        match=rf"^zrw\.{op} is not differentiable, but its argument "
        rf"{arg} requires grad.*zrw\.nn\.MXLinear.*"
        rf"torch\.autograd\.Function.*{arg}\.detach\(\)",
    ):
        call(_requiring(value))


@pytest.mark.parametrize(
    "op, arg, call, value", [c for c in GRAD_CASES], ids=[f"{c[0]}-{c[1]}" for c in GRAD_CASES]
)
def test_without_grad_the_ops_work_as_before(op, arg, call, value, recwarn):
    expected = _as_list(call(value))
    # requires_grad under no_grad, or a detached input: the same bytes, nothing requires grad.
    with torch.no_grad():
        got = _as_list(call(_requiring(value)))
    assert all(same_bits(g, e) and not g.requires_grad for g, e in zip(got, expected))
    got = _as_list(call(_requiring(value).detach()))
    assert all(same_bits(g, e) and not g.requires_grad for g, e in zip(got, expected))
    # No "autograd kernel was not registered" warning either.
    assert not [w for w in recwarn if "autograd" in str(w.message)]


def test_a_refused_call_in_a_compiled_function_is_refused_too():
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: ops.mx_quantize(t)[0], backend="aot_eager")
    assert same_bits(compiled(X), ops.mx_quantize(X)[0])
    with pytest.raises(Exception, match=r"zrw\.mx_quantize is not differentiable"):
        compiled(_requiring(X))
