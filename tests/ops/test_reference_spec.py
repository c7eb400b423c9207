"""zrw.reference against hand-computed golden values: the spec checked by arithmetic done by hand.

Each expected byte or value below is worked out in a comment from the rules in docs/design.md §3, so
a failure says which rule the reference broke.
"""

import math

import pytest
import torch

from helpers.bitwise import same_bits
from zrw import reference as ref

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E8M0 = torch.float8_e8m0fnu
NAN_BYTE = 0xFF


def one_block(values, dtype=torch.bfloat16, length=32):
    """A (1, length) row holding ``values`` followed by zeros."""
    row = torch.zeros(1, length, dtype=torch.float64)
    row[0, : len(values)] = torch.tensor(values, dtype=torch.float64)
    return row.to(dtype)


def scale_bytes(scale):
    return scale.view(torch.uint8).tolist()


def elements(data, count=None):
    values = data.to(torch.float64).flatten().tolist()
    return values if count is None else values[:count]


def quantize_one_block(values, dtype=torch.bfloat16, **kwargs):
    data, scale = ref.mx_quantize(one_block(values, dtype), **kwargs)
    return scale_bytes(scale)[0][0], elements(data, len(values))


# ------------------------------------------------------------------------------------------------
# self-checks of the torch casts the reference leans on


def test_torch_fp32_to_e4m3_cast_rounds_ties_to_even():
    # 1.0625 is halfway between 1.0 (mantissa 000) and 1.125 (001): even is 1.0.
    # 1.1875 is halfway between 1.125 (001) and 1.25 (010): even is 1.25.
    # 3 * 2^-10 is halfway between the subnormals 2^-9 (odd) and 2^-8 (even); 2^-10 is halfway
    # between 0 and 2^-9.
    ties = torch.tensor([1.0625, 1.1875, -1.0625, 3 * 2**-10, 2**-10])
    assert ties.to(E4M3).float().tolist() == [1.0, 1.25, -1.0, 2**-8, 0.0]


def test_torch_fp32_to_e5m2_cast_rounds_ties_to_even_and_does_not_saturate():
    # e5m2 has 2 mantissa bits: 1.125 lies between 1.0 (00) and 1.25 (01) -> 1.0; 1.375 -> 1.5.
    assert torch.tensor([1.125, 1.375]).to(E5M2).float().tolist() == [1.0, 1.5]
    # torch 2.13's e5m2 cast overflows to Inf: why the reference clamps before casting.
    assert torch.tensor([61440.0]).to(E5M2).float().item() == math.inf


# ------------------------------------------------------------------------------------------------
# scale rules


@pytest.mark.parametrize("k", [-100, -20, -1, 0, 1, 7, 60, 100])
def test_floor_and_rceil_scale_bytes_for_known_amaxes(k):
    # amax = M * 2^k. floor: e = k - 8 for every M in [1, 2). rceil: amax / 2^(k-8) = M * 256 fits
    # under 448 iff M <= 1.75, otherwise it takes e = k - 7.
    floor_byte = k - 8 + 127
    for mantissa, rceil_extra in ((1.0, 0), (1.75, 0), (1.7578125, 1), (1.875, 1), (1.9921875, 1)):
        amax = mantissa * 2.0**k
        assert quantize_one_block([amax], scale_mode="floor")[0] == floor_byte, mantissa
        assert quantize_one_block([amax], scale_mode="rceil")[0] == floor_byte + rceil_extra, (
            mantissa
        )


def test_floor_saturates_and_rceil_does_not():
    # amax 480 = 1.875 * 2^8. floor: e = 0 (byte 127), 480 saturates to 448.
    # rceil: e = 1 (byte 128), 480 / 2 = 240 is exact in e4m3.
    assert quantize_one_block([480.0, -480.0, 1.0], scale_mode="floor") == (
        127,
        [448.0, -448.0, 1.0],
    )
    assert quantize_one_block([480.0, -480.0, 1.0], scale_mode="rceil") == (
        128,
        [240.0, -240.0, 0.5],
    )


