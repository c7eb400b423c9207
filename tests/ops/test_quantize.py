"""zrw.ops.mx_quantize / mx_quantize_dual / mx_quantize_block against zrw.reference, byte for byte.

Every comparison is on the raw bytes (``.view(torch.uint8)``, zero tolerance). The only bytes
left out are the elements of blocks whose scale byte is 0xFF (a block holding NaN or +-Inf):
docs/design.md §3 leaves them unspecified, so there only the scales are compared.

Inputs are built per block along the blocking axis (``make_input``), so that the hard cases land
where they matter: a block's amax mantissa above 1.75 (floor and rceil pick different scales), exact
ties between fp8 neighbours after scaling, subnormal inputs and elements that become fp8
subnormals, the format maxima, signed zeros, NaN and +-Inf.
"""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import zrw  # noqa: F401  (registers torch.ops.zrw.*)
from helpers.quant import (
    BLOCK,
    E8M0,
    ISA_REQUIREMENTS,
    NAN_BYTE,
    RowsOfBlocks,
    as_bytes,
    assert_block_quantization_equal,
    assert_same_quantization,
    cpu_flags,
    dtype_id,
    nan_block_mask,
    stable_seed,
)
from zrw import ops
from zrw import reference as ref

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ELEM_DTYPES = (E4M3, E5M2)
SCALE_MODES = ("floor", "rceil")
FORMATS = [(e, m) for e in ELEM_DTYPES for m in SCALE_MODES]

# Largest finite input exponent per dtype that keeps randn * 2^k finite (|randn| < 8 = 2^3).
MAX_SHIFT = {torch.bfloat16: 40, torch.float16: 12, torch.float32: 40}
MIN_SHIFT = {torch.bfloat16: -40, torch.float16: -12, torch.float32: -40}


# ------------------------------------------------------------------------------------------------
# inputs


def _fp8_positive_values(elem_dtype):
    """Every finite non-negative value of the element format, ascending (float64)."""
    values = torch.arange(0, 0x80, dtype=torch.uint8).view(elem_dtype).double()
    return values[torch.isfinite(values)].sort().values


def fp8_ties(elem_dtype):
    """The midpoints between neighbouring non-negative fp8 values (subnormals included)."""
    v = _fp8_positive_values(elem_dtype)
    return (v[1:] + v[:-1]) / 2


def _special_values(dtype):
    finfo = torch.finfo(dtype)
    smallest_subnormal = finfo.smallest_normal * finfo.eps  # 2^(emin - mantissa bits)
    values = [
        0.0,
        -0.0,
        448.0,
        -448.0,
        finfo.max,
        -finfo.max,
        finfo.smallest_normal,
        -finfo.smallest_normal,
        smallest_subnormal,
        -smallest_subnormal,
        1.0,
        -1.0,
    ]
    values += [57344.0, -57344.0]
    if dtype != torch.float16:  # beyond fp16's range
        values += [torch.finfo(torch.bfloat16).max, 2.0**-127, 1.5 * 2.0**-127]
    return values


def make_input(kind, shape, dim, dtype, seed):
    """An input of ``shape``/``dtype`` whose blocks along ``dim`` are of the given ``kind``.

    Built as rows (R, D) with D = shape[dim], block by block, then moved back into place.
    """
    gen = torch.Generator().manual_seed(seed)
    layout = RowsOfBlocks(shape, dim)
    rows, nblocks = layout.rows, layout.nblocks
    lo, hi = MIN_SHIFT[dtype], MAX_SHIFT[dtype]

    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    def randint(low, high, s):
        return torch.randint(low, high + 1, s, generator=gen).double()

    padded = torch.zeros(rows, nblocks * BLOCK, dtype=torch.float64)
    blocks = padded.view(rows, nblocks, BLOCK)
    if kind == "randn":
        blocks.copy_(randn(rows, nblocks, BLOCK))
    elif kind == "wide_elem":  # every element its own binade
        shift = randint(lo, hi, (rows, nblocks, BLOCK))
        blocks.copy_(randn(rows, nblocks, BLOCK) * torch.exp2(shift))
    elif kind == "wide_block":  # one binade per block
        blocks.copy_(randn(rows, nblocks, BLOCK) * torch.exp2(randint(lo, hi, (rows, nblocks, 1))))
    elif kind == "amax_above_1_75":
        # Each block's amax is m * 2^k with m in (1.75, 2), exactly representable in every input
        # dtype (3 mantissa bits after 1.11): floor saturates it, rceil takes one more exponent.
        blocks.copy_(randn(rows, nblocks, BLOCK).clamp(-1.7, 1.7))
        mantissa = 1.75 + randint(1, 7, (rows, nblocks)) / 32
        sign = torch.where(torch.rand(rows, nblocks, generator=gen) < 0.5, -1.0, 1.0)
        where = torch.randint(0, BLOCK, (rows, nblocks, 1), generator=gen)
        blocks.scatter_(-1, where, (sign * mantissa).unsqueeze(-1))
        blocks.mul_(torch.exp2(randint(lo + 2, hi - 4, (rows, nblocks, 1))))
    elif kind == "subnormal":
        # Input-dtype subnormals: blocks made only of them (scale byte 0 for bf16/fp32), and
        # blocks mixing them with normal values.
        finfo = torch.finfo(dtype)
        quantum = finfo.smallest_normal * finfo.eps
        steps = round(1 / finfo.eps)  # subnormals are k * quantum, 0 < k < steps
        sub = randint(-(steps - 1), steps - 1, (rows, nblocks, BLOCK)) * quantum
        binade = torch.exp2(randint(0, 10, (rows, nblocks, 1)))
        normal = randn(rows, nblocks, BLOCK) * finfo.smallest_normal * binade
        mixed = torch.rand(rows, nblocks, BLOCK, generator=gen) < 0.5
        only_sub = (torch.arange(nblocks) % 2 == 0).view(1, nblocks, 1)
        blocks.copy_(torch.where(only_sub | mixed, sub, normal))
    elif kind == "fp8_subnormal":
        # amax ~ 1 and the rest 2^-8 .. 2^-20 below it: after scaling they are fp8 subnormals
        # (e4m3 below 2^-6, e5m2 below 2^-14) or round to zero.
        small = randn(rows, nblocks, BLOCK) * torch.exp2(randint(-20, -8, (rows, nblocks, BLOCK)))
        small[..., 0] = 1.0 + torch.rand(rows, nblocks, generator=gen).double()
        blocks.copy_(small * torch.exp2(randint(max(lo, -10), min(hi, 10), (rows, nblocks, 1))))
    elif kind == "specials":
        # Format maxima, signed zeros, the input dtype's max, smallest normal and subnormal: one
        # per block on top of small randn, and blocks made only of them.
        special = torch.tensor(_special_values(dtype), dtype=torch.float64)
        blocks.copy_(randn(rows, nblocks, BLOCK) * 2.0**-4)
        pick = special[torch.randint(0, len(special), (rows, nblocks), generator=gen)]
        where = torch.randint(0, BLOCK, (rows, nblocks, 1), generator=gen)
        blocks.scatter_(-1, where, pick.unsqueeze(-1))
        only = torch.rand(rows, nblocks, generator=gen) < 0.3
        all_special = special[torch.randint(0, len(special), (rows, nblocks, BLOCK), generator=gen)]
        blocks.copy_(torch.where(only.unsqueeze(-1), all_special, blocks))
        blocks[..., :1, :] = torch.where(torch.arange(BLOCK) % 2 == 0, 0.0, -0.0)  # +-0 blocks
    elif kind == "nonfinite":
        blocks.copy_(randn(rows, nblocks, BLOCK))
        choice = torch.tensor([math.nan, math.inf, -math.inf, 1.0, 1.0])
        pick = choice[torch.randint(0, len(choice), (rows, nblocks), generator=gen)].double()
        where = torch.randint(0, BLOCK, (rows, nblocks, 1), generator=gen)
        blocks.scatter_(-1, where, pick.unsqueeze(-1))
    elif kind == "ties":
        # Block 0 of a row: e4m3 ties, block 1: e5m2 ties, ... Each block holds the format max
        # (so the scale is exactly 2^k after the block is multiplied by 2^k) and 31 midpoints
        # between fp8 neighbours, signs random: rounding must pick the even neighbour.
        fmt = [E4M3, E5M2]
        shift_range = {
            (torch.float16, E4M3): (-14, 7),
            (torch.float16, E5M2): (-7, 0),
        }
        for b in range(nblocks):
            elem = fmt[b % 2]
            ties = fp8_ties(elem)
            pick = ties[torch.randint(0, len(ties), (rows, BLOCK), generator=gen)]
            pick[:, 0] = ref.ELEM_MAX[elem]
            sign = torch.where(torch.rand(rows, BLOCK, generator=gen) < 0.5, -1.0, 1.0)
            k_lo, k_hi = shift_range.get((dtype, elem), (-60, 60))
            blocks[:, b] = sign * pick * torch.exp2(randint(k_lo, k_hi, (rows, 1)))
    else:
        raise AssertionError(kind)

    values = layout.place(padded)
    x = values.to(dtype)
    if kind == "ties":
        # Ties are only ties if the cast to the input dtype was exact.
        assert torch.equal(x.double(), values), f"ties not exact in {dtype}"
    return x.contiguous()


