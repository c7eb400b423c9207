"""The plain-PyTorch specification of every zrw MX op: readable first, fast never.

Every backend (the C++ CPU kernels, CUDA, NPU) must produce the same bytes as these functions;
tests compare against them with zero tolerance. The format and its rules (OCP MXFP8 v1.0:
blocks, E8M0 scales, the `floor` and `rceil` rules, rounding, specials, layouts) are
docs/design.md §3; the code below spells them out. Why it is exact:
every bf16/fp16/fp32 value times ``2^-e`` for ``e`` in [-127, 127] is exactly representable in
float64, so blocks are scaled in float64 and rounded once, to fp8. No function here calls a
compiled kernel, but the module imports ``zrw.ops`` (``SCALE_MODES``, whose one source is the
C++ names), so it needs the built extension like every zrw module.
"""

import math

import torch

from .ops import SCALE_MODES  # noqa: F401  (one source: the C++ extension's names)

BLOCK = 32
ELEM_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
ELEM_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}

E8M0_BIAS = 127
E8M0_NAN_BYTE = 0xFF
MIN_SCALE_EXP = -127
MAX_SCALE_EXP = 127

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# 2^(byte - 127) for every E8M0 byte, built by math.ldexp so each entry is exact by construction
# (torch.exp2/pow on tensors make no exactness promise). Byte 0xFF is NaN.
_E8M0_VALUE_BY_BYTE = torch.tensor(
    [math.ldexp(1.0, byte - E8M0_BIAS) for byte in range(E8M0_NAN_BYTE)] + [math.nan],
    dtype=torch.float64,
)


# ---- argument checks -----------------------------------------------------------------------------


def _check_input(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, found {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name}.dtype must be one of {INPUT_DTYPES}, found {x.dtype}")


def _check_elem_dtype(elem_dtype):
    if elem_dtype not in ELEM_MAX:
        raise TypeError(f"elem_dtype must be one of {tuple(ELEM_MAX)}, found {elem_dtype}")


def _check_scale_mode(scale_mode):
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, found {scale_mode!r}")


def _check_out_dtype(out_dtype):
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, found {out_dtype}")


def _check_weight(w, name):
    _check_input(w, name)
    if w.dim() not in (2, 3):
        raise ValueError(
            f"{name} must be a weight of shape (N, K) or (E, N, K), found shape {tuple(w.shape)}"
        )


def _normalize_dim(dim, ndim, name="dim"):
    if ndim == 0:
        raise ValueError(f"{name}: a 0-d tensor has no axis to block along")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{name} must be in [{-ndim}, {ndim - 1}] for a {ndim}-d tensor, found {dim}"
        )
    return dim % ndim


def _num_blocks(length):
    return -(-length // BLOCK)


# ---- the two rules everything else is built from -------------------------------------------------


def _scale_exponent(amax, has_nonfinite, elem_dtype, scale_mode):
    """Unbiased scale exponent ``e`` (int64) and the E8M0 byte (uint8) for each block.

    ``amax`` is float64 (exact for any bf16/fp16/fp32 block); ``has_nonfinite`` marks blocks holding
    a NaN or +-Inf. Those blocks get byte 0xFF and ``e = 0`` (a placeholder: their elements are
    unspecified).
    """
    emax = ELEM_EMAX[elem_dtype]
    max_elem = ELEM_MAX[elem_dtype]
    usable = ~has_nonfinite & (amax > 0)
    safe_amax = torch.where(usable, amax, torch.ones_like(amax))

    # frexp gives amax = m * 2^p with m in [0.5, 1), so floor(log2(amax)) = p - 1 exactly (float64
    # holds every fp32 subnormal as a normal number, so this holds for them too).
    mantissa, frexp_exponent = torch.frexp(safe_amax)
    exponent = frexp_exponent.to(torch.int64) - 1 - emax
    if scale_mode == "rceil":
        # floor's e puts amax / 2^e = (2m) * 2^emax in [2^emax, 2^(emax+1)); e - 1 would double it
        # past max_elem, so the smallest e that fits is floor's e, or e + 1 when floor's e
        # overflows the format. (2m) * 2^emax is exact in float64, and unlike amax / 2^e it needs
        # no power of two outside the clamp range.
        amax_over_floor_scale = 2 * mantissa * 2.0**emax
        exponent = exponent + (amax_over_floor_scale > max_elem).to(torch.int64)

    # An all-zero block has log2(amax) = -inf, which the clamp turns into -127.
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, MIN_SCALE_EXP))
    exponent = exponent.clamp(MIN_SCALE_EXP, MAX_SCALE_EXP)
    exponent = torch.where(has_nonfinite, torch.zeros_like(exponent), exponent)

    scale_byte = torch.where(
        has_nonfinite, torch.full_like(exponent, E8M0_NAN_BYTE), exponent + E8M0_BIAS
    ).to(torch.uint8)
    return exponent, scale_byte