def test_elements_round_ties_to_even_through_the_quantizer():
    # amax 256 = 2^8 gives e = 0 in both modes, so the elements are the inputs rounded to e4m3.
    values = [256.0, 1.0625, 1.1875, -1.0625, 3 * 2**-10, 2**-10, -(2**-10), 248.0]
    # 248 is halfway between 240 (mantissa 111) and 256 (1.000 * 2^8): even is 256.
    expected = [256.0, 1.0, 1.25, -1.0, 2**-8, 0.0, -0.0, 256.0]
    for scale_mode in ("floor", "rceil"):
        assert quantize_one_block(values, scale_mode=scale_mode) == (127, expected)


def test_e5m2_golden_values():
    # amax = 1.875 * 2^20, emax 15. floor: e = 5 (byte 132); 1.875 * 2^15 saturates to 57344.
    # rceil: 61440 > 57344 so e = 6 (byte 133); 1.875 * 2^14 is halfway between 1.75 * 2^14 (odd
    # mantissa 11) and 2^15 (even): 32768.
    amax = 1.875 * 2**20
    assert quantize_one_block([amax, 2**5], elem_dtype=E5M2, scale_mode="floor") == (
        132,
        [57344.0, 1.0],
    )
    assert quantize_one_block([amax, 2**5], elem_dtype=E5M2, scale_mode="rceil") == (
        133,
        [32768.0, 0.5],
    )
    # 1.75 * 2^15 = 57344 is the max itself: floor and rceil agree.
    assert quantize_one_block([57344.0], elem_dtype=E5M2, scale_mode="rceil") == (127, [57344.0])


def test_zero_block_gets_byte_zero_and_zero_elements():
    for scale_mode in ("floor", "rceil"):
        for elem_dtype in (E4M3, E5M2):
            byte, values = quantize_one_block(
                [0.0, -0.0], elem_dtype=elem_dtype, scale_mode=scale_mode
            )
            assert byte == 0
            assert values == [0.0, 0.0]


@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_nonfinite_block_gets_nan_scale_and_spares_its_neighbours(special, scale_mode):
    x = torch.ones(2, 64, dtype=torch.bfloat16)
    x[1, 40] = special
    data, scale = ref.mx_quantize(x, scale_mode=scale_mode)
    assert scale_bytes(scale) == [[127 - 8, 127 - 8], [127 - 8, NAN_BYTE]]
    assert torch.equal(data[:, :32].float(), torch.full((2, 32), 256.0))
    # The spec leaves a 0xFF block's elements unspecified; the reference writes NaN so they show.
    assert data[1, 32:].float().isnan().all()


def test_scale_exponent_clamps_at_both_ends():
    # fp32 amax 1.99 * 2^127: floor e = 119 (byte 246), rceil 120; finite input never hits 127.
    assert quantize_one_block([1.99 * 2.0**127], dtype=torch.float32)[0] == 246
    assert quantize_one_block([1.99 * 2.0**127], dtype=torch.float32, scale_mode="rceil")[0] == 247
    # amax 2^-125: floor(log2) - 8 = -133 clamps to -127 (byte 0), so the elements are
    # x * 2^127: 2^-125 -> 4, 2^-126 -> 2, 2^-133 (a bf16 subnormal) -> 2^-6.
    assert quantize_one_block([2.0**-125, 2.0**-126, 2.0**-133]) == (0, [4.0, 2.0, 2.0**-6])


# ------------------------------------------------------------------------------------------------
# input dtypes


def test_fp16_inputs():
    # 65504 = 1.999 * 2^15: floor e = 7 (byte 134), 65504 / 128 = 511.75 saturates to 448.
    assert quantize_one_block([65504.0, 128.0], dtype=torch.float16) == (134, [448.0, 1.0])
    # The smallest fp16 subnormal 2^-24 as amax: e = -32 (byte 95), element 2^8.
    assert quantize_one_block([2.0**-24], dtype=torch.float16) == (95, [256.0])