KINDS = [
    "randn",
    "wide_elem",
    "wide_block",
    "amax_above_1_75",
    "subnormal",
    "fp8_subnormal",
    "specials",
    "nonfinite",
    "ties",
]

# (shape, dim) for mx_quantize: unaligned, tiny, 3-D and 4-D, every spelling of dim.
SHAPE_DIMS = [
    ((1, 1), -1),
    ((1, 33), -1),
    ((33, 1), 0),
    ((100, 70), -1),
    ((100, 70), 0),
    ((31, 65), -1),
    ((31, 65), -2),
    ((64,), 0),
    ((3, 40, 5), 1),
    ((3, 40, 5), 0),
    ((3, 40, 5), -1),
    ((2, 3, 33, 7), 0),
    ((2, 3, 33, 7), 1),
    ((2, 3, 33, 7), -2),
    ((2, 3, 7, 33), -1),
]
# past the kernel's 2048-column chunks and 64-block row groups, and its 32-row strips
BIG_SHAPE_DIMS = [((4, 1100), -1), ((1100, 3), 0), ((3, 2100), -1), ((40, 2112), 0)]


def kind_dtype_shape_matrix(kinds, shapes, big_shapes):
    """(kind, dtype, shape) parameters: every dtype on the small shapes; on the big ones (there to
    cross the kernel's column chunk, whose logic does not depend on the dtype) one dtype per kind,
    rotating, so each dtype still meets each big shape."""
    params = []
    for i, kind in enumerate(kinds):
        for shape in shapes:
            params += [(kind, dtype, shape) for dtype in INPUT_DTYPES]
        for j, shape in enumerate(big_shapes):
            params.append((kind, INPUT_DTYPES[(i + j) % len(INPUT_DTYPES)], shape))
    return params


def matrix_ids(params, shape_id):
    return [f"{kind}-{dtype_id(dtype)}-{shape_id(shape)}" for kind, dtype, shape in params]


def _shape_id(sd):
    shape, dim = sd
    return "x".join(map(str, shape)) + f"-dim{dim}"


# ------------------------------------------------------------------------------------------------
# mx_quantize


QUANTIZE_MATRIX = kind_dtype_shape_matrix(KINDS, SHAPE_DIMS, BIG_SHAPE_DIMS)


@pytest.mark.parametrize(
    "kind, dtype, shape_dim", QUANTIZE_MATRIX, ids=matrix_ids(QUANTIZE_MATRIX, _shape_id)
)
def test_quantize_matches_reference(kind, dtype, shape_dim):
    shape, dim = shape_dim
    x = make_input(kind, shape, dim, dtype, seed=stable_seed(kind, shape, dim, dtype))
    for elem_dtype, scale_mode in FORMATS:
        got = ops.mx_quantize(x, dim, elem_dtype, scale_mode)
        expected = ref.mx_quantize(x, dim, elem_dtype, scale_mode)
        assert_same_quantization(got, expected, dim, f"{elem_dtype} {scale_mode}")


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=dtype_id)
def test_floor_and_rceil_differ_where_the_amax_mantissa_exceeds_1_75(dtype):
    # The input really exercises the difference (checked on the reference), and the kernel
    # follows both rules.
    x = make_input("amax_above_1_75", (16, 96), -1, dtype, seed=1)
    for elem_dtype in ELEM_DTYPES:
        floor = ops.mx_quantize(x, -1, elem_dtype, "floor")
        rceil = ops.mx_quantize(x, -1, elem_dtype, "rceil")
        shift = as_bytes(rceil[1]).int() - as_bytes(floor[1]).int()
        assert shift.eq(1).all()
        assert_same_quantization(floor, ref.mx_quantize(x, -1, elem_dtype, "floor"), -1)
        assert_same_quantization(rceil, ref.mx_quantize(x, -1, elem_dtype, "rceil"), -1)