def _to_elements(values, exponent, has_nonfinite, elem_dtype):
    """Round ``values / 2^exponent`` (float64, broadcast) to ``elem_dtype``: RNE, saturating."""
    max_elem = ELEM_MAX[elem_dtype]
    # Exact: a power-of-two rescale of a <=24-bit significand (2^e by its E8M0 byte, e + 127).
    scaled = values / _e8m0_value(exponent + E8M0_BIAS)
    scaled = torch.where(has_nonfinite, torch.full_like(scaled, math.nan), scaled)
    # Clamp before the cast: torch's e5m2 cast overflows to Inf instead of saturating. Clamping
    # first gives the same bytes as rounding and then saturating, as the max is representable.
    scaled = scaled.clamp(-max_elem, max_elem)
    # torch converts float64 -> fp8 through float32, i.e. rounds twice. Going through float32
    # ourselves is explicit and still exact where it matters: ``scaled`` is exactly representable in
    # float32 down to 2^-126 (a <=24-bit significand), and below that every value rounds to a
    # signed zero in fp8 (the smallest fp8 rounding boundary is 2^-17) whichever path it takes.
    return scaled.to(torch.float32).to(elem_dtype)


def _e8m0_value(scale_byte):
    """2^(byte - 127) in float64 for a uint8 tensor of E8M0 bytes; NaN for 0xFF."""
    return _E8M0_VALUE_BY_BYTE[scale_byte.to(torch.int64)]


# ---- quantization --------------------------------------------------------------------------------


def mx_quantize(x, dim=-1, elem_dtype=torch.float8_e4m3fn, scale_mode="floor"):
    """MX-quantize ``x`` (any rank >= 1, bf16 / fp16 / fp32, any strides) in blocks of 32
    along ``dim`` (a last shorter block's missing elements count as 0 for amax). Returns
    contiguous ``(data, scale)``: ``data`` of ``x``'s shape in ``elem_dtype``, ``scale``
    (``torch.float8_e8m0fnu``) of ``x``'s shape with ``dim`` of size ``ceil(D / 32)``."""
    _check_input(x, "x")
    _check_elem_dtype(elem_dtype)
    _check_scale_mode(scale_mode)
    dim = _normalize_dim(dim, x.dim())

    length = x.shape[dim]
    num_blocks = _num_blocks(length)
    rows = x.movedim(dim, -1).to(torch.float64)
    padded = torch.nn.functional.pad(rows, (0, num_blocks * BLOCK - length))
    blocks = padded.reshape(*rows.shape[:-1], num_blocks, BLOCK)

    # amax refuses to reduce over an empty tensor; with no blocks any empty tensor will do.
    amax = blocks.abs().amax(dim=-1, keepdim=True) if num_blocks else blocks.sum(-1, keepdim=True)
    has_nonfinite = (~torch.isfinite(blocks)).any(dim=-1, keepdim=True)
    exponent, scale_byte = _scale_exponent(amax, has_nonfinite, elem_dtype, scale_mode)

    elements = _to_elements(blocks, exponent, has_nonfinite, elem_dtype)
    data = elements.reshape(padded.shape)[..., :length].movedim(-1, dim).contiguous()
    scale = scale_byte.squeeze(-1).movedim(-1, dim).contiguous().view(torch.float8_e8m0fnu)
    return data, scale


def mx_quantize_dual(w, elem_dtype=torch.float8_e4m3fn, scale_mode="floor"):
    """Both MX copies of a weight ``w`` (N, K) or (E, N, K): ``(data_fwd, scale_fwd, data_bwd,
    scale_bwd)``, exactly ``mx_quantize`` of ``w`` along K (dim -1, scale (..., N, ceil(K/32)))
    and along N (dim -2, scale (..., ceil(N/32), K))."""
    _check_weight(w, "w")
    data_fwd, scale_fwd = mx_quantize(w, -1, elem_dtype, scale_mode)
    data_bwd, scale_bwd = mx_quantize(w, -2, elem_dtype, scale_mode)
    return data_fwd, scale_fwd, data_bwd, scale_bwd