def test_fp32_inputs_with_subnormals():
    # fp32 subnormal amax: floor(log2) is still exact. 1.5 * 2^-127 -> e clamps to -127 (byte 0),
    # element 1.5. 2^-149 -> element 2^-22, below e4m3's smallest subnormal half (2^-10): 0.
    assert quantize_one_block([1.5 * 2.0**-127, 2.0**-149], dtype=torch.float32) == (0, [1.5, 0.0])
    # A normal block whose small elements are fp32 subnormals: amax 2^-119 gives e = -127, and the
    # subnormal 3 * 2^-140 becomes 3 * 2^-13 -> between e4m3 subnormals 0 and 2^-9: rounds to 0;
    # 2^-136 -> 2^-9 exactly.
    values = [2.0**-119, 3 * 2.0**-140, 2.0**-136]
    assert quantize_one_block(values, dtype=torch.float32) == (0, [256.0, 0.0, 2.0**-9])


def test_fp32_elements_round_once():
    # 1.0625 + 2^-20 is just above the e4m3 tie 1.0625: a single rounding goes up to 1.125.
    assert quantize_one_block([256.0, 1.0625 + 2**-20], dtype=torch.float32)[1] == [256.0, 1.125]


def test_fp32_rceil_amax_just_above_the_format_max():
    # amax = (1.75 + 2^-23) * 2^100 in fp32: mantissa > 1.75, so rceil needs e = 100 - 8 + 1 = 93
    # (byte 220) and the element (1.75 + 2^-23) * 128 = 224.0000153 rounds to 224.
    amax = (1.75 + 2**-23) * 2.0**100
    assert quantize_one_block([amax], dtype=torch.float32, scale_mode="rceil") == (220, [224.0])
    assert quantize_one_block([amax], dtype=torch.float32, scale_mode="floor") == (219, [448.0])


def test_scale_rules_over_every_bf16_amax():
    # Every positive finite bf16 value as its own block's amax. An independent closed form of the
    # rules (both maxes are 1.75 * 2^emax): floor e = E - emax; rceil adds 1 iff M > 1.75.
    amax = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    blocks = torch.nn.functional.pad(amax[:, None], (0, 31))
    mantissa, exponent = torch.frexp(amax.double())
    floor_log2 = exponent.long() - 1
    needs_one_more = (2 * mantissa > 1.75).long()
    for elem_dtype in (E4M3, E5M2):
        floor_e = (floor_log2 - ref.ELEM_EMAX[elem_dtype]).clamp(-127, 127)
        rceil_e = (floor_log2 - ref.ELEM_EMAX[elem_dtype] + needs_one_more).clamp(-127, 127)
        for scale_mode, expected_e in (("floor", floor_e), ("rceil", rceil_e)):
            _, scale = ref.mx_quantize(blocks, elem_dtype=elem_dtype, scale_mode=scale_mode)
            assert torch.equal(scale.view(torch.uint8).flatten().long(), expected_e + 127)


# ------------------------------------------------------------------------------------------------
# shapes, axes and partial blocks


def test_partial_last_block_k33_n1():
    # K = 33: blocks [0, 32) and [32, 33); the lone element sets the second block's amax.
    x = torch.ones(1, 33, dtype=torch.bfloat16)
    x[0, 32] = 0.375  # 1.5 * 2^-2 -> e = -10 (byte 117), element 0.375 * 2^10 = 384
    data, scale = ref.mx_quantize(x)
    assert scale.shape == (1, 2) and scale.dtype == E8M0
    assert data.shape == (1, 33) and data.dtype == E4M3
    assert scale_bytes(scale) == [[119, 117]]
    assert elements(data[0, 32:]) == [384.0]
    # Same thing along dim 0 of the transposed layout (33, 1).
    data_t, scale_t = ref.mx_quantize(x.t().contiguous(), dim=0)
    assert scale_t.shape == (2, 1)
    assert torch.equal(scale_t.view(torch.uint8), scale.view(torch.uint8).t())
    assert torch.equal(data_t.view(torch.uint8), data.view(torch.uint8).t())