def test_ties_round_to_even_in_the_kernel():
    # A hand-checked block: amax 448 (scale 2^0 in both modes, e4m3), then ties.
    # 1.0625 -> 1.0 (even), 1.1875 -> 1.25, 3*2^-10 -> 2^-8 (subnormals), 2^-10 -> 0,
    # 432 (between 416 and 448) -> 448, 232 (between 224 and 240) -> 224.
    values = [448.0, 1.0625, 1.1875, 3 * 2**-10, 2**-10, -(2**-10), 432.0, 232.0, -1.0625]
    x = torch.zeros(1, 32)
    x[0, : len(values)] = torch.tensor(values)
    for scale_mode in SCALE_MODES:
        data, scale = ops.mx_quantize(x.to(torch.bfloat16), -1, E4M3, scale_mode)
        assert as_bytes(scale).tolist() == [[127]]
        got = data[0, : len(values)].double().tolist()
        assert got == [448.0, 1.0, 1.25, 2**-8, 0.0, -0.0, 448.0, 224.0, -1.0]
        assert math.copysign(1.0, got[5]) == -1.0  # -2^-10 rounds to -0, sign kept


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=dtype_id)
def test_nonfinite_blocks_get_nan_scale_and_spare_their_neighbours(dtype):
    x = torch.ones(3, 96, dtype=dtype)
    x[0, 5] = math.nan
    x[1, 40] = math.inf
    x[2, 95] = -math.inf
    for elem_dtype, scale_mode in FORMATS:
        data, scale = ops.mx_quantize(x, -1, elem_dtype, scale_mode)
        normal = 127 - ref.ELEM_EMAX[elem_dtype]
        assert as_bytes(scale).tolist() == [
            [NAN_BYTE, normal, normal],
            [normal, NAN_BYTE, normal],
            [normal, normal, NAN_BYTE],
        ]
        finite = ~nan_block_mask(scale, x.shape, -1)
        assert data.double()[finite].eq(2.0 ** ref.ELEM_EMAX[elem_dtype]).all()


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=dtype_id)
def test_signed_zero_blocks(dtype):
    x = torch.zeros(2, 64, dtype=dtype)
    x[1] = -0.0
    x[0, 40] = -0.0
    for elem_dtype, scale_mode in FORMATS:
        data, scale = ops.mx_quantize(x, -1, elem_dtype, scale_mode)
        assert as_bytes(scale).eq(0).all()
        expected, _ = ref.mx_quantize(x, -1, elem_dtype, scale_mode)
        assert torch.equal(as_bytes(data), as_bytes(expected))
        assert as_bytes(data)[1].eq(0x80).all() and as_bytes(data)[0, 40].item() == 0x80


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=dtype_id)
def test_format_and_dtype_maxima(dtype):
    # Each value alone in its block, and alongside 1.0: the scale must never overflow E8M0.
    finfo = torch.finfo(dtype)
    values = [448.0, 57344.0, finfo.max]
    if dtype != torch.float16:
        values.append(torch.finfo(torch.bfloat16).max)
    x = torch.zeros(2 * len(values), 32, dtype=torch.float64)
    for i, v in enumerate(values):
        x[2 * i, 0] = v
        x[2 * i + 1, :2] = torch.tensor([-v, 1.0])
    x = x.to(dtype)
    for elem_dtype, scale_mode in FORMATS:
        got = ops.mx_quantize(x, -1, elem_dtype, scale_mode)
        assert as_bytes(got[1]).lt(NAN_BYTE).all()
        assert_same_quantization(got, ref.mx_quantize(x, -1, elem_dtype, scale_mode), -1)


# ------------------------------------------------------------------------------------------------
# non-contiguous inputs


def _views(x):
    """Strided views of a 2-D tensor: transposed, stepped slices, an offset, a broadcast."""
    return {
        "t": x.t(),
        "step_rows": x[::2],
        "step_cols": x[:, 1::3],
        "step_both_t": x[1::2, ::3].t(),
        "offset": x[3:, 5:],
        "expand": x[:1].expand(7, -1),
    }


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=dtype_id)
def test_quantize_non_contiguous_inputs(dtype):
    x = make_input("wide_block", (70, 100), -1, dtype, seed=3)
    x[5, 7] = math.nan
    for name, view in _views(x).items():
        for dim in (0, 1, -1):
            for elem_dtype, scale_mode in FORMATS:
                what = f"{name} dim {dim} {elem_dtype} {scale_mode}"
                got = ops.mx_quantize(view, dim, elem_dtype, scale_mode)
                assert_same_quantization(
                    got, ref.mx_quantize(view, dim, elem_dtype, scale_mode), dim, what
                )
                contiguous = ops.mx_quantize(view.contiguous(), dim, elem_dtype, scale_mode)
                assert torch.equal(as_bytes(got[0]), as_bytes(contiguous[0])), what
                assert torch.equal(as_bytes(got[1]), as_bytes(contiguous[1])), what


def test_quantize_non_contiguous_3d_and_4d():
    x = make_input("wide_elem", (3, 40, 20, 2), -1, torch.bfloat16, seed=4)
    views = [x.permute(2, 0, 3, 1), x[:, ::3, 1::2], x.transpose(1, 2)[..., 0]]
    for view in views:
        for dim in range(-view.dim(), view.dim()):
            got = ops.mx_quantize(view, dim, E4M3, "rceil")
            assert_same_quantization(got, ref.mx_quantize(view, dim, E4M3, "rceil"), dim)


# ------------------------------------------------------------------------------------------------
# mx_quantize_dual


WEIGHT_SHAPES = [(1, 1), (1, 33), (33, 1), (100, 70), (31, 65), (3, 40, 70), (2, 33, 65), (1, 1, 1)]
# past the kernel's 2048-column chunks
BIG_WEIGHT_SHAPES = [(40, 1100), (2, 40, 530), (40, 2100), (33, 4160)]
DUAL_KINDS = [
    "randn",
    "wide_elem",
    "wide_block",
    "amax_above_1_75",
    "subnormal",
    "specials",
    "nonfinite",
    "ties",
]


def _weight_id(shape):
    return "x".join(map(str, shape))


WEIGHT_MATRIX = kind_dtype_shape_matrix(DUAL_KINDS, WEIGHT_SHAPES, BIG_WEIGHT_SHAPES)


