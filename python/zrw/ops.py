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
        return block_scale.repeat_interleave(32, dim=-2)[..., :n, :].contiguous()
    if dim in (-2, nd - 2):
        return block_scale.repeat_interleave(32, dim=-1)[..., :k].contiguous()
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
    emulated: a is dequantized to fp32 once and b tile by tile (exact: an MX value times a power
    of two is an fp32 value), then multiplied by the fp32 GEMM; a hardware MX GEMM where the
    backend has one.
    """
    return torch.ops.zrw.mx_matmul(a, a_scale, b, b_scale, out_dtype)


# ------------------------------------------------------------------------------------------------
# The native weight cache (DESIGN.md §5). These are stateful, eager-only ops: they run from
# layers and optimizer hooks, never inside a compiled graph (dynamo is told to skip them).

import contextlib  # noqa: E402
import threading  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Dict, Iterator, List, Optional  # noqa: E402

RECIPES = ("mxfp8", "mxfp8-32x32")
FILLS = ("empty", "zeros", "dequant", "master")

_release_state = threading.local()


@contextlib.contextmanager
def no_release() -> Iterator[None]:
    """Within this block quant_and_release caches FP8 copies but never releases a BF16 storage.

    For code that never reaches an optimizer step (an eval pass, a reference model): nothing
    would restore what it released. `torch.no_grad()` has the same effect.
    """
    prev = getattr(_release_state, "disabled", 0)
    _release_state.disabled = prev + 1
    try:
        yield
    finally:
        _release_state.disabled = prev


def release_enabled() -> bool:
    """False inside zrw.no_release()."""
    return getattr(_release_state, "disabled", 0) == 0


@dataclass(frozen=True)
class MXPlane:
    """One GEMM direction's operand: fp8 data and its e8m0 scale (blocks of 32 along one axis)."""

    data: Tensor
    scale: Tensor

    def __iter__(self):
        return iter((self.data, self.scale))


@dataclass(frozen=True)
class MXWeight:
    """The cached MXFP8 copy of one weight W (N, K) or (E, N, K).

    fwd: data (.., N, K) blocked along K with scale (.., N, ceil(K/32)) — the forward GEMM's
    operand. bwd: data (.., N, K) blocked along N with scale (.., ceil(N/32), K) — dgrad uses
    bwd.data.t(). For "mxfp8-32x32", fwd.data is bwd.data (one FP8 tensor) and block_scale
    (.., ceil(N/32), ceil(K/32)) is set; fwd/bwd scales are its row/column expansions.
    """

    recipe: str
    fwd: MXPlane
    bwd: MXPlane
    block_scale: Optional[Tensor] = None

    @staticmethod
    def from_tensors(recipe: str, tensors: List[Tensor]) -> "MXWeight":
        if recipe == "mxfp8":
            df, sf, db, sb = tensors
            return MXWeight(recipe, MXPlane(df, sf), MXPlane(db, sb))
        data, sf, data_b, sb, block = tensors
        return MXWeight(recipe, MXPlane(data, sf), MXPlane(data_b, sb), block)


@torch._dynamo.disable
def quant_and_release(
    w: Tensor,
    recipe: str = "mxfp8",
    release: bool = True,
    *,
    release_frozen: bool = False,
    elem_dtype: torch.dtype = E4M3,
    scale_mode: str = "floor",
    name: Optional[str] = None,
) -> MXWeight:
    """The fused op of zero-redundancy weights: cache lookup; on a miss quantize, insert, release.

    On the first call in a step, w (N, K) or (E, N, K) is quantized ("mxfp8": both 1x32 planes
    from one read; "mxfp8-32x32": one copy with 32x32 tiles) and filed in the native cache; its
    storage is released (freed and poisoned) when the guard allows: a leaf that requires grad,
    under grad mode, outside zrw.no_release(), whose storage it alone owns and fills exactly.
    Frozen weights (requires_grad=False) are released only with release_frozen=True, and then
    stay FP8-only for good. Later calls in the same step return the cached tensors without
    touching w. `name` appears in the error raised by any access to the released weight; None
    takes the name set with `set_weight_name` (the layers set their parameters' names there, so
    that a compiled forward never reads a per-layer string and recompiles for each layer).
    """
    release = release and release_enabled()
    if name is None:
        name = weight_name(w)
    tensors = torch.ops.zrw.quant_and_release(
        w, recipe, release, release_frozen, elem_dtype, scale_mode, name
    )
    return MXWeight.from_tensors(recipe, tensors)


def set_weight_name(w: Tensor, name: str) -> None:
    """Name `w` for zrw's messages (the release poison, cache_entries) where a call passes none."""
    w._zrw_name = name


def weight_name(w: Tensor) -> str:
    """The name set with `set_weight_name`, or ""."""
    return getattr(w, "_zrw_name", "") or ""


def _check_fill(op: str, fill: str) -> None:
    if fill not in FILLS:
        raise ValueError(f"{op}: fill must be one of {FILLS}, got {fill!r}")


