"""Typed wrappers of the `torch.ops.zrw.*` ops: the layout contract lives in these docstrings.

Conventions (docs/design.md §3): a block is 32 consecutive elements along one axis; a weight W is
(N, K) = (out_features, in_features) as in nn.Linear, or a stack (E, N, K) of such matrices;
elements are torch.float8_e4m3fn (default) or torch.float8_e5m2; scales are
torch.float8_e8m0fnu (biased exponent byte, 0xFF = NaN). A dimension that is not a multiple of
32 ends in a shorter block; scale extents are ceil(D / 32).

The lifecycle calls a custom layer makes, `quant_and_release(w, ...)` (first use in a step:
quantize, cache, release the BF16 storage) and the restores `restore(w, fill)` /
`restore_all(fill)`, are reachable here as the design names them (docs/design.md §4): they are
zrw.cache's own functions, bound into this module by the zrw package (see zrw/__init__.py).
"""

from __future__ import annotations

import numbers
from typing import Tuple

import torch
from torch import Tensor

from . import _C

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

__all__ = [
    "SCALE_MODES",
    "E4M3",
    "E5M2",
    "mx_quantize",
    "mx_quantize_dual",
    "mx_quantize_block",
    "mx_quantize_from_master",
    "mx_quantize_dual_from_master",
    "mx_quantize_block_from_master",
    "expand_block_scale",
    "mx_expand_block_scale",
    "mx_dequantize",
    "mx_matmul",
    "matmul_workspace_bytes",
    "free_matmul_workspace",
]  # and quant_and_release, restore, restore_all: bound by the package root (zrw/__init__.py)

SCALE_MODES = tuple(_C.scale_modes())  # one source: csrc/common/names.h

# Argument types, read from each op's schema: a None or a wrong-typed argument gets a TypeError
# naming it here, instead of the dispatcher's message (which for a None tensor names neither
# the argument nor the op). Dtypes, shapes and values are the C++ checks' (csrc/common/checks.h).
_KINDS = {
    "Tensor": (Tensor, "a torch.Tensor"),
    "int": (numbers.Integral, "an int"),
    "ScalarType": (torch.dtype, "a torch.dtype"),
    "str": (str, "a str"),
}


def _signature(op: str):
    schema = getattr(torch.ops.zrw, op).default._schema
    return op, tuple((a.name, *_KINDS[str(a.real_type)]) for a in schema.arguments)


def _check_types(signature, *args) -> None:
    op, params = signature
    for (name, kind, expected), value in zip(params, args):
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TypeError(f"zrw.{op}: {name} must be {expected}, got {type(value).__name__}")


_QUANTIZE = _signature("mx_quantize")
_QUANTIZE_DUAL = _signature("mx_quantize_dual")
_QUANTIZE_BLOCK = _signature("mx_quantize_block")
_QUANTIZE_FROM_MASTER = _signature("mx_quantize_from_master")
_QUANTIZE_DUAL_FROM_MASTER = _signature("mx_quantize_dual_from_master")
_QUANTIZE_BLOCK_FROM_MASTER = _signature("mx_quantize_block_from_master")
_EXPAND_BLOCK_SCALE = _signature("mx_expand_block_scale")
_DEQUANTIZE = _signature("mx_dequantize")
_MATMUL = _signature("mx_matmul")


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
    _check_types(_QUANTIZE, x, dim, elem_dtype, scale_mode)
    return torch.ops.zrw.mx_quantize.default(x, dim, elem_dtype, scale_mode)