@pytest.mark.parametrize(
    "kind, dtype, shape", WEIGHT_MATRIX, ids=matrix_ids(WEIGHT_MATRIX, _weight_id)
)
def test_dual_matches_reference_and_single_axis(kind, dtype, shape):
    # Blocks built along K for half the kinds' hard cases, along N for the other half.
    dim = -1 if DUAL_KINDS.index(kind) % 2 else -2
    w = make_input(kind, shape, dim, dtype, seed=stable_seed(kind, shape, dtype))
    for elem_dtype, scale_mode in FORMATS:
        what = f"{elem_dtype} {scale_mode}"
        data_fwd, scale_fwd, data_bwd, scale_bwd = ops.mx_quantize_dual(w, elem_dtype, scale_mode)
        exp = ref.mx_quantize_dual(w, elem_dtype, scale_mode)
        assert_same_quantization((data_fwd, scale_fwd), exp[:2], -1, "fwd " + what)
        assert_same_quantization((data_bwd, scale_bwd), exp[2:], -2, "bwd " + what)
        # Byte for byte the two single-axis kernels, 0xFF blocks included.
        for (data, scale), d in (((data_fwd, scale_fwd), -1), ((data_bwd, scale_bwd), -2)):
            single_data, single_scale = ops.mx_quantize(w, d, elem_dtype, scale_mode)
            assert torch.equal(as_bytes(data), as_bytes(single_data)), f"dim {d} {what}"
            assert torch.equal(as_bytes(scale), as_bytes(single_scale)), f"dim {d} {what}"


def test_dual_non_contiguous_weights():
    w = make_input("wide_elem", (2, 70, 100), -1, torch.bfloat16, seed=5)
    for view in (w.transpose(-1, -2), w[:, ::2, 1::3], w[1], w[0].t(), w.permute(1, 0, 2)):
        for elem_dtype, scale_mode in FORMATS:
            got = ops.mx_quantize_dual(view, elem_dtype, scale_mode)
            exp = ref.mx_quantize_dual(view, elem_dtype, scale_mode)
            assert_same_quantization(got[:2], exp[:2], -1)
            assert_same_quantization(got[2:], exp[2:], -2)


# ------------------------------------------------------------------------------------------------
# mx_quantize_block


@pytest.mark.parametrize(
    "kind, dtype, shape", WEIGHT_MATRIX, ids=matrix_ids(WEIGHT_MATRIX, _weight_id)
)
def test_block_matches_reference(kind, dtype, shape):
    dim = -1 if DUAL_KINDS.index(kind) % 2 else -2
    w = make_input(kind, shape, dim, dtype, seed=stable_seed(kind, shape, dtype, "block"))
    for elem_dtype, scale_mode in FORMATS:
        what = f"{elem_dtype} {scale_mode}"
        data, block_scale = ops.mx_quantize_block(w, elem_dtype, scale_mode)
        exp = ref.mx_quantize_block(w, elem_dtype, scale_mode)
        assert data.dtype == elem_dtype and data.shape == w.shape, what
        assert block_scale.shape == (*shape[:-2], -(-shape[-2] // 32), -(-shape[-1] // 32)), what
        assert_block_quantization_equal((data, block_scale), exp, shape, what)


@pytest.mark.parametrize("shape", [(70, 100), (3, 33, 65), (1, 1), (64, 64)], ids=_weight_id)
@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("elem_dtype", ELEM_DTYPES, ids=dtype_id)
def test_block_one_scale_per_tile_serves_both_axes(shape, elem_dtype, scale_mode):
    # Every 1x32 and 32x1 block inside a tile has the tile's scale: the per-axis scales from
    # expand_block_scale dequantize the one data tensor to the reference's values along either
    # axis, and the wrapper's expansion equals the reference's.
    w = make_input("wide_block", shape, -1, torch.bfloat16, seed=6)
    data, block_scale = ops.mx_quantize_block(w, elem_dtype, scale_mode)
    ref_data, ref_block_scale = ref.mx_quantize_block(w, elem_dtype, scale_mode)
    for dim in (-1, -2):
        scale = ops.expand_block_scale(block_scale, w.shape, dim)
        ref_scale = ref.expand_block_scale(ref_block_scale, w.shape, dim)
        assert torch.equal(as_bytes(scale), as_bytes(ref_scale))
        got = ops.mx_dequantize(data, scale, dim, torch.float32)
        expected = ref.mx_dequantize(ref_data, ref_scale, dim, torch.float32)
        assert torch.equal(got, expected)
    # Both expansions describe the same values.
    fwd_scale = ops.expand_block_scale(block_scale, w.shape, -1)
    bwd_scale = ops.expand_block_scale(block_scale, w.shape, -2)
    fwd = ops.mx_dequantize(data, fwd_scale, -1, torch.float32)
    bwd = ops.mx_dequantize(data, bwd_scale, -2, torch.float32)
    assert torch.equal(fwd, bwd)


def test_block_nonfinite_tile_only():
    w = torch.ones(2, 64, 70)
    w[1, 40, 10] = math.inf
    w[0, 0, 69] = math.nan
    data, block_scale = ops.mx_quantize_block(w)
    assert as_bytes(block_scale).tolist() == [
        [[119, 119, NAN_BYTE], [119, 119, 119]],
        [[119, 119, 119], [NAN_BYTE, 119, 119]],
    ]
    assert_block_quantization_equal((data, block_scale), ref.mx_quantize_block(w), w.shape)


def test_block_non_contiguous_weights():
    w = make_input("wide_elem", (2, 70, 100), -1, torch.float32, seed=7)
    for view in (w.transpose(-1, -2), w[:, ::2, 1::3], w[0].t()):
        for elem_dtype, scale_mode in FORMATS:
            got = ops.mx_quantize_block(view, elem_dtype, scale_mode)
            exp = ref.mx_quantize_block(view, elem_dtype, scale_mode)
            assert_block_quantization_equal(got, exp, view.shape)


# ------------------------------------------------------------------------------------------------
# empty tensors


@pytest.mark.parametrize(
    "shape, dim",
    [
        ((0,), 0),
        ((0, 64), -1),
        ((0, 64), 0),
        ((4, 0), -1),
        ((4, 0), 0),
        ((2, 0, 5), 1),
        ((2, 0, 5), -1),
        ((0, 0), 0),
    ],
)
def test_quantize_empty(shape, dim):
    x = torch.empty(shape, dtype=torch.bfloat16)
    data, scale = ops.mx_quantize(x, dim)
    exp_data, exp_scale = ref.mx_quantize(x, dim)
    assert data.shape == exp_data.shape == x.shape and data.dtype == E4M3
    assert scale.shape == exp_scale.shape and scale.dtype == E8M0


@pytest.mark.parametrize("shape", [(0, 64), (64, 0), (0, 0), (0, 3, 5), (2, 0, 40), (2, 40, 0)])
def test_dual_and_block_empty(shape):
    w = torch.empty(shape, dtype=torch.bfloat16)
    got = ops.mx_quantize_dual(w)
    exp = ref.mx_quantize_dual(w)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in exp]
    got = ops.mx_quantize_block(w)
    exp = ref.mx_quantize_block(w)
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in exp]
    # the per-axis scales of an empty 32x32 weight (the cache expands them for every entry),
    # on the op, the reference and the fake
    for dim in (-1, -2):
        scale = ops.expand_block_scale(got[1], shape, dim)
        want = ref.expand_block_scale(exp[1], shape, dim)
        fake = ops.expand_block_scale(got[1].to("meta"), shape, dim)
        assert scale.shape == want.shape == fake.shape and scale.dtype == E8M0


