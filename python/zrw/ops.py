"""Typed wrappers of the `torch.ops.zrw.*` ops: the layout contract lives in these docstrings.

Conventions (DESIGN.md §3): a block is 32 consecutive elements along one axis; a weight W is
(N, K) = (out_features, in_features) as in nn.Linear, or a stack (E, N, K) of such matrices;
elements are torch.float8_e4m3fn (default) or torch.float8_e5m2; scales are
torch.float8_e8m0fnu (biased exponent byte, 0xFF = NaN). A dimension that is not a multiple of
32 ends in a shorter block; scale extents are ceil(D / 32).
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
SCALE_MODES = ("floor", "rceil")


def mx_quantize(
    x: Tensor, dim: int = -1, elem_dtype: torch.dtype = E4M3, scale_mode: str = "floor"
) -> Tuple[Tensor, Tensor]:
    """Quantize `x` (bf16, fp16 or fp32, any shape) with blocks of 32 along `dim`.

    Returns (data, scale): data has x's shape and dtype `elem_dtype` (contiguous); scale has x's
    shape with `dim` -> ceil(x.shape[dim] / 32), dtype float8_e8m0fnu.
    scale_mode "floor": e = floor(log2(amax)) - emax (OCP); "rceil": the smallest e with
    amax / 2^e <= max element (cuBLAS/TE). Elements are x / 2^e rounded to nearest-even and
    saturated. Zero blocks get scale 0x00, blocks holding NaN or Inf get 0xFF.
    """
    return torch.ops.zrw.mx_quantize(x, dim, elem_dtype, scale_mode)


def mx_quantize_dual(
    w: Tensor, elem_dtype: torch.dtype = E4M3, scale_mode: str = "floor"
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Both axes of a weight from one read: the `mxfp8` (1x32) recipe.

    w: (N, K) or (E, N, K). Returns (data_fwd, scale_fwd, data_bwd, scale_bwd):
    data_fwd (.., N, K) blocked along K with scale_fwd (.., N, ceil(K/32)) — the forward GEMM's
    operand; data_bwd (.., N, K) blocked along N with scale_bwd (.., ceil(N/32), K) — dgrad
    uses data_bwd.t(). Equal to mx_quantize(w, -1) and mx_quantize(w, -2).
    """
    return torch.ops.zrw.mx_quantize_dual(w, elem_dtype, scale_mode)


def mx_quantize_block(
    w: Tensor, elem_dtype: torch.dtype = E4M3, scale_mode: str = "floor"
) -> Tuple[Tensor, Tensor]:
    """32x32-tile quantization: the `mxfp8-32x32` recipe, one FP8 copy for forward and backward.

    w: (N, K) or (E, N, K). Returns (data, block_scale): data (.., N, K); block_scale
    (.., ceil(N/32), ceil(K/32)), one scale per tile from the tile's amax. The per-axis scales
    the GEMMs use are expand_block_scale(block_scale, w.shape, dim).
    """
    return torch.ops.zrw.mx_quantize_block(w, elem_dtype, scale_mode)


def expand_block_scale(block_scale: Tensor, shape, dim: int) -> Tensor:
    """Per-axis scale of a 32x32-quantized weight of `shape` ((N, K) or (E, N, K)).

    dim=-1: (.., N, ceil(K/32)), blocks along K (forward); dim=-2: (.., ceil(N/32), K), blocks
    along N (backward). Every 32x1 or 1x32 block inside a tile has the tile's scale, so the data
    tensor serves both directions unchanged.
    """
    n, k = shape[-2], shape[-1]
    nd = len(shape)
    if dim in (-1, nd - 1):
        return block_scale.repeat_interleave(32, dim=-2)[..., :n, :]
    if dim in (-2, nd - 2):
        return block_scale.repeat_interleave(32, dim=-1)[..., :k]
    raise ValueError(f"expand_block_scale: dim must be -1 or -2 for a weight of shape "
                     f"{tuple(shape)}, got {dim}")


def mx_dequantize(
    data: Tensor, scale: Tensor, dim: int = -1, out_dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """Inverse of mx_quantize: data (fp8, any shape) times 2^(scale - 127), blocks along `dim`.

    scale must have data's shape with `dim` -> ceil(D/32). The product is formed in fp32 (exact)
    and cast to out_dtype (bf16, fp16, fp32); a 0xFF scale gives NaN for its whole block.
    """
    return torch.ops.zrw.mx_dequantize(data, scale, dim, out_dtype)


def mx_matmul(
    a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """a @ b.T with FP32 accumulation, for MX operands both blocked along K.

    a: (M, K) fp8 with a_scale (M, ceil(K/32)); b: (N, K) fp8 with b_scale (N, ceil(K/32)).
    Returns (M, N) in out_dtype. Either operand (with its scale) may be a strided view such as
    the .t() of a tensor blocked along its other axis — dgrad passes W_bwd.t(), wgrad
    Q_M(dy).t() and Q_M(x).t() — and is never copied to make it contiguous. On CPU it is
    emulated: tiles are dequantized to bf16 (exact) and multiplied by a bf16 GEMM with FP32
    accumulation; a hardware MX GEMM where the backend has one.
    """
    return torch.ops.zrw.mx_matmul(a, a_scale, b, b_scale, out_dtype)