def mx_quantize_dual(
    w: Tensor, elem_dtype: torch.dtype = E4M3, scale_mode: str = "floor"
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Both axes of a weight from one read: the `mxfp8` (1x32) recipe.

    w: (N, K) or (E, N, K). Returns (data_fwd, scale_fwd, data_bwd, scale_bwd):
    data_fwd (.., N, K) blocked along K with scale_fwd (.., N, ceil(K/32)) — the forward GEMM's
    operand; data_bwd (.., N, K) blocked along N with scale_bwd (.., ceil(N/32), K) — dgrad
    uses data_bwd.t(). Equal to mx_quantize(w, -1) and mx_quantize(w, -2).
    """
    _check_types(_QUANTIZE_DUAL, w, elem_dtype, scale_mode)
    return torch.ops.zrw.mx_quantize_dual.default(w, elem_dtype, scale_mode)


def mx_quantize_block(
    w: Tensor, elem_dtype: torch.dtype = E4M3, scale_mode: str = "floor"
) -> Tuple[Tensor, Tensor]:
    """32x32-tile quantization: the `mxfp8-32x32` recipe, one FP8 copy for forward and backward.

    w: (N, K) or (E, N, K). Returns (data, block_scale): data (.., N, K); block_scale
    (.., ceil(N/32), ceil(K/32)), one scale per tile from the tile's amax. The per-axis scales
    the GEMMs use are expand_block_scale(block_scale, w.shape, dim).
    """
    _check_types(_QUANTIZE_BLOCK, w, elem_dtype, scale_mode)
    return torch.ops.zrw.mx_quantize_block.default(w, elem_dtype, scale_mode)


# Quantization straight from an FP32 master weight (docs/design.md §5, the BF16-free optimizer
# step): a released bf16/fp16 parameter is quantized at its next first use from the master that
# zrw.optim.MasterWeights keeps, with the bytes of quantizing the parameter itself.


def mx_quantize_from_master(
    master: Tensor,
    dim: int = -1,
    param_dtype: torch.dtype = torch.bfloat16,
    elem_dtype: torch.dtype = E4M3,
    scale_mode: str = "floor",
) -> Tuple[Tensor, Tensor]:
    """mx_quantize(master.to(param_dtype), dim, elem_dtype, scale_mode), without the cast.

    master: float32, any shape (the FP32 master of a bf16/fp16 parameter). Each element is
    rounded to `param_dtype` (torch.bfloat16 or torch.float16) exactly as `master.to(param_dtype)`
    / `param.copy_(master)` rounds it (nearest, ties to even; overflow to +-Inf, NaN stays NaN,
    fp32 subnormals as torch converts them) and quantized in the same pass: the master is read
    once and the rounded tensor never exists (on CPU; on NPU it is a cast, then the quantization).
    Returns (data, scale) with mx_quantize's layout: data master's shape in `elem_dtype`, blocks of
    32 along `dim`; scale master's shape with `dim` -> ceil(D/32), float8_e8m0fnu. Byte for
    byte the outputs of mx_quantize on the rounded tensor.
    """
    _check_types(_QUANTIZE_FROM_MASTER, master, dim, param_dtype, elem_dtype, scale_mode)
    return torch.ops.zrw.mx_quantize_from_master.default(
        master, dim, param_dtype, elem_dtype, scale_mode
    )


def mx_quantize_dual_from_master(
    master: Tensor,
    param_dtype: torch.dtype = torch.bfloat16,
    elem_dtype: torch.dtype = E4M3,
    scale_mode: str = "floor",
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """mx_quantize_dual(master.to(param_dtype), elem_dtype, scale_mode), without the cast.

    master: float32 (N, K) or (E, N, K). Elements rounded to `param_dtype` (bf16 or fp16) as
    mx_quantize_from_master rounds them, both axes written from one read. Returns (data_fwd,
    scale_fwd, data_bwd, scale_bwd): data_fwd (.., N, K) blocked along K with scale_fwd
    (.., N, ceil(K/32)); data_bwd (.., N, K) blocked along N with scale_bwd (.., ceil(N/32), K).
    Byte for byte mx_quantize_dual of the rounded weight.
    """
    _check_types(_QUANTIZE_DUAL_FROM_MASTER, master, param_dtype, elem_dtype, scale_mode)
    return torch.ops.zrw.mx_quantize_dual_from_master.default(
        master, param_dtype, elem_dtype, scale_mode
    )


def mx_quantize_block_from_master(
    master: Tensor,
    param_dtype: torch.dtype = torch.bfloat16,
    elem_dtype: torch.dtype = E4M3,
    scale_mode: str = "floor",
) -> Tuple[Tensor, Tensor]:
    """mx_quantize_block(master.to(param_dtype), elem_dtype, scale_mode), without the cast.

    master: float32 (N, K) or (E, N, K). Elements rounded to `param_dtype` (bf16 or fp16) as
    mx_quantize_from_master rounds them. Returns (data, block_scale): data (.., N, K), one copy for
    forward and backward; block_scale (.., ceil(N/32), ceil(K/32)), one scale per 32x32 tile
    (expand_block_scale gives the per-axis scales). Byte for byte mx_quantize_block of the
    rounded weight.
    """
    _check_types(_QUANTIZE_BLOCK_FROM_MASTER, master, param_dtype, elem_dtype, scale_mode)
    return torch.ops.zrw.mx_quantize_block_from_master.default(
        master, param_dtype, elem_dtype, scale_mode
    )


def expand_block_scale(block_scale: Tensor, shape, dim: int) -> Tensor:
    """Per-axis scale of a 32x32-quantized weight of `shape` ((N, K) or (E, N, K)).

    block_scale: (.., ceil(N/32), ceil(K/32)) float8_e8m0fnu, as mx_quantize_block returns.
    dim=-1: (.., N, ceil(K/32)), blocks along K (forward); dim=-2: (.., ceil(N/32), K), blocks
    along N (backward). Every 32x1 or 1x32 block inside a tile has the tile's scale, so the data
    tensor serves both directions unchanged. Wrong shapes, dtypes or dims raise.
    """
    if not isinstance(block_scale, Tensor):
        raise TypeError(
            f"zrw.ops.expand_block_scale: block_scale must be a torch.Tensor, got "
            f"{type(block_scale).__name__}"
        )
    try:
        shape = tuple(int(d) for d in shape)
    except TypeError:
        raise TypeError(
            f"zrw.ops.expand_block_scale: shape must be a sequence of ints, got {shape!r}"
        ) from None
    if len(shape) not in (2, 3) or len(shape) != block_scale.dim():
        raise ValueError(
            f"zrw.ops.expand_block_scale: shape must be the 2-d (N, K) or 3-d (E, N, K) "
            f"shape of the weight whose block_scale (shape "
            f"{tuple(block_scale.shape)}) this is, got {shape}"
        )
    if shape[:-2] != tuple(block_scale.shape[:-2]):
        raise ValueError(
            f"zrw.ops.expand_block_scale: block_scale's leading dims "
            f"{tuple(block_scale.shape[:-2])} must equal shape's {shape[:-2]}"
        )
    return mx_expand_block_scale(block_scale, shape[-2], shape[-1], dim)


def mx_expand_block_scale(block_scale: Tensor, n: int, k: int, dim: int) -> Tensor:
    """expand_block_scale for a weight with `n` rows and `k` columns (the op's own signature;
    block_scale's leading dims are the weight's). The native cache expands with this op too."""
    _check_types(_EXPAND_BLOCK_SCALE, block_scale, n, k, dim)
    return torch.ops.zrw.mx_expand_block_scale.default(block_scale, n, k, dim)


def mx_dequantize(
    data: Tensor, scale: Tensor, dim: int = -1, out_dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """Inverse of mx_quantize: data (fp8, any shape) times 2^(scale - 127), blocks along `dim`.

    scale must have data's shape with `dim` -> ceil(D/32). The product is formed in fp32 (exact)
    and cast to out_dtype (bf16, fp16, fp32); a 0xFF scale gives NaN for its whole block.
    """
    _check_types(_DEQUANTIZE, data, scale, dim, out_dtype)
    return torch.ops.zrw.mx_dequantize.default(data, scale, dim, out_dtype)


def mx_matmul(
    a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """a @ b.T with FP32 accumulation, for MX operands both blocked along K.

    a: (M, K) fp8 with a_scale (M, ceil(K/32)); b: (N, K) fp8 with b_scale (N, ceil(K/32)).
    Returns (M, N) in out_dtype. Either operand (with its scale) may be a strided view such as
    the .t() of a tensor blocked along its other axis — dgrad passes W_bwd.t(), wgrad
    Q_M(dy).t() and Q_M(x).t() — and is never copied to make it contiguous.

    On CPU it is emulated, exactly: both operands are dequantized in row tiles (an MX value
    times a power of two is an fp32 value) and multiplied by a GEMM that accumulates in fp32.
    Where the CPU has native BF16 dot products (avx512_bf16, AMX-BF16) and out_dtype is bf16,
    the tiles are bf16 and torch's BF16 GEMM writes each product tile straight into the result
    (`zrw.backends()["cpu"]["gemm"]`); elsewhere fp32 tiles and the fp32 GEMM, whose products go
    through an fp32 product tile when the result is bf16/fp16. The tiles (an A tile of at most
    16 MiB, a B tile of 8 MiB and a 16 MiB product tile: 40 MiB) live in a workspace that
    persists between calls; see `matmul_workspace_bytes` and `free_matmul_workspace`. A tile
    holds whole rows of K, at least 64 of them (or all there are), so the bounds hold for K up
    to 2^16 and tiles grow past them beyond; a K above 2^23 is refused at once (ValueError
    naming K: split the product along K). A hardware MX GEMM where the backend has one.
    """
    _check_types(_MATMUL, a, a_scale, b, b_scale, out_dtype)
    return torch.ops.zrw.mx_matmul.default(a, a_scale, b, b_scale, out_dtype)


def matmul_workspace_bytes() -> int:
    """Bytes held by mx_matmul's CPU tile workspace.

    mx_matmul keeps its dequantized tiles in one buffer that persists between calls, so that a
    training step does not allocate (and fault in) them for every GEMM. It grows to the largest
    tiles a call has needed, at most 40 MiB (see mx_matmul), comes from the CPU allocator like
    any tensor (`zrw.memory` counts it) and stays until `free_matmul_workspace()`.
    """
    return _C.cpu_matmul_workspace_bytes()


def free_matmul_workspace() -> int:
    """Free mx_matmul's CPU tile workspace; returns the bytes freed (0 if there was none).

    The next CPU mx_matmul allocates it again. Call it when a phase that runs MX GEMMs ends (after
    training, before measuring memory) to return its memory; a call in flight on another thread
    keeps its tiles until it returns.
    """
    return _C.cpu_free_matmul_workspace()