# ------------------------------------------------------------------------------------------------
# properties (hypothesis)


formats = st.sampled_from(FORMATS)
input_dtypes = st.sampled_from(INPUT_DTYPES)


@st.composite
def quantize_cases(draw, max_shift=None):
    """(x, dim, elem_dtype, scale_mode): a random 1-3-D finite tensor with a wide exponent range."""
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(-ndim, ndim - 1))
    # Up to 70 along the blocking axis, small elsewhere: a few thousand elements at most.
    shape = [draw(st.integers(1, 9)) for _ in range(ndim)]
    shape[dim] = draw(st.integers(1, 70))
    shape = tuple(shape)
    dtype = draw(input_dtypes)
    kind = draw(st.sampled_from(["randn", "wide_elem", "wide_block", "amax_above_1_75", "ties"]))
    seed = draw(st.integers(0, 2**31 - 1))
    x = make_input(kind, shape, dim, dtype, seed)
    elem_dtype, scale_mode = draw(formats)
    return x, dim, elem_dtype, scale_mode


@settings(max_examples=25, deadline=None)
@given(
    values=st.lists(st.floats(width=32), min_size=1, max_size=140),
    rows=st.integers(1, 3),
    dtype=input_dtypes,
    fmt=formats,
)
def test_quantize_matches_reference_on_arbitrary_floats(values, rows, dtype, fmt):
    # Any fp32 bit pattern hypothesis likes (NaN, Inf, subnormals, extremes), cast to the dtype.
    elem_dtype, scale_mode = fmt
    x = torch.tensor(values * rows, dtype=torch.float32).view(rows, -1).to(dtype)
    for dim in (-1, 0):
        got = ops.mx_quantize(x, dim, elem_dtype, scale_mode)
        assert_same_quantization(got, ref.mx_quantize(x, dim, elem_dtype, scale_mode), dim)


@settings(max_examples=25, deadline=None)
@given(case=quantize_cases())
def test_scales_are_powers_of_two(case):
    x, dim, elem_dtype, scale_mode = case
    _, scale = ops.mx_quantize(x, dim, elem_dtype, scale_mode)
    values = scale.to(torch.float64)
    byte = as_bytes(scale).long()
    assert torch.isfinite(values).all()  # finite input never gets the NaN byte
    mantissa, exponent = torch.frexp(values)
    assert mantissa.eq(0.5).all()
    assert torch.equal(exponent.long() - 1, byte - 127)


@settings(max_examples=25, deadline=None)
@given(case=quantize_cases(), k=st.integers(-6, 6))
def test_power_of_two_rescale_shifts_scales_and_keeps_elements(case, k):
    x, dim, elem_dtype, scale_mode = case
    data, scale = ops.mx_quantize(x, dim, elem_dtype, scale_mode)
    byte = as_bytes(scale).int()
    shifted = x * 2.0**k
    # Stay where the property holds: x * 2^k exact in the input dtype (no overflow, no bits lost
    # in subnormals) and every non-zero scale byte still in [1, 254] after the shift (no clamp).
    assume(torch.equal(shifted.double(), x.double() * 2.0**k))
    nonzero = byte != 0
    assume((((byte + k >= 1) & (byte + k <= 254)) | ~nonzero).all())
    data_k, scale_k = ops.mx_quantize(shifted, dim, elem_dtype, scale_mode)
    assert torch.equal(as_bytes(data_k), as_bytes(data))
    assert torch.equal(as_bytes(scale_k).int(), torch.where(nonzero, byte + k, byte))


@settings(max_examples=25, deadline=None)
@given(case=quantize_cases())
def test_quantize_of_dequantize_is_idempotent(case):
    # floor: the same bytes; rceil: the same values (a block may take a smaller scale).
    x, dim, elem_dtype, scale_mode = case
    data, scale = ops.mx_quantize(x, dim, elem_dtype, scale_mode)
    restored = ops.mx_dequantize(data, scale, dim, torch.float32)
    again_data, again_scale = ops.mx_quantize(restored, dim, elem_dtype, scale_mode)
    if scale_mode == "floor":
        assert torch.equal(as_bytes(again_data), as_bytes(data))
        assert torch.equal(as_bytes(again_scale), as_bytes(scale))
    again = ops.mx_dequantize(again_data, again_scale, dim, torch.float32)
    assert torch.equal(again, restored)


# ------------------------------------------------------------------------------------------------
# bf16: every element pattern under every scale a block can take
#
# The AVX2 kernel encodes bf16 in 16-bit lanes (rounding the mantissa once, then shifting the
# exponent by the block scale) and falls back to the exact path when an element would be an fp8
# subnormal; these inputs put every bf16 bit pattern into blocks whose amax (one "anchor" per
# block) ranges from bf16 subnormals to the largest finite bf16, with mantissas at and above 1.75,
# so each pattern meets each fast/exact boundary. Blocks run along the rows for mx_quantize(dim=-1)
# and the row plane of the dual; the transposed copy puts them down the columns.

BF16_ANCHORS = [
    2.0**-133,  # bf16 subnormal amax: scale 0x00, elements scaled by 2^127
    2.0**-126 * 1.5,  # smallest normal binade
    2.0**-120 * 1.875,  # scale clamps at -127
    2.0**-20 * 1.75,
    1.0,
    1.875,  # amax mantissa above 1.75: floor and rceil differ
    448.0,
    57344.0 * 1.9921875,
    2.0**100 * 1.0078125,
    3.3895313892515355e38,  # largest finite bf16
]


