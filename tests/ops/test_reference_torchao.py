"""zrw.reference against torchao's ``to_mx`` as an independent oracle.

torchao 0.18 implements FLOOR (OCP) and RCEIL (cuBLAS) in its own way (exponent bits of the fp32
amax; ``ceil(log2(amax / max))``), so agreement on ordinary blocks checks the reference from
outside. Where torchao departs from docs/design.md §3 the blocks are left out of the byte
comparison, and each departure has its own test below asserting both what torchao does and what the
spec says: if torchao changes, the test fails and the departure list gets revisited.

torchao only takes bf16/fp32 inputs whose last dim is a multiple of 32, blocked along the last dim.
"""

import math

import pytest
import torch

from helpers.quant import as_bytes
from helpers.torchao_oracle import hard_input, spec_following_blocks, to_mx, torchao_quantize
from zrw import reference as ref

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
NAN_BYTE = 0xFF


def one_block(values, dtype=torch.bfloat16):
    row = torch.zeros(1, ref.BLOCK, dtype=torch.float64)
    row[0, : len(values)] = torch.tensor(values, dtype=torch.float64)
    return row.to(dtype)


def both_quantize_one_block(values, elem_dtype, scale_mode, dtype=torch.bfloat16):
    """(torchao scale byte, torchao elements, spec scale byte, spec elements) for one block."""
    x = one_block(values, dtype)
    torchao_data, torchao_scale = torchao_quantize(x, elem_dtype, scale_mode)
    spec_data, spec_scale = ref.mx_quantize(x, -1, elem_dtype, scale_mode)
    count = len(values)
    return (
        as_bytes(torchao_scale).item(),
        torchao_data[0, :count].double().tolist(),
        as_bytes(spec_scale).item(),
        spec_data[0, :count].double().tolist(),
    )


def assert_same_bytes_on_spec_following_blocks(x, elem_dtype, scale_mode):
    torchao_data, torchao_scale = torchao_quantize(x, elem_dtype, scale_mode)
    spec_data, spec_scale = ref.mx_quantize(x, -1, elem_dtype, scale_mode)
    assert torchao_data.shape == spec_data.shape and torchao_scale.shape == spec_scale.shape

    compared = spec_following_blocks(spec_scale, x)
    assert compared.float().mean() > 0.9, "the comparison must cover most of the input"
    assert torch.equal(as_bytes(torchao_scale)[compared], as_bytes(spec_scale)[compared])
    block_view = (*x.shape[:-1], -1, ref.BLOCK)
    torchao_blocks = as_bytes(torchao_data).reshape(block_view)[compared]
    spec_blocks = as_bytes(spec_data).reshape(block_view)[compared]
    assert torch.equal(torchao_blocks, spec_blocks)


# ------------------------------------------------------------------------------------------------
# agreement


@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_matches_torchao_bytes(dtype, elem_dtype, scale_mode):
    x = hard_input(64, 128, dtype, seed=0)
    assert_same_bytes_on_spec_following_blocks(x, elem_dtype, scale_mode)


@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_reference_matches_torchao_on_the_planted_blocks(scale_mode):
    # The planted rows must be in the comparison, not masked away: check their scales directly.
    x = hard_input(64, 128, torch.bfloat16, seed=0)
    _, spec_scale = ref.mx_quantize(x, -1, E4M3, scale_mode)
    _, torchao_scale = torchao_quantize(x, E4M3, scale_mode)
    planted = [(0, 0), (3, 0), (6, 0), (9, 0), (1, 1), (2, 1)]
    for row, block in planted:
        assert as_bytes(spec_scale)[row, block] != 0
        assert as_bytes(spec_scale)[row, block] == as_bytes(torchao_scale)[row, block]


@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_reference_along_other_dims_matches_torchao_on_the_moved_axis(scale_mode):
    x = hard_input(96, 64, torch.bfloat16, seed=1).view(3, 32, 64)
    spec_data, spec_scale = ref.mx_quantize(x, 1, E4M3, scale_mode)
    moved = x.transpose(1, 2).contiguous()
    torchao_data, torchao_scale = torchao_quantize(moved, E4M3, scale_mode)
    compared = spec_following_blocks(spec_scale.transpose(1, 2), moved)
    assert compared.float().mean() > 0.9
    assert torch.equal(
        as_bytes(spec_scale).transpose(1, 2)[compared], as_bytes(torchao_scale)[compared]
    )
    spec_moved = as_bytes(spec_data).transpose(1, 2).reshape(3, 64, -1, ref.BLOCK)
    torchao_moved = as_bytes(torchao_data).reshape(3, 64, -1, ref.BLOCK)
    assert torch.equal(spec_moved[compared], torchao_moved[compared])


def test_rceil_and_floor_scale_bytes_agree_for_every_bf16_amax():
    # Every positive finite bf16 value as the amax of its own block: scales agree everywhere (the
    # departures below are in elements, Inf blocks and fp32 inputs).
    amax = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = torch.nn.functional.pad(amax[:, None], (0, ref.BLOCK - 1))
    for elem_dtype in (E4M3, E5M2):
        for scale_mode in ("floor", "rceil"):
            _, spec_scale = ref.mx_quantize(x, -1, elem_dtype, scale_mode)
            _, torchao_scale = torchao_quantize(x, elem_dtype, scale_mode)
            assert torch.equal(as_bytes(spec_scale), as_bytes(torchao_scale)), (
                elem_dtype,
                scale_mode,
            )


# ------------------------------------------------------------------------------------------------
# departures of torchao 0.18 from the spec, each pinned down