# Masters registered by zrw.optim.MasterWeights: weight -> its FP32 master, keyed weakly by
# identity (a WeakKeyDictionary would compare tensors with ==, elementwise).
from torch.utils.weak import WeakIdKeyDictionary  # noqa: E402

_masters = WeakIdKeyDictionary()


def register_master(weight: Tensor, master: Tensor) -> None:
    """Record the FP32 master of `weight` so that fill="master" can restore it exactly."""
    _masters[weight] = master


def _fill_from_master(w: Tensor, op: str) -> None:
    master = _masters.get(w)
    if master is None:
        raise ValueError(
            f"{op}: fill='master' needs the weight's FP32 master, but this weight (shape "
            f"{tuple(w.shape)}) has none: wrap the optimizer in zrw.optim.MasterWeights, or use "
            "fill='dequant' (lossy)"
        )
    with torch.no_grad():
        w.copy_(master)


@torch._dynamo.disable
def restore(w: Tensor, fill: str = "master") -> bool:
    """Bring back one released weight's BF16 storage (original byte count) and drop its entry.

    fill: "master" (bf16 of the MasterWeights FP32 master — exactly what the optimizer would
    write; for a mid-step checkpoint or eval), "dequant" (from the FP8 copy; lossy), "zeros", or
    "empty" (uninitialized; only when something overwrites it next). Returns False, doing
    nothing, for a weight that is not released (never was, or already restored).
    """
    _check_fill("zrw.ops.restore", fill)
    if fill == "master":
        if torch.ops.zrw.cache_state(w) < 2:
            return False
        master = _masters.get(w)
        if master is None:
            _fill_from_master(w, "zrw.ops.restore")  # raises the explanatory error
        torch.ops.zrw.restore(w, "empty")
        _fill_from_master(w, "zrw.ops.restore")
        return True
    return torch.ops.zrw.restore(w, fill)


@torch._dynamo.disable
def restore_all(fill: str = "empty") -> int:
    """The optimizer boundary: drop every FP8 entry and restore every released BF16 storage.

    Entries of frozen weights released with release_frozen survive. With fill="master" the
    weights known to MasterWeights get their masters' values; any other released weight is
    restored by dequantization. Returns the number of weights restored.
    """
    _check_fill("zrw.ops.restore_all", fill)
    if fill != "master":
        return torch.ops.zrw.restore_all(fill)
    n = 0
    for w in list(_masters.keys()):
        if torch.ops.zrw.cache_state(w) == 2:  # released this step; frozen (3) ones stay FP8
            n += bool(restore(w, "master"))
    return n + torch.ops.zrw.restore_all("dequant")


def cache_state(w: Tensor) -> int:
    """0: w has no cache entry; 1: its FP8 copy is cached; 2: cached and its storage released
    until the optimizer boundary; 3: released for good (a frozen weight, release_frozen)."""
    return torch.ops.zrw.cache_state(w)


def is_released(w: Tensor) -> bool:
    """Whether w's BF16 storage is currently released by zrw."""
    return torch.ops.zrw.cache_state(w) >= 2


def is_cached(w: Tensor) -> bool:
    """Whether the cache holds an FP8 copy of w."""
    return torch.ops.zrw.cache_state(w) != 0


def next_step() -> None:
    """Start a new optimizer step: every trainable weight is re-quantized at its next use."""
    torch.ops.zrw.next_step()


def cache_clear(fill: str = "dequant") -> None:
    """Drop every entry; released weights are restored first (default by dequantization, the
    only source left for a frozen weight — lossy), so no weight loses its only copy."""
    _check_fill("zrw.ops.cache_clear", fill)
    if fill == "master":
        restore_all("master")
        fill = "dequant"
    torch.ops.zrw.cache_clear(fill)


def cache_invalidate(w: Tensor, fill: str = "dequant") -> bool:
    """Drop w's entry (restoring it first with `fill` if released). False if w had none."""
    _check_fill("zrw.ops.cache_invalidate", fill)
    if fill == "master":
        restored = restore(w, "master")
        return torch.ops.zrw.cache_invalidate(w, "dequant") or restored
    return torch.ops.zrw.cache_invalidate(w, fill)


def cache_stats() -> Dict[str, int]:
    """entries, fp8_bytes (held), released / released_bytes (BF16 bytes currently freed), frozen,
    hits, misses, step, and skip_<reason> counts: release_false, no_grad, non_leaf, frozen,
    flat_buffer (storage larger than the tensor or at an offset), aliased (storage shared)."""
    names, values = torch.ops.zrw.cache_stats()
    return dict(zip(names, values))


def cache_entries() -> List[Dict[str, object]]:
    """One dict per entry: name, status ("released" or the skip reason), hits, misses,
    storage_bytes."""
    cols = torch.ops.zrw.cache_entries()
    keys = ("name", "status", "hits", "misses", "storage_bytes")
    return [dict(zip(keys, row)) for row in zip(*cols)]