def mx_quantize_block(w, elem_dtype=torch.float8_e4m3fn, scale_mode="floor"):
    """One MX copy of a weight ``w`` (N, K) or (E, N, K) with one scale per 32x32 tile (the
    ``mxfp8-32x32`` recipe): contiguous ``(data, block_scale)``, ``block_scale`` (...,
    ceil(N/32), ceil(K/32)). The tile's amax picks its scale by ``mx_quantize``'s rules; edge
    tiles are partial (missing elements count as 0); a NaN or Inf makes the tile's scale 0xFF.
    Every 1x32 block lies inside one tile, so ``data`` serves the forward and the backward
    matmul; ``expand_block_scale`` gives the matching per-axis scales."""
    _check_weight(w, "w")
    _check_elem_dtype(elem_dtype)
    _check_scale_mode(scale_mode)

    rows, cols = w.shape[-2:]
    row_tiles, col_tiles = _num_blocks(rows), _num_blocks(cols)
    padded = torch.nn.functional.pad(
        w.to(torch.float64), (0, col_tiles * BLOCK - cols, 0, row_tiles * BLOCK - rows)
    )
    tiles = padded.reshape(*w.shape[:-2], row_tiles, BLOCK, col_tiles, BLOCK)

    tile_dims = (-3, -1)
    if row_tiles and col_tiles:  # amax refuses to reduce over an empty tensor
        amax = tiles.abs().amax(dim=tile_dims, keepdim=True)
    else:
        amax = tiles.sum(dim=tile_dims, keepdim=True)
    has_nonfinite = (~torch.isfinite(tiles)).any(dim=-1, keepdim=True).any(dim=-3, keepdim=True)
    exponent, scale_byte = _scale_exponent(amax, has_nonfinite, elem_dtype, scale_mode)

    elements = _to_elements(tiles, exponent, has_nonfinite, elem_dtype)
    data = elements.reshape(padded.shape)[..., :rows, :cols].contiguous()
    block_scale = scale_byte.squeeze(-1).squeeze(-2).contiguous().view(torch.float8_e8m0fnu)
    return data, block_scale


# ---- quantization from an FP32 master ------------------------------------------------------------


PARAM_DTYPES = (torch.bfloat16, torch.float16)


def _master_as_param(master, param_dtype):
    """The parameter an FP32 master stands for: ``master.to(param_dtype)``, torch's own rounding
    (nearest, ties to even; overflow to +-Inf; NaN stays NaN), which is what the optimizer writes
    into the parameter (``param.copy_(master)``)."""
    if not isinstance(master, torch.Tensor):
        raise TypeError(f"master must be a torch.Tensor, found {type(master).__name__}")
    if master.dtype != torch.float32:
        raise TypeError(
            f"master.dtype must be torch.float32 (the FP32 master weight), found {master.dtype}"
        )
    if param_dtype not in PARAM_DTYPES:
        raise TypeError(f"param_dtype must be one of {PARAM_DTYPES}, found {param_dtype}")
    return master.to(param_dtype)


def mx_quantize_from_master(
    master, dim=-1, param_dtype=torch.bfloat16, elem_dtype=torch.float8_e4m3fn, scale_mode="floor"
):
    """``mx_quantize(master.to(param_dtype), dim, elem_dtype, scale_mode)``: master float32,
    any rank >= 1; param_dtype bf16 or fp16."""
    return mx_quantize(_master_as_param(master, param_dtype), dim, elem_dtype, scale_mode)


def mx_quantize_dual_from_master(
    master, param_dtype=torch.bfloat16, elem_dtype=torch.float8_e4m3fn, scale_mode="floor"
):
    """``mx_quantize_dual(master.to(param_dtype), elem_dtype, scale_mode)``; master (N, K) or
    (E, N, K), float32."""
    _check_weight(master, "master")
    return mx_quantize_dual(_master_as_param(master, param_dtype), elem_dtype, scale_mode)


def mx_quantize_block_from_master(
    master, param_dtype=torch.bfloat16, elem_dtype=torch.float8_e4m3fn, scale_mode="floor"
):
    """``mx_quantize_block(master.to(param_dtype), elem_dtype, scale_mode)``; master (N, K) or
    (E, N, K), float32."""
    _check_weight(master, "master")
    return mx_quantize_block(_master_as_param(master, param_dtype), elem_dtype, scale_mode)