def test_partial_tiles_count_missing_elements_as_zero():
    w = torch.full((33, 34), 0.375, dtype=torch.bfloat16)
    w[:32, :32] = 1.0
    data, block_scale = ref.mx_quantize_block(w)
    assert block_scale.shape == (2, 2)
    assert scale_bytes(block_scale) == [[119, 117], [117, 117]]
    assert elements(data[32, 33:]) == [384.0]


def test_any_rank_and_dim_matches_quantizing_the_moved_axis():
    x = torch.randn(3, 40, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    data, scale = ref.mx_quantize(x, dim=1)
    assert data.shape == (3, 40, 5) and scale.shape == (3, 2, 5)
    assert data.is_contiguous() and scale.is_contiguous()
    moved_data, moved_scale = ref.mx_quantize(x.movedim(1, -1).contiguous(), dim=-1)
    assert torch.equal(data.view(torch.uint8), moved_data.movedim(-1, 1).view(torch.uint8))
    assert torch.equal(scale.view(torch.uint8), moved_scale.movedim(-1, 1).view(torch.uint8))
    # Strided input gives the same bytes as its contiguous copy.
    strided = x.transpose(0, 2)
    a, sa = ref.mx_quantize(strided, dim=1)
    b, sb = ref.mx_quantize(strided.contiguous(), dim=1)
    assert same_bits(a, b)
    assert same_bits(sa, sb)


def test_power_of_two_rescale_shifts_scales_only():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    data, scale = ref.mx_quantize(x, scale_mode="rceil")
    data_shifted, scale_shifted = ref.mx_quantize(x * 2.0**-20, scale_mode="rceil")
    assert same_bits(data, data_shifted)
    assert torch.equal(scale.view(torch.uint8).int() - 20, scale_shifted.view(torch.uint8).int())


def test_dual_is_quantize_along_each_weight_axis():
    w = torch.randn(2, 40, 70, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    data_fwd, scale_fwd, data_bwd, scale_bwd = ref.mx_quantize_dual(w, scale_mode="rceil")
    assert scale_fwd.shape == (2, 40, 3) and scale_bwd.shape == (2, 2, 70)
    for (data, scale), dim in (((data_fwd, scale_fwd), -1), ((data_bwd, scale_bwd), -2)):
        expected_data, expected_scale = ref.mx_quantize(w, dim=dim, scale_mode="rceil")
        assert same_bits(data, expected_data)
        assert same_bits(scale, expected_scale)


@pytest.mark.parametrize("shape", [(70, 45), (3, 33, 64), (1, 1)])
@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_block_scale_is_the_max_of_its_row_block_scales(shape, scale_mode):
    # Both rules are monotone in amax, so a 32x32 tile's scale is the largest scale of the 1x32
    # blocks it holds, and its elements are the tile's values divided by that scale.
    w = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    w = w * torch.exp2(torch.randint(-6, 6, shape, generator=torch.Generator().manual_seed(4)))
    data, block_scale = ref.mx_quantize_block(w, scale_mode=scale_mode)
    rows, cols = shape[-2:]
    assert data.shape == w.shape and data.dtype == E4M3 and data.is_contiguous()
    assert block_scale.shape == (*shape[:-2], -(-rows // 32), -(-cols // 32))

    _, row_scale = ref.mx_quantize(w, dim=-1, scale_mode=scale_mode)
    padded = torch.nn.functional.pad(row_scale.view(torch.uint8).float(), (0, 0, 0, -rows % 32))
    tile_max = padded.unflatten(-2, (-1, 32)).amax(dim=-2)
    assert torch.equal(block_scale.view(torch.uint8).float(), tile_max)

    fwd_scale = ref.expand_block_scale(block_scale, w.shape, -1)
    restored = ref.mx_dequantize(data, fwd_scale, dim=-1, out_dtype=torch.float32)
    bwd_restored = ref.mx_dequantize(data, ref.expand_block_scale(block_scale, w.shape, -2), dim=-2)
    assert torch.equal(restored.to(torch.bfloat16), bwd_restored)
    # One requantization with the tile scale must give back the same bytes (floor is idempotent).
    if scale_mode == "floor":
        again, again_scale = ref.mx_quantize_block(restored, scale_mode="floor")
        assert same_bits(again, data)
        assert same_bits(again_scale, block_scale)


def test_block_nonfinite_tile_only():
    w = torch.ones(64, 64)
    w[40, 10] = math.inf
    _, block_scale = ref.mx_quantize_block(w)
    assert scale_bytes(block_scale) == [[119, 119], [NAN_BYTE, 119]]


def test_expand_block_scale_shapes_and_values():
    shape = (33, 65)
    block_scale = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.uint8).view(E8M0)
    fwd = ref.expand_block_scale(block_scale, shape, -1)
    bwd = ref.expand_block_scale(block_scale, shape, -2)
    assert fwd.shape == (33, 3) and bwd.shape == (2, 65)
    assert fwd.dtype == E8M0 and bwd.dtype == E8M0
    assert scale_bytes(fwd)[31] == [1, 2, 3] and scale_bytes(fwd)[32] == [4, 5, 6]
    assert scale_bytes(bwd)[0][63] == 2 and scale_bytes(bwd)[0][64] == 3
    # The non-negative spelling of the axes, and 3-D weights.
    assert torch.equal(
        ref.expand_block_scale(block_scale, shape, 1).view(torch.uint8), fwd.view(torch.uint8)
    )
    stacked = torch.stack([block_scale.view(torch.uint8)] * 4).view(E8M0)
    assert ref.expand_block_scale(stacked, (4, 33, 65), -1).shape == (4, 33, 3)
    assert ref.expand_block_scale(stacked, (4, 33, 65), -2).shape == (4, 2, 65)


def test_expand_block_scale_errors():
    block_scale = torch.zeros(2, 3, dtype=torch.uint8).view(E8M0)
    with pytest.raises(
        ValueError, match=r"block_scale of a weight of shape \(64, 65\) must have shape \(2, 3\)"
    ):
        ref.expand_block_scale(block_scale[:1], (64, 65), -1)
    with pytest.raises(ValueError, match=r"dim must be -1 \(along K\) or -2 \(along N\), found -3"):
        ref.expand_block_scale(block_scale[None], (1, 64, 65), 0)
    with pytest.raises(
        TypeError, match="block_scale must be a torch.float8_e8m0fnu tensor, found torch.uint8"
    ):
        ref.expand_block_scale(block_scale.view(torch.uint8), (64, 65), -1)


# ------------------------------------------------------------------------------------------------
# dequantize and matmul


def test_dequantize_scale_byte_zero_and_nan():
    data = torch.tensor([448.0, 2.0**-9] + [1.0] * 30 + [3.0] * 32).to(E4M3)
    scale = torch.tensor([0, NAN_BYTE], dtype=torch.uint8).view(E8M0)
    out = ref.mx_dequantize(data, scale, out_dtype=torch.float32)
    # 448 * 2^-127 = 1.75 * 2^-119 (normal fp32); 2^-9 * 2^-127 = 2^-136 (an fp32 subnormal).
    assert out[:2].tolist() == [448 * 2.0**-127, 2.0**-136]
    assert out[2:32].eq(2.0**-127).all()
    assert out[32:].isnan().all()
    assert ref.mx_dequantize(data, scale, out_dtype=torch.bfloat16)[0].item() == 448 * 2.0**-127


def test_dequantize_overflows_to_inf_beyond_fp32():
    # Byte 254 = 2^127; 448 * 2^127 exceeds fp32's max. Never produced by quantizing finite input.
    data = torch.tensor([448.0, 1.0]).to(E4M3)
    scale = torch.tensor([254], dtype=torch.uint8).view(E8M0)
    assert ref.mx_dequantize(data, scale, out_dtype=torch.float32).tolist() == [math.inf, 2.0**127]


@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2])
def test_quantize_dequantize_round_trip(scale_mode, elem_dtype):
    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    data, scale = ref.mx_quantize(x, elem_dtype=elem_dtype, scale_mode=scale_mode)
    restored = ref.mx_dequantize(data, scale, out_dtype=torch.float32)
    again_data, again_scale = ref.mx_quantize(
        restored, elem_dtype=elem_dtype, scale_mode=scale_mode
    )
    again = ref.mx_dequantize(again_data, again_scale, out_dtype=torch.float32)
    assert torch.equal(again, restored)
    if scale_mode == "floor":
        assert same_bits(again_data, data)
        assert same_bits(again_scale, scale)
    # Error relative to the block max: at most half an ulp of the top binade (1/16 of it for e4m3,
    # 1/8 for e5m2), or the clip from up to 2^(emax+1) down to 1.75 * 2^emax under floor (1/8).
    relative = (restored - x.float()).abs() / x.float().abs().amax(-1, keepdim=True)
    assert relative.max() <= 2**-3


def test_matmul_with_strided_operands_matches_fp32_matmul():
    gen = torch.Generator().manual_seed(6)
    dy = torch.randn(16, 40, generator=gen).to(torch.bfloat16)  # (M, N)
    w = torch.randn(40, 70, generator=gen).to(torch.bfloat16)  # (N, K)
    dy_data, dy_scale = ref.mx_quantize(dy, dim=-1)
    _, _, w_bwd, w_bwd_scale = ref.mx_quantize_dual(w)
    # dgrad: dx = dy @ W, with W's backward copy (blocked along N) passed as its .t() view (K, N).
    dx = ref.mx_matmul(dy_data, dy_scale, w_bwd.t(), w_bwd_scale.t(), out_dtype=torch.float32)
    expected = ref.mx_dequantize(dy_data, dy_scale, out_dtype=torch.float32) @ ref.mx_dequantize(
        w_bwd, w_bwd_scale, dim=-2, out_dtype=torch.float32
    )
    assert dx.shape == (16, 70) and dx.dtype == torch.float32
    torch.testing.assert_close(dx, expected, rtol=1e-6, atol=1e-6)
    assert ref.mx_matmul(dy_data, dy_scale, w_bwd.t(), w_bwd_scale.t()).dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------
# argument errors


def test_argument_errors_name_the_argument():
    x = torch.ones(4, 32)
    with pytest.raises(TypeError, match=r"x.dtype must be one of .*, found torch.float64"):
        ref.mx_quantize(x.double())
    with pytest.raises(TypeError, match=r"elem_dtype must be one of .*, found torch.float16"):
        ref.mx_quantize(x, elem_dtype=torch.float16)
    with pytest.raises(
        ValueError, match=r"scale_mode must be one of \('floor', 'rceil'\), found 'ceil'"
    ):
        ref.mx_quantize(x, scale_mode="ceil")
    with pytest.raises(ValueError, match=r"dim must be in \[-2, 1\] for a 2-d tensor, found 2"):
        ref.mx_quantize(x, dim=2)
    with pytest.raises(
        ValueError,
        match=r"w must be a weight of shape \(N, K\) or \(E, N, K\), found shape \(32,\)",
    ):
        ref.mx_quantize_dual(x[0])
    data, scale = ref.mx_quantize(x)
    with pytest.raises(
        ValueError,
        match=r"scale for data of shape \(4, 32\) blocked along dim 0 must have shape \(1, 32\), "
        r"found \(4, 1\)",
    ):
        ref.mx_dequantize(data, scale, dim=0)
    with pytest.raises(TypeError, match=r"out_dtype must be one of .*, found torch.float64"):
        ref.mx_dequantize(data, scale, out_dtype=torch.float64)
    with pytest.raises(
        ValueError,
        match=r"a \(M, K\) and b \(N, K\) must share K, found a \(4, 32\) and b \(32, 4\)",
    ):
        ref.mx_matmul(data, scale, data.t(), scale, out_dtype=torch.float32)