def _every_pattern_blocks(dtype, anchor):
    """Rows of 32 of a 16-bit dtype: the anchor first (sign alternating by row), then every
    finite bit pattern of magnitude <= anchor."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = bits[torch.isfinite(bits) & (bits.float().abs() <= anchor)]
    return _blocks_under(finite, anchor)


def _blocks_under(values, anchor):
    """Rows of 32: +-anchor first, then `values` (all of magnitude <= anchor), zero padded."""
    rows = -(-values.numel() // (BLOCK - 1))
    body = torch.zeros(rows * (BLOCK - 1), dtype=values.dtype)
    body[: values.numel()] = values
    anchors = torch.full((rows, 1), anchor, dtype=values.dtype)
    anchors[1::2] *= -1
    return torch.cat([anchors, body.view(rows, BLOCK - 1)], dim=1)


def _assert_both_axes_match_reference(x, elem_dtype, scale_mode):
    """mx_quantize and mx_quantize_dual of x (blocks along its rows) and of its transposed copy
    (the same blocks down the columns) equal the reference byte for byte."""
    for blocked, dim in ((x, -1), (x.t().contiguous(), 0)):
        assert_same_quantization(
            ops.mx_quantize(blocked, dim, elem_dtype, scale_mode),
            ref.mx_quantize(blocked, dim, elem_dtype, scale_mode),
            dim,
            f"mx_quantize dim={dim}",
        )
        got = ops.mx_quantize_dual(blocked, elem_dtype, scale_mode)
        exp = ref.mx_quantize_dual(blocked, elem_dtype, scale_mode)
        assert_same_quantization(got[:2], exp[:2], -1, "mx_quantize_dual fwd")
        assert_same_quantization(got[2:], exp[2:], -2, "mx_quantize_dual bwd")


@pytest.mark.parametrize(
    "elem_dtype,scale_mode", FORMATS, ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else v
)
def test_bf16_every_element_pattern_under_every_block_scale(elem_dtype, scale_mode):
    x = torch.cat([_every_pattern_blocks(torch.bfloat16, a) for a in BF16_ANCHORS])
    x = torch.cat(
        [x, torch.tensor([[math.inf] + [1.0] * 31, [math.nan] + [-2.0] * 31], dtype=torch.bfloat16)]
    )
    _assert_both_axes_match_reference(x, elem_dtype, scale_mode)
    tiles = x[: x.shape[0] // BLOCK * BLOCK]
    assert_block_quantization_equal(
        ops.mx_quantize_block(tiles, elem_dtype, scale_mode),
        ref.mx_quantize_block(tiles, elem_dtype, scale_mode),
        tiles.shape,
        "mx_quantize_block",
    )


# The kernels encode the fast path first and list the runs that need the exact path, which are
# encoded after each group of 64 row blocks and after each strip chunk (32 rows x 2048 columns):
# these matrices fill whole groups and chunks with such runs (every run of the first strip) next
# to a strip of ordinary values, at a width of two chunks and of two chunks plus a partial block.


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("width", [4096, 4096 + 17], ids=["whole_chunks", "partial_block"])
def test_runs_left_to_the_exact_path_fill_whole_groups_and_chunks(dtype, width):
    gen = torch.Generator().manual_seed(stable_seed("exact-path-lists"))
    rows = 64
    x = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    # Rows 0-31 (a whole strip): tiny elements and a +-1 on the diagonal of every 32x32
    # tile, so every run along a row and down a column holds one +-1 and 31 elements that become
    # fp8 subnormals or zero: all of them go to the exact path.
    tiny = torch.rand(32, width, generator=gen, dtype=torch.float64) * 2.0**-20
    i, j = torch.meshgrid(torch.arange(32), torch.arange(width), indexing="ij")
    tiny[i % BLOCK == j % BLOCK] = torch.where(
        j[i % BLOCK == j % BLOCK] % 3 == 0, -1.0, 1.0
    ).double()
    x[:32] = tiny
    x = x.to(dtype)
    for elem_dtype, scale_mode in ((E4M3, "floor"), (E5M2, "rceil")):
        _assert_both_axes_match_reference(x, elem_dtype, scale_mode)
        assert_block_quantization_equal(
            ops.mx_quantize_block(x, elem_dtype, scale_mode),
            ref.mx_quantize_block(x, elem_dtype, scale_mode),
            x.shape,
            "mx_quantize_block",
        )
    if dtype == torch.float32:  # an FP32 master: its keys are staged like fp32's
        got = ops.mx_quantize_dual_from_master(x, torch.bfloat16, E4M3, "floor")
        exp = ref.mx_quantize_dual_from_master(x, torch.bfloat16, E4M3, "floor")
        assert_same_quantization(got[:2], exp[:2], -1, "mx_quantize_dual_from_master fwd")
        assert_same_quantization(got[2:], exp[2:], -2, "mx_quantize_dual_from_master bwd")


# fp32 and fp16 go through the same 16-bit encode after staging as "jammed bf16" (the OR of the
# 16 dropped mantissa bits kept in the lowest bf16 bit). These inputs make that jam decide:
# every bf16 pattern with low halves 0, 1, 0x8000 and 0xFFFF (ties broken by a low bit), block
# amaxes with mantissa exactly 1.75 and 1.75 plus one ulp (rceil picks different scales), and fp32
# subnormals in blocks whose amax is an fp32 subnormal (elements scaled up by 2^127).

FP32_ANCHOR_BITS = [
    0x00000003,
    0x007FFFFF,
    0x00E00000,
    0x00E00001,
    0x3FE00000,
    0x3FE00001,
    0x43E00000,
    0x47600001,
    0x7F7FFFFF,
]


def _fp32_blocks_under(anchor_bits, gen):
    anchor = torch.tensor([anchor_bits], dtype=torch.int32).view(torch.float32).item()
    bits = torch.arange(0, 1 << 16, dtype=torch.int64)
    low = torch.tensor([0, 1, 0x8000, 0xFFFF], dtype=torch.int64)
    patterns = ((bits[:, None] << 16) | low[None, :]).view(-1)
    values = patterns.to(torch.int32).view(torch.float32)
    values = values[torch.isfinite(values) & (values.abs() <= anchor)]
    return _blocks_under(values[torch.randperm(values.numel(), generator=gen)[:200_000]], anchor)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16], ids=dtype_id)
@pytest.mark.parametrize(
    "elem_dtype,scale_mode", FORMATS, ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else v
)
def test_fp32_fp16_rounding_sticky_bits_and_subnormals(src_dtype, elem_dtype, scale_mode):
    gen = torch.Generator().manual_seed(
        stable_seed("jam", str(src_dtype), str(elem_dtype), scale_mode)
    )
    if src_dtype == torch.float32:
        x = torch.cat([_fp32_blocks_under(a, gen) for a in FP32_ANCHOR_BITS])
    else:
        x = torch.cat(
            [
                _every_pattern_blocks(torch.float16, a)
                for a in (2.0**-24, 2.0**-14 * 1.75, 1.875, 448.0, 65504.0)
            ]
        )
    _assert_both_axes_match_reference(x, elem_dtype, scale_mode)


# ------------------------------------------------------------------------------------------------
# a large weight: the streaming paths (non-temporal stores from 4 Mi elements on AVX-512)


def test_large_weight_every_layout_matches_reference():
    gen = torch.Generator().manual_seed(23)
    n = k = 2048
    w = torch.randn(n, k, generator=gen)
    exps = torch.randint(-12, 13, (n, k // 32, 1), generator=gen).float()
    w = w * torch.exp2(exps).repeat_interleave(32, -1).view(n, k)
    flat = w.view(-1)
    flat[::4099] = 0.0
    flat[1::8191] = -0.0
    flat[3::30011] = 2.0**-130  # a bf16 subnormal
    flat[5::16411] = flat[5::16411] * 2.0**-20  # far below its block's amax
    flat[7::1_000_003] = math.nan
    flat[11::1_500_007] = -math.inf
    x = w.to(torch.bfloat16)
    for elem_dtype, scale_mode in ((E4M3, "floor"), (E5M2, "rceil")):
        what = f"{elem_dtype} {scale_mode}"
        exp_dual = ref.mx_quantize_dual(x, elem_dtype, scale_mode)
        for got in (
            ops.mx_quantize_dual(x, elem_dtype, scale_mode),
            ops.mx_quantize_dual_from_master(w, torch.bfloat16, elem_dtype, scale_mode),
        ):
            assert_same_quantization(got[:2], exp_dual[:2], -1, "fwd " + what)
            assert_same_quantization(got[2:], exp_dual[2:], -2, "bwd " + what)
        for dim, exp in ((-1, exp_dual[:2]), (0, exp_dual[2:])):
            assert_same_quantization(
                ops.mx_quantize(x, dim, elem_dtype, scale_mode), exp, dim, f"dim {dim} {what}"
            )
        assert_same_quantization(
            ops.mx_quantize_from_master(w, -1, torch.bfloat16, elem_dtype, scale_mode),
            exp_dual[:2],
            -1,
            what,
        )
        exp_block = ref.mx_quantize_block(x, elem_dtype, scale_mode)
        for got in (
            ops.mx_quantize_block(x, elem_dtype, scale_mode),
            ops.mx_quantize_block_from_master(w, torch.bfloat16, elem_dtype, scale_mode),
        ):
            assert_block_quantization_equal(got, exp_block, (n, k), "block " + what)


# ------------------------------------------------------------------------------------------------
# every CPU kernel build (ZRW_CPU_ISA), each in its own process


# Compared in the child: several shapes (aligned, unaligned, K past the kernel's 2048-column
# chunk), every input dtype, element format and scale mode, the three quantize ops, on inputs
# with a wide exponent range, amax mantissas above 1.75, ties, subnormals and specials.
ISA_SCRIPT = textwrap.dedent(
    """
    import math, sys
    import torch
    import zrw
    from zrw import ops, reference as ref

    def b(t):
        return t.view(torch.uint8)

    def masked(data, scale, dim):
        mask = (b(scale) == 0xFF).repeat_interleave(32, dim=dim).narrow(dim, 0, data.shape[dim])
        return b(data).masked_fill(mask, 0)

    def same(got, exp, dim):
        return (torch.equal(b(got[1]), b(exp[1]))
                and torch.equal(masked(got[0], exp[1], dim), masked(exp[0], exp[1], dim)))

    gen = torch.Generator().manual_seed(0)
    failures = []
    shapes = [(1, 1), (1, 33), (31, 65), (100, 70), (3, 40, 70), (5, 1100), (40, 2100), (64, 64)]
    for shape in shapes:
        base = torch.randn(shape, generator=gen, dtype=torch.float64)
        base = base * torch.exp2(torch.randint(-30, 31, shape, generator=gen).double())
        flat = base.view(-1)
        flat[::37] = 1.875 * 2.0 ** 7                      # amax mantissa above 1.75
        flat[1::41] = 1.0625                               # an e4m3 tie
        flat[2::43] = 3 * 2.0 ** -10                       # a subnormal tie
        flat[3::47] = -0.0
        flat[4::53] = 448.0
        flat[5::59] = 57344.0
        flat[6::61] = 2.0 ** -130                          # bf16/fp32 subnormal
        flat[7::211] = math.nan
        flat[8::223] = -math.inf
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = base.clamp(-60000, 60000).to(dtype) if dtype == torch.float16 else base.to(dtype)
            for elem in (torch.float8_e4m3fn, torch.float8_e5m2):
                for mode in ("floor", "rceil"):
                    tag = (shape, str(dtype), str(elem), mode)
                    for dim in range(-x.dim(), x.dim()):
                        if not same(ops.mx_quantize(x, dim, elem, mode),
                                    ref.mx_quantize(x, dim, elem, mode), dim):
                            failures.append(("mx_quantize", dim) + tag)
                    if x.dim() < 2:
                        continue
                    got = ops.mx_quantize_dual(x, elem, mode)
                    exp = ref.mx_quantize_dual(x, elem, mode)
                    if not (same(got[:2], exp[:2], -1) and same(got[2:], exp[2:], -2)):
                        failures.append(("mx_quantize_dual",) + tag)
                    got = ops.mx_quantize_block(x, elem, mode)
                    exp = ref.mx_quantize_block(x, elem, mode)
                    fwd = ref.expand_block_scale(exp[1], x.shape, -1)
                    if not (torch.equal(b(got[1]), b(exp[1]))
                            and same((got[0], fwd), (exp[0], fwd), -1)):
                        failures.append(("mx_quantize_block",) + tag)
    # A weight large enough for the kernels' non-temporal stores (a 4 MiB data plane) and
    # whole 32x32 panels, bf16 with a wide exponent range and zeros: every op and layout.
    x = (torch.randn(2048, 2048, generator=gen) * torch.exp2(
        torch.randint(-20, 21, (2048, 2048), generator=gen).float())).to(torch.bfloat16)
    x[::97] = 0
    for elem in (torch.float8_e4m3fn, torch.float8_e5m2):
        tag = ("2048x2048", str(elem))
        for dim in (0, 1):
            if not same(ops.mx_quantize(x, dim, elem), ref.mx_quantize(x, dim, elem), dim):
                failures.append(("mx_quantize", dim) + tag)
        got, exp = ops.mx_quantize_dual(x, elem), ref.mx_quantize_dual(x, elem)
        if not (same(got[:2], exp[:2], -1) and same(got[2:], exp[2:], -2)):
            failures.append(("mx_quantize_dual",) + tag)
        got, exp = ops.mx_quantize_block(x, elem), ref.mx_quantize_block(x, elem)
        fwd = ref.expand_block_scale(exp[1], x.shape, -1)
        if not (torch.equal(b(got[1]), b(exp[1])) and same((got[0], fwd), (exp[0], fwd), -1)):
            failures.append(("mx_quantize_block",) + tag)
    # dequantization: every element byte under every scale byte, blocks along either axis
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for elem in (torch.float8_e4m3fn, torch.float8_e5m2):
        data = codes.repeat(256, 1)                                  # row r: every byte
        # block b of row r: scale byte (r + 37 b) % 256, so every block sees every scale byte
        scale = ((torch.arange(256)[:, None] + 37 * torch.arange(8)[None, :]) % 256).to(torch.uint8)
        for dim, d, sc in ((-1, data, scale), (0, data.t().contiguous(), scale.t().contiguous())):
            d, sc = d.view(elem), sc.view(torch.float8_e8m0fnu)
            for out in (torch.float32, torch.bfloat16):
                got = ops.mx_dequantize(d, sc, dim, out)
                exp = ref.mx_dequantize(d, sc, dim, out)
                int_view = torch.int32 if out == torch.float32 else torch.int16
                if not (torch.equal(got.isnan(), exp.isnan()) and torch.equal(
                        got.view(int_view)[~got.isnan()], exp.view(int_view)[~exp.isnan()])):
                    failures.append(("mx_dequantize", str(elem), dim, str(out)))
    # mx_matmul's bf16 tiles (these children force the BF16 GEMM path, ZRW_CPU_GEMM=bf16): an
    # operand times an exact identity gives its dequantized values, for every finite element
    # byte under scale bytes 110..140 (every product a normal bf16 value), each operand blocked
    # along K in contiguous rows or as the .t() of a tensor blocked along its other axis
    # (column-major), so that each tile kernel meets the other (a shuffle along K common to
    # both operands would cancel out).
    import zrw.testing
    K = 96
    for elem in (torch.float8_e4m3fn, torch.float8_e5m2):
        finite = codes[ref.mx_dequantize(codes.view(1, 256).view(elem),
                                         torch.full((1, 8), 127, dtype=torch.uint8).view(
                                             torch.float8_e8m0fnu), -1,
                                         torch.float32).view(-1).isfinite()]
        rows = torch.arange(70)[:, None]
        data = finite[(rows * 7 + torch.arange(K)[None, :]) % finite.numel()]
        scale = (110 + (rows + 5 * torch.arange(K // 32)[None, :]) % 31).to(torch.uint8)
        d, sc = data.view(elem), scale.view(torch.float8_e8m0fnu)
        exp = ops.mx_dequantize(d, sc, -1, torch.bfloat16)
        a_layouts = {"rows": (d, sc),
                     "column-major": (d.t().contiguous().t(), sc.t().contiguous().t())}
        eye_q, eye_s = ops.mx_quantize(torch.eye(K), 0, elem)  # the identity is its own .t()
        b_layouts = {"rows": ops.mx_quantize(torch.eye(K), -1, elem),
                     "column-major": (eye_q.t(), eye_s.t())}
        for a_layout, (ad, as_) in a_layouts.items():
            for b_layout, (bd, bs) in b_layouts.items():
                zrw.testing.reset_gemm_counts()
                got = ops.mx_matmul(ad, as_, bd, bs, torch.bfloat16)
                if (zrw.testing.gemm_counts()["bf16"] != 1
                        or not torch.equal(got.float(), exp.float())):
                    failures.append(("mx_matmul bf16 tiles", str(elem), a_layout, b_layout))
        # NaN/Inf element codes under finite scales stay NaN/Inf in the tiles (the scale does
        # not move them): rows of nothing else give all-NaN rows (Inf * 0 is NaN too).
        special = codes[~torch.isin(codes, finite)]
        sdata = special[(torch.arange(4)[:, None] + torch.arange(K)[None, :]) % special.numel()]
        zrw.testing.reset_gemm_counts()
        got = ops.mx_matmul(sdata.view(elem), scale[:4].view(torch.float8_e8m0fnu),
                            *b_layouts["rows"], torch.bfloat16)
        if zrw.testing.gemm_counts()["bf16"] != 1 or not bool(got.isnan().all()):
            failures.append(("mx_matmul bf16 tiles, NaN/Inf codes", str(elem)))
    if failures:
        print(len(failures), "mismatches, first:", *failures[:10], sep="\\n")
        sys.exit(1)
    print("ok")
    """
)


UNAVAILABLE_SCRIPT = textwrap.dedent(
    """
    import sys, torch, zrw
    try:
        zrw.ops.mx_quantize(torch.ones(2, 32))
    except RuntimeError as e:
        print("RuntimeError:", e)
        sys.exit(0)
    print("no error")
    sys.exit(3)
    """
)


def _start_child(script, isa):
    env = dict(os.environ, ZRW_CPU_ISA=isa, ZRW_CPU_GEMM="bf16")
    return subprocess.Popen(
        [sys.executable, "-c", script],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module", autouse=True)
def isa_children():
    """Every child process of the ZRW_CPU_ISA tests, started when this module's first test runs
    so that they work in the background (each pays a torch import) while the other tests run;
    the tests at the end of the module collect them. {(kind, isa): Popen}."""
    flags = cpu_flags()
    children = {}
    for isa, need in ISA_REQUIREMENTS.items():
        if need <= flags:
            children["compare", isa] = _start_child(ISA_SCRIPT, isa)
        else:
            children["unavailable", isa] = _start_child(UNAVAILABLE_SCRIPT, isa)
    children["unavailable", "sse9000"] = _start_child(UNAVAILABLE_SCRIPT, "sse9000")
    yield children
    for child in children.values():
        if child.poll() is None:
            child.kill()
        child.communicate()


def _result(children, key):
    child = children[key]
    stdout, stderr = child.communicate(timeout=300)
    return child.returncode, stdout, stderr


@pytest.mark.parametrize("isa", list(ISA_REQUIREMENTS))
def test_every_cpu_kernel_build_matches_reference(isa, isa_children):
    if ("compare", isa) not in isa_children:
        missing = ISA_REQUIREMENTS[isa] - cpu_flags()
        pytest.skip(f"this CPU lacks {sorted(missing)} for ZRW_CPU_ISA={isa}")
    returncode, stdout, stderr = _result(isa_children, ("compare", isa))
    assert returncode == 0, stdout + stderr
    assert stdout.strip().endswith("ok")


def test_unavailable_or_unknown_cpu_kernel_build_raises(isa_children):
    # ZRW_CPU_ISA naming a build this CPU cannot run, or no build at all, is a RuntimeError at
    # first use that names the request, never a crash (SIGILL) or a silent fallback.
    returncode, stdout, stderr = _result(isa_children, ("unavailable", "sse9000"))
    assert returncode == 0, stdout + stderr
    assert "ZRW_CPU_ISA must be one of the kernels built into zrw" in stdout
    assert '"sse9000"' in stdout
    for kind, isa in isa_children:
        if kind != "unavailable" or isa == "sse9000":
            continue
        returncode, stdout, stderr = _result(isa_children, (kind, isa))
        assert returncode == 0, stdout + stderr
        assert f"ZRW_CPU_ISA={isa} was requested but this CPU does not support it" in stdout
