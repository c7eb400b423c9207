"""The shared layout conversions of the NPU adapter (csrc/npu/mx_layout.cpp), on CPU tensors.

torch_npu's paired scale (docs/npu.md §5.5): along the blocked dim d with nb blocks the scale
has ceil(nb/2) pairs and a trailing dim of 2; block 2i+t sits at [..., i, ..., t]; an odd nb is
padded with byte 0x00. Checked three ways: element by element against that definition, against the
golden-style Python of the stand-ins, and as round trips to the canonical float8_e8m0fnu scale.
"""

import npu_test_ops
import pytest
import torch

from helpers.bitwise import same_bits
from helpers.npu_standins import golden_pair, golden_unpair

E8M0 = torch.float8_e8m0fnu
ops = npu_test_ops.load()  # the test library's zrw_npu_test ops

# (canonical scale shape, blocked dim): aligned (even block counts), odd block counts, a single
# block, 3-d along each axis, and the shapes of the worked cases (M, K/32) and (M/32, K).
CASES = [
    ((4, 4), 1),  # K = 128: 4 blocks, 2 pairs
    ((4, 3), 1),  # K = 96: odd, padded
    ((5, 1), 1),  # K <= 32: one block, one padded pair
    ((3, 6), 0),  # M = 96 along dim 0: odd, padded
    ((4, 8), 0),  # M = 128 along dim 0
    ((3, 5, 7), 0),
    ((3, 5, 7), 1),
    ((3, 5, 7), 2),
    ((2, 3, 4, 5), 2),
    ((7,), 0),
]


def random_scale(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # every byte value, 0x00 and 0xFF (NaN) included: the conversion moves bytes, never values
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(E8M0)


def case_id(case):
    shape, dim = case
    return "x".join(map(str, shape)) + f"-dim{dim}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_paired_layout_by_definition(case):
    shape, dim = case
    scale = random_scale(shape)
    paired = ops.scale_to_paired(scale, dim)
    nb = shape[dim]
    expected_shape = list(shape)
    expected_shape[dim] = -(-nb // 2)
    assert paired.dtype == torch.uint8
    assert list(paired.shape) == expected_shape + [2]
    assert paired.is_contiguous()
    canonical = scale.view(torch.uint8)
    for i in range(expected_shape[dim]):
        for t in (0, 1):
            block = 2 * i + t
            got = paired.select(-1, t).select(dim, i)
            if block < nb:
                assert torch.equal(got, canonical.select(dim, block)), (i, t)
            else:  # the pad of an odd block count
                assert bool((got == 0).all()), (i, t)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_paired_layout_matches_the_golden(case):
    shape, dim = case
    scale = random_scale(shape, seed=1)
    assert torch.equal(ops.scale_to_paired(scale, dim), golden_pair(scale, dim))
    # a negative dim names the same axis
    assert torch.equal(ops.scale_to_paired(scale, dim - len(shape)), golden_pair(scale, dim))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_round_trips(case):
    shape, dim = case
    scale = random_scale(shape, seed=2)
    nb = shape[dim]
    back = ops.scale_from_paired(ops.scale_to_paired(scale, dim), dim, nb)
    assert back.dtype == E8M0 and back.is_contiguous()
    assert same_bits(back, scale)
    # from torch_npu's side: its pairs (as uint8, as torch_npu returns them) -> canonical -> pairs
    golden = golden_pair(scale, dim)
    canonical = ops.scale_from_paired(golden, dim, nb)
    assert torch.equal(canonical.view(torch.uint8), golden_unpair(golden, dim, nb))
    assert torch.equal(ops.scale_to_paired(canonical, dim), golden)


def test_strided_inputs():
    # The matmul adapter pairs the .t() of a column-major operand's scale and transposes back.
    base = random_scale((6, 5), seed=3)  # (KB, R): blocked along dim 0
    t = base.t()  # (R, KB) view
    assert torch.equal(ops.scale_to_paired(t, 1), golden_pair(t.contiguous(), 1))
    paired = golden_pair(base, 0)  # (3, 5, 2)
    view = paired.transpose(0, 1)  # (5, 3, 2), not contiguous
    back = ops.scale_from_paired(view, 1, 6)
    assert torch.equal(back.view(torch.uint8), base.view(torch.uint8).t())


def test_empty_block_dim():
    scale = torch.empty(4, 0, dtype=E8M0)
    paired = ops.scale_to_paired(scale, 1)
    assert paired.shape == (4, 0, 2)
    assert ops.scale_from_paired(paired, 1, 0).shape == (4, 0)


def test_conversion_errors():
    with pytest.raises(ValueError, match="pairs there"):
        ops.scale_from_paired(torch.zeros(4, 3, 2, dtype=torch.uint8), 1, 8)
    with pytest.raises(ValueError, match="dim of size 2"):
        ops.scale_from_paired(torch.zeros(4, 3, dtype=torch.uint8), 1, 6)
    with pytest.raises(TypeError, match="uint8 or torch.float8_e8m0fnu"):
        ops.scale_to_paired(torch.zeros(4, 3), 1)
    with pytest.raises(IndexError, match="dim must be in"):
        ops.scale_to_paired(random_scale((4, 3)), 2)


@pytest.mark.parametrize("column_major", [False, True], ids=["rows", "t"])
@pytest.mark.parametrize("k", [40, 96, 128])
def test_pad_k_keeps_values_and_orientation(column_major, k):
    gen = torch.Generator().manual_seed(k)
    rows = 5
    base = torch.randint(
        0, 256, (k, rows) if column_major else (rows, k), generator=gen, dtype=torch.uint8
    ).view(torch.float8_e4m3fn)
    data = base.t() if column_major else base  # (rows, k) either way
    k_padded = -(-k // 64) * 64
    padded = ops.pad_k(data, k_padded)
    assert padded.shape == (rows, k_padded) and padded.dtype == data.dtype
    if column_major:
        assert padded.t().is_contiguous() and not padded.is_contiguous()
    else:
        assert padded.is_contiguous()
    padded_bytes = padded.view(torch.uint8)
    assert torch.equal(padded_bytes[:, :k], data.view(torch.uint8))
    assert bool((padded_bytes[:, k:] == 0).all())  # +0 in both fp8 formats