def test_departure_floor_tiny_amax_divides_by_2_pow_minus_126():
    # amax 2^-120: floor e = -128 clamps to -127, byte 0 in both. The spec divides by 2^-127
    # (2^-120 -> 128, 2^-125 -> 4); torchao clamps its fp32 scale to the smallest normal 2^-126
    # (a Triton subnormal workaround), so its elements come out halved.
    for elem_dtype in (E4M3, E5M2):
        torchao_byte, torchao_values, spec_byte, spec_values = both_quantize_one_block(
            [2.0**-120, 2.0**-125], elem_dtype, "floor"
        )
        assert (torchao_byte, spec_byte) == (0, 0)
        assert torchao_values == [64.0, 2.0]
        assert spec_values == [128.0, 4.0]


def test_departure_rceil_tiny_amax_is_not_scaled_at_all():
    # Same block under rceil: spec e = -128 clamps to -127 (byte 0), elements as above. torchao
    # maps byte 0 to a reciprocal scale of 1.0, i.e. it casts the raw values: all round to 0.
    for elem_dtype in (E4M3, E5M2):
        torchao_byte, torchao_values, spec_byte, spec_values = both_quantize_one_block(
            [2.0**-120, 2.0**-125], elem_dtype, "rceil"
        )
        assert (torchao_byte, spec_byte) == (0, 0)
        assert torchao_values == [0.0, 0.0]
        assert spec_values == [128.0, 4.0]


@pytest.mark.parametrize("infinity", [math.inf, -math.inf])
def test_departure_floor_inf_block_gets_a_finite_scale(infinity):
    # torchao's FLOOR marks only NaN amaxes as 0xFF; an Inf amax has exponent field 255, so its
    # scale is 2^(128 - emax): byte 247 for e4m3, 240 for e5m2. The Inf saturates to the format
    # max, the rest of the block flushes to 0. The spec: byte 0xFF.
    for elem_dtype, torchao_expected_byte in ((E4M3, 247), (E5M2, 240)):
        torchao_byte, torchao_values, spec_byte, spec_values = both_quantize_one_block(
            [infinity, 1.0], elem_dtype, "floor"
        )
        assert torchao_byte == torchao_expected_byte
        assert torchao_values == [math.copysign(ref.ELEM_MAX[elem_dtype], infinity), 0.0]
        assert spec_byte == NAN_BYTE


@pytest.mark.parametrize("infinity", [math.inf, -math.inf])
def test_departure_rceil_inf_block_gets_0xfe(infinity):
    # torchao's RCEIL follows cuBLAS's saturating conversion: Inf amax -> byte 254 (2^127), not NaN.
    for elem_dtype in (E4M3, E5M2):
        torchao_byte, torchao_values, spec_byte, _ = both_quantize_one_block(
            [infinity, 1.0], elem_dtype, "rceil"
        )
        assert torchao_byte == 0xFE
        assert torchao_values == [math.copysign(ref.ELEM_MAX[elem_dtype], infinity), 0.0]
        assert spec_byte == NAN_BYTE


def test_nan_block_matches_the_spec():
    # Not a departure; here so the Inf tests above read against it.
    for scale_mode in ("floor", "rceil"):
        torchao_byte, _, spec_byte, _ = both_quantize_one_block([math.nan, 1.0], E4M3, scale_mode)
        assert torchao_byte == spec_byte == NAN_BYTE


@pytest.mark.parametrize("binade", [100, -100])
@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2])
def test_departure_rceil_fp32_amax_just_above_the_max_mantissa(elem_dtype, binade):
    # fp32 amax = (1.75 + 2^-23) * 2^binade. Its mantissa is above 1.75, so the spec's rceil takes
    # e = binade - emax + 1, and amax / 2^e = (1.75 + 2^-23) * 2^(emax-1) rounds to half the max
    # (224 for e4m3, 28672 for e5m2). torchao computes ceil(log2(amax / max)) in fp32, and
    # log2(2^(binade-emax) * (1 + 2^-23)) rounds to the integer binade - emax: its scale is one too
    # small and the amax saturates to max. bf16 amaxes never come this close above 1.75 (the next
    # bf16 mantissa is 1.7578125), so only fp32 inputs show it.
    amax = (1.75 + 2**-23) * 2.0**binade
    emax, max_elem = ref.ELEM_EMAX[elem_dtype], ref.ELEM_MAX[elem_dtype]
    torchao_byte, torchao_values, spec_byte, spec_values = both_quantize_one_block(
        [amax], elem_dtype, "rceil", dtype=torch.float32
    )
    spec_e = binade - emax + 1
    assert spec_byte == spec_e + 127
    assert spec_values == [max_elem / 2]
    assert torchao_byte == spec_e - 1 + 127
    assert torchao_values == [max_elem]


def test_departure_unsupported_inputs():
    # torchao refuses what the spec accepts: fp16 inputs and a last dim that is not a multiple of 32
    # (the spec: a shorter last block). The oracle therefore covers bf16/fp32 aligned shapes only.
    with pytest.raises(AssertionError, match="float16 is not supported"):
        to_mx(torch.ones(1, 32, dtype=torch.float16), E4M3, ref.BLOCK)
    with pytest.raises(AssertionError, match="must be divisible by block_size"):
        to_mx(torch.ones(1, 33, dtype=torch.bfloat16), E4M3, ref.BLOCK)
    assert ref.mx_quantize(torch.ones(1, 33, dtype=torch.float16))[1].shape == (1, 2)
