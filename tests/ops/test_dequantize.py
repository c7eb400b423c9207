"""zrw.ops.mx_dequantize against zrw.reference, bit for bit, and the quantize/dequantize round trip.

Outputs are compared as raw bytes (``.view(torch.int16/int32)``), except NaN: a NaN's sign and
payload are not part of the contract, so NaN positions must match and their bytes are not compared.
Data bytes cover all 256 encodings of each element format (NaN and, for e5m2, Inf encodings
included) and scale bytes all 256 E8M0 values (0x00 = 2^-127 gives fp32 subnormals; large bytes
overflow the output dtype; 0xFF is NaN).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zrw  # noqa: F401  (registers torch.ops.zrw.*)
from helpers.bitwise import assert_bitwise, same_bits
from helpers.quant import BLOCK, E8M0, NAN_BYTE
from zrw import ops
from zrw import reference as ref

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

ELEM_DTYPES = (E4M3, E5M2)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


def scale_shape(shape, dim):
    s = list(shape)
    s[dim] = -(-s[dim] // BLOCK)
    return tuple(s)


def random_bytes(shape, gen, low=0, high=256):
    return torch.randint(low, high, shape, generator=gen, dtype=torch.int32).to(torch.uint8)


def assert_dequantized(got, expected, what=""):
    """A contiguous output with the expected bits, NaNs at the same places (their bits are not
    compared)."""
    assert got.is_contiguous(), what
    assert_bitwise(got, expected, what, nan_equal=True)


def independent_dequantize(data, scale, dim):
    """data * 2^(byte - 127) per element via math.ldexp in float64: a third, plain computation."""
    dim = dim % data.dim()
    byte = scale.view(torch.uint8).repeat_interleave(BLOCK, dim=dim).narrow(dim, 0, data.shape[dim])
    factor = torch.tensor(
        [math.ldexp(1.0, b - 127) for b in range(255)] + [math.nan], dtype=torch.float64
    )[byte.long()]
    return data.to(torch.float64) * factor


def per_element_block_amax(x, dim):
    """Each element's block amax (blocks of 32 along ``dim``), in x's shape."""
    moved = x.abs().movedim(dim, -1)
    length = moved.shape[-1]
    padded = torch.nn.functional.pad(moved, (0, -length % BLOCK))
    amax = padded.unflatten(-1, (-1, BLOCK)).amax(-1)
    return amax.repeat_interleave(BLOCK, -1)[..., :length].movedim(-1, dim)


# ------------------------------------------------------------------------------------------------
# bit-exact against the reference

SHAPE_DIMS = [
    ((1,), 0),
    ((64,), -1),
    ((1, 1), -1),
    ((1, 33), -1),
    ((33, 1), 0),
    ((31, 65), -1),
    ((31, 65), -2),
    ((100, 70), 0),
    ((100, 70), 1),
    ((3, 40, 5), 1),
    ((3, 40, 5), -1),
    ((3, 40, 5), 0),
    ((2, 3, 33, 7), -2),
    ((2, 3, 7, 33), 3),
    ((4, 1100), -1),
]


def _shape_id(sd):
    shape, dim = sd
    return "x".join(map(str, shape)) + f"-dim{dim}"


@pytest.mark.parametrize("shape_dim", SHAPE_DIMS, ids=_shape_id)
@pytest.mark.parametrize("elem_dtype", ELEM_DTYPES, ids=dtype_id)
def test_dequantize_every_byte_matches_reference(elem_dtype, shape_dim):
    # Random element bytes (every encoding) and random scale bytes (every E8M0 value), for every
    # output dtype: out-of-range products overflow to Inf, tiny ones go subnormal or to zero.
    shape, dim = shape_dim
    gen = torch.Generator().manual_seed(len(shape) * 1000 + shape[0] + dim)
    data = random_bytes(shape, gen).view(elem_dtype)
    scale = random_bytes(scale_shape(shape, dim), gen).view(E8M0)
    for out_dtype in OUT_DTYPES:
        got = ops.mx_dequantize(data, scale, dim, out_dtype)
        expected = ref.mx_dequantize(data, scale, dim, out_dtype)
        assert_dequantized(got, expected, f"{out_dtype}")


@pytest.mark.parametrize("shape_dim", SHAPE_DIMS, ids=_shape_id)
@pytest.mark.parametrize("elem_dtype", ELEM_DTYPES, ids=dtype_id)
def test_dequantize_of_quantized_values_matches_reference(elem_dtype, shape_dim):
    # Realistic scales (from quantizing a wide-range input) and data, plus a NaN block.
    shape, dim = shape_dim
    gen = torch.Generator().manual_seed(7 + len(shape))
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-30, 30, shape, generator=gen))
    x.view(-1)[len(x.view(-1)) // 2] = math.nan
    data, scale = ops.mx_quantize(x.to(torch.bfloat16), dim, elem_dtype, "rceil")
    for out_dtype in OUT_DTYPES:
        got = ops.mx_dequantize(data, scale, dim, out_dtype)
        expected = ref.mx_dequantize(data, scale, dim, out_dtype)
        assert_dequantized(got, expected, f"{out_dtype}")
    exact = ops.mx_dequantize(data, scale, dim, torch.float32).double()
    independent = independent_dequantize(data, scale, dim)
    assert torch.equal(exact.nan_to_num(7.0), independent.nan_to_num(7.0))


@pytest.mark.parametrize("elem_dtype", ELEM_DTYPES, ids=dtype_id)
def test_dequantize_strided_data_and_scale(elem_dtype):
    gen = torch.Generator().manual_seed(11)
    data = random_bytes((96, 70), gen).view(elem_dtype)
    scale = random_bytes((96, 3), gen, 100, 160).view(E8M0)
    # The .t() of a tensor blocked along its other axis: blocks along dim 0 of (70, 96).
    views = [
        (data.t(), scale.t(), 0),
        (data[::2], scale[::2], -1),
        (data[5:, :], scale[5:, :], 1),
        (data[:, :64], scale[:, :2], -1),  # whole blocks sliced off along the blocking axis
    ]
    for d, s, dim in views:
        for out_dtype in OUT_DTYPES:
            assert_dequantized(
                ops.mx_dequantize(d, s, dim, out_dtype), ref.mx_dequantize(d, s, dim, out_dtype)
            )


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("elem_dtype", ELEM_DTYPES, ids=dtype_id)
def test_scale_byte_zero_and_nan(elem_dtype, out_dtype):
    # Every element byte under scale byte 0x00 (2^-127) and 0xFF (the whole block NaN), along
    # each axis.
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(8, 32).view(elem_dtype)
    for dim, scale_bytes in ((-1, [[0], [NAN_BYTE]] * 4), (0, [[0] * 32])):
        scale = torch.tensor(scale_bytes, dtype=torch.uint8).view(E8M0)
        got = ops.mx_dequantize(data, scale, dim, out_dtype)
        assert_dequantized(got, ref.mx_dequantize(data, scale, dim, out_dtype))
        if dim == -1:
            assert got[1::2].isnan().all()
    # Byte 0 in fp32 is exact: element * 2^-127, down to fp32 subnormals.
    scale = torch.zeros(8, 1, dtype=torch.uint8).view(E8M0)
    got = ops.mx_dequantize(data, scale, -1, torch.float32).double()
    assert torch.equal(got.nan_to_num(7.0), (data.double() * 2.0**-127).nan_to_num(7.0))


def test_nan_block_is_whole_block_nan_along_dim0():
    data = torch.ones(70, 3).to(E4M3)
    scale_bytes = [[127, NAN_BYTE, 127], [NAN_BYTE, 127, 127], [127, 127, 0]]
    scale = torch.tensor(scale_bytes, dtype=torch.uint8).view(E8M0)
    got = ops.mx_dequantize(data, scale, 0, torch.float32)
    nan = got.isnan()
    assert nan[:32, 1].all() and nan[32:64, 0].all()
    assert nan.sum() == 64
    assert got[64:, 2].eq(2.0**-127).all()


@pytest.mark.parametrize(
    "shape, dim",
    [((0,), 0), ((0, 64), -1), ((0, 64), 0), ((4, 0), -1), ((4, 0), 0), ((2, 0, 5), 1)],
)
def test_dequantize_empty(shape, dim):
    data = torch.empty(shape, dtype=E4M3)
    scale = torch.empty(scale_shape(shape, dim), dtype=E8M0)
    for out_dtype in OUT_DTYPES:
        got = ops.mx_dequantize(data, scale, dim, out_dtype)
        assert got.shape == shape and got.dtype == out_dtype


# ------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
@pytest.mark.parametrize("elem_dtype", ELEM_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_dequantize_of_quantize_error_is_bounded(dim, elem_dtype, scale_mode):
    gen = torch.Generator().manual_seed(3)
    shape = (40, 70, 3)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-20, 20, shape, generator=gen))
    x = x.to(torch.float32)
    data, scale = ops.mx_quantize(x, dim, elem_dtype, scale_mode)
    restored = ops.mx_dequantize(data, scale, dim, torch.float32)
    # Relative to the block's amax: half an ulp of the top binade (2^-4 e4m3, 2^-3 e5m2), or
    # the floor clip from < 2^(emax+1) down to 1.75 * 2^emax (< 2^-3).
    block_amax = per_element_block_amax(x, dim)
    relative = (restored - x).abs() / block_amax
    assert relative.max() <= 2**-3


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 70),
    dim=st.sampled_from([0, 1, -1, -2]),
    elem_dtype=st.sampled_from(ELEM_DTYPES),
    scale_mode=st.sampled_from(["floor", "rceil"]),
    out_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    spread=st.integers(0, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_requantizing_dequantized_values_is_idempotent(
    rows, cols, dim, elem_dtype, scale_mode, out_dtype, spread, seed
):
    # dequantize is exact in bf16 and fp32 for these scales (fp8 has at most 3 mantissa bits), so
    # quantize(dequantize(q)): floor gives the same bytes, rceil the same values.
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, cols)
    x = torch.randn(shape, generator=gen) * torch.exp2(
        torch.randint(-spread, spread + 1, shape, generator=gen)
    )
    data, scale = ops.mx_quantize(x.to(torch.bfloat16), dim, elem_dtype, scale_mode)
    restored = ops.mx_dequantize(data, scale, dim, out_dtype)
    assert torch.equal(restored.double(), independent_dequantize(data, scale, dim))
    again_data, again_scale = ops.mx_quantize(restored, dim, elem_dtype, scale_mode)
    if scale_mode == "floor":
        assert same_bits(again_data, data)
        assert same_bits(again_scale, scale)
    again = ops.mx_dequantize(again_data, again_scale, dim, out_dtype)
    assert torch.equal(again, restored)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.sampled_from([(5, 64), (33, 7), (2, 40, 3)]),
    elem_dtype=st.sampled_from(ELEM_DTYPES),
    out_dtype=st.sampled_from(OUT_DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_dequantize_matches_reference_on_random_bytes(shape, elem_dtype, out_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    for dim in range(-len(shape), len(shape)):
        data = random_bytes(shape, gen).view(elem_dtype)
        scale = random_bytes(scale_shape(shape, dim), gen).view(E8M0)
        assert_dequantized(
            ops.mx_dequantize(data, scale, dim, out_dtype),
            ref.mx_dequantize(data, scale, dim, out_dtype),
        )
