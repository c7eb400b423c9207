"""The NPU adapter's cases: inputs (weights, masters, exactly multipliable matmul operands) and
the shapes, layouts and formats each op is run on. tests/npu/test_adapter.py runs them through the
adapter and the stand-ins; test_real_torch_npu.py replays the same calls against the real
torch_npu's meta functions."""

import torch

from zrw import reference as ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


def weights(shape, dtype=torch.bfloat16, seed=0, specials=True):
    """randn spread over 2^-8..2^8 by element, and, with specials, the cases that pick scales
    differently: an all-zero slab, +-max of both formats, values past rceil's threshold, fp32
    subnormals (0 in bf16/fp16), a huge value, +inf and NaN."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-8, 9, shape, generator=gen))
    if specials and x.numel() >= 64:
        flat = x.view(-1)
        flat[:40] = 0.0
        values = [
            448.0,
            -57344.0,
            480.0,
            1.9,
            1e-40,
            3e30 if dtype == torch.float32 else 6e4,
            float("inf"),
            float("nan"),
        ]
        positions = torch.randperm(flat.numel() - 40, generator=gen)[: len(values)] + 40
        for p, v in zip(positions.tolist(), values):
            flat[p] = v
    return x.to(dtype)


ELEMS = [E4M3, E5M2]
MODES = ["floor", "rceil"]

# one-axis quantization (npu_dynamic_mx_quant)
QUANTIZE_CASES = [
    ((64, 128), -1),  # aligned, blocks along the tail (2-d, axis -1)
    ((5, 70), -1),  # 3 blocks: an odd count, a partial block
    ((96, 6), 0),  # along dim 0 of a matrix (axis -2)
    ((3, 40, 33), 1),  # 3-d, middle axis
    ((2, 3, 96), 0),  # 3-d, leading axis
    ((100,), 0),  # 1-d
]


OTHER_DTYPE_SHAPE = (33, 96)


# float32 along an axis shorter than one block: torch_npu 2.13.0's docstring says a float32 input
# needs at least 32 elements along the quantized axis, so the adapter pads it with zeros (which
# change no amax) to one block. Both orientations, and a 1-element axis.
FLOAT32_SHORT_AXIS_CASES = [((4, 20), -1), ((20, 5), 0), ((3, 1, 40), 1)]


# dual-axis (mxfp8): npu_dynamic_mx_quant_with_dual_axis
DUAL_SHAPES = [(96, 70), (64, 128), (2, 40, 96)]
DUAL_FLOAT32_SHAPE = (2, 40, 96)


# 32x32 blocks (mxfp8-32x32): npu_dynamic_block_mx_quant
BLOCK_SHAPES = [(70, 96), (64, 128), (2, 33, 64)]


# from an FP32 master: cast to param_dtype, then the bf16/fp16 operators
FROM_MASTER_SHAPE = (70, 96)
PARAM_DTYPES = (torch.bfloat16, torch.float16)


def master_weights(shape, seed=0):
    """fp32 masters where the rounding to the parameter dtype decides: weights() (fp32 specials,
    3e30 rounds to +inf in fp16) with every other row's elements made exact bf16 ties."""
    master = weights(shape, torch.float32, seed=seed)
    bits = master.view(torch.int32)
    finite = master.isfinite()
    tied = (bits & ~0xFFFF) | 0x8000
    bits[::2] = torch.where(finite[::2], tied[::2], bits[::2])
    return master


# mx_matmul: npu_quant_matmul in MX mode


def exact_values(rows, k, seed):
    """(rows, k) values i * 2^p with |i| <= 4 and p in [-3, 3] (p varies by element and by 32-block,
    so neighbouring blocks get different scales, and one block is all zero). They quantize exactly
    in both fp8 formats, and every fp32 dot product of them is exact in any summation order
    (terms are multiples of 2^-6 below 2^10, K <= 192), so the product is bit-identical however
    the operator accumulates."""
    gen = torch.Generator().manual_seed(seed)
    ints = torch.randint(-4, 5, (rows, k), generator=gen).float()
    elem_shift = torch.randint(-2, 3, (rows, k), generator=gen)
    block_shift = torch.randint(-1, 2, (rows, -(-k // 32)), generator=gen)
    block_shift = block_shift.repeat_interleave(32, 1)[:, :k]
    x = ints * torch.exp2((elem_shift + block_shift).float())
    x[0, :32] = 0.0
    return x.to(torch.bfloat16)


def operand(values, layout, elem):
    """The MX operand (R, K) blocked along K in one of the layouts training passes (DESIGN §4)."""
    if layout == "rows":
        return ref.mx_quantize(values, -1, elem, "floor")
    if layout == "t":  # the .t() of a (K, R) tensor blocked along dim 0, e.g. W_bwd.t()
        data, scale = ref.mx_quantize(values.t().contiguous(), 0, elem, "floor")
        return data.t(), scale.t()
    if layout == "row_step":  # every other row of a taller tensor: neither layout, copied
        taller = torch.cat([values, values.flip(0)], 1).view(-1, values.shape[1])
        data, scale = ref.mx_quantize(taller, -1, elem, "floor")
        return data[::2], scale[::2]
    raise AssertionError(layout)


LAYOUTS = ["rows", "t", "row_step"]


MATMUL_KS = [64, 96, 40, 192]  # aligned, K % 64 != 0 (padded), K < 64, several pairs
MATMUL_MN = (6, 9)


def matmul_elems(k):
    return (E4M3, E5M2) if k == 96 else (E4M3, E4M3)


SINGLE_ROW_KS = [64, 160]
SINGLE_ROW_MN = [(1, 5), (5, 1), (1, 1)]