def expand_block_scale(block_scale, shape, dim):
    """The per-axis scale (contiguous ``torch.float8_e8m0fnu``) that ``block_scale`` (...,
    ceil(N/32), ceil(K/32)), from ``mx_quantize_block`` of a weight of ``shape`` (N, K) or
    (E, N, K), stands for. ``dim`` -1: the forward scale (..., N, ceil(K/32)), each tile row
    repeated for its 32 rows (cut to N); -2: the backward scale (..., ceil(N/32), K), each tile
    column repeated for its 32 columns (cut to K); non-negative spellings are accepted too."""
    shape = tuple(shape)
    if len(shape) not in (2, 3):
        raise ValueError(f"shape must be (N, K) or (E, N, K), found {shape}")
    if not isinstance(block_scale, torch.Tensor) or block_scale.dtype != torch.float8_e8m0fnu:
        found = block_scale.dtype if isinstance(block_scale, torch.Tensor) else type(block_scale)
        raise TypeError(f"block_scale must be a torch.float8_e8m0fnu tensor, found {found}")
    rows, cols = shape[-2:]
    expected = (*shape[:-2], _num_blocks(rows), _num_blocks(cols))
    if tuple(block_scale.shape) != expected:
        raise ValueError(
            f"block_scale of a weight of shape {shape} must have shape {expected}, "
            f"found {tuple(block_scale.shape)}"
        )
    dim = _normalize_dim(dim, len(shape))
    scale_byte = block_scale.view(torch.uint8)
    if dim == len(shape) - 1:
        expanded = scale_byte.repeat_interleave(BLOCK, dim=-2)[..., :rows, :]
    elif dim == len(shape) - 2:
        expanded = scale_byte.repeat_interleave(BLOCK, dim=-1)[..., :cols]
    else:
        raise ValueError(f"dim must be -1 (along K) or -2 (along N), found {dim - len(shape)}")
    return expanded.contiguous().view(torch.float8_e8m0fnu)


def mx_expand_block_scale(block_scale, n, k, dim):
    """``expand_block_scale`` for a weight with ``n`` rows and ``k`` columns (the op's
    signature: the leading dims of the shape are block_scale's)."""
    if not isinstance(block_scale, torch.Tensor):
        raise TypeError(
            f"block_scale must be a torch.float8_e8m0fnu tensor, found {type(block_scale)}"
        )
    return expand_block_scale(block_scale, (*block_scale.shape[:-2], n, k), dim)


# ---- dequantization and matmul -------------------------------------------------------------------


def mx_dequantize(data, scale, dim=-1, out_dtype=torch.bfloat16):
    """Inverse of ``mx_quantize``: ``element * 2^(byte - 127)`` per block along ``dim``, formed
    exactly, rounded to float32 (exact for every product in float32 range, byte 0 = 2^-127
    included; beyond it +-Inf), then to nearest even in ``out_dtype`` (bf16 / fp16 / fp32); a
    0xFF scale makes its block NaN. ``data`` (fp8, any rank >= 1) and ``scale`` (``data``'s
    shape with ``dim`` of size ``ceil(D / 32)``, E8M0) may have any strides; the result is
    contiguous, of ``data``'s shape."""
    if not isinstance(data, torch.Tensor) or data.dtype not in ELEM_MAX:
        found = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
        raise TypeError(f"data must be a tensor of dtype in {tuple(ELEM_MAX)}, found {found}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float8_e8m0fnu:
        found = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"scale must be a tensor of dtype torch.float8_e8m0fnu, found {found}")
    _check_out_dtype(out_dtype)
    dim = _normalize_dim(dim, data.dim())
    length = data.shape[dim]
    expected = list(data.shape)
    expected[dim] = _num_blocks(length)
    if list(scale.shape) != expected:
        raise ValueError(
            f"scale for data of shape {tuple(data.shape)} blocked along dim {dim} must have shape "
            f"{tuple(expected)}, found {tuple(scale.shape)}"
        )

    scale_per_element = scale.view(torch.uint8).repeat_interleave(BLOCK, dim=dim)
    scale_per_element = scale_per_element.narrow(dim, 0, length)
    product = data.to(torch.float64) * _e8m0_value(scale_per_element)
    return product.to(torch.float32).to(out_dtype).contiguous()


def mx_matmul(a, a_scale, b, b_scale, out_dtype=torch.bfloat16):
    """``a @ b.T`` (M, N) in ``out_dtype`` of two MX operands blocked along their shared K: ``a``
    (M, K) and ``b`` (N, K), fp8 (the two formats may differ, e.g. e5m2 gradients times e4m3
    weights), with E8M0 scales (M, ceil(K/32)) and (N, ceil(K/32)); both dequantized to float32
    and multiplied with float32 accumulation. Either operand may be a strided view, e.g. the
    ``.t()`` of a tensor blocked along its other axis with the ``.t()`` of its scale."""
    for name, operand in (("a", a), ("b", b)):
        if not isinstance(operand, torch.Tensor) or operand.dim() != 2:
            found = tuple(operand.shape) if isinstance(operand, torch.Tensor) else type(operand)
            raise ValueError(f"{name} must be a 2-d tensor (rows, K), found {found}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"a (M, K) and b (N, K) must share K, found a {tuple(a.shape)} and b {tuple(b.shape)}"
        )
    a_f32 = mx_dequantize(a, a_scale, dim=-1, out_dtype=torch.float32)
    b_f32 = mx_dequantize(b, b_scale, dim=-1, out_dtype=torch.float32)
    return (a_f32 @ b_f32.T).to(out_dtype)
