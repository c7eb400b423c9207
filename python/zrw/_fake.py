"""Fake kernels of zrw's ops: shapes and dtypes only, never data (docs/design.md §4, "Fakes").

Each stateless op and quant_and_release has one that mirrors the layout contract and the checks
of the CPU kernel (csrc/common/checks.h: the same exception types and messages, so a bad
argument fails while tracing, not later); the cache ops that take tensors get fakes that refuse.
"""

import torch

from .ops import SCALE_MODES

BLOCK = 32
_FLOAT_IN = (torch.bfloat16, torch.float16, torch.float32)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_E8M0 = torch.float8_e8m0fnu


def _ceil_div(a: int, b: int):
    return (a + b - 1) // b


def _scale_shape(shape, dim: int):
    s = list(shape)
    s[dim] = _ceil_div(s[dim], BLOCK)
    return s


def _check_devices(op: str, **tensors) -> None:
    """All tensor arguments on one device: one meta operand among CPU ones lands here."""
    first_name, first = next(iter(tensors.items()))
    for name, t in tensors.items():
        if t.device != first.device:
            raise RuntimeError(
                f"{op}: {name} must be on {first.device} like {first_name}, got a "
                f"tensor on {t.device}"
            )


def _check_float(op: str, arg: str, dtype) -> None:
    if dtype not in _FLOAT_IN:
        raise TypeError(
            f"{op}: {arg} must be torch.bfloat16, torch.float16 or torch.float32, got {dtype}"
        )


def _check_elem(op: str, arg: str, dtype) -> None:
    if dtype not in _FP8:
        raise TypeError(
            f"{op}: {arg} must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}"
        )


def _check_mode(op: str, mode: str) -> None:
    if mode not in SCALE_MODES:
        names = " or ".join(f'"{m}"' for m in SCALE_MODES)
        raise ValueError(f'{op}: scale_mode must be {names}, got "{mode}"')


def _check_scale(op: str, arg: str, s) -> None:
    if s.dtype != _E8M0:
        raise TypeError(f"{op}: {arg} must be torch.float8_e8m0fnu, got {s.dtype}")


def _wrap(op: str, arg: str, dim: int, ndim: int) -> int:
    if ndim == 0:
        raise IndexError(f"{op}: {arg} must have at least one dimension, got a 0-d tensor")
    if not -ndim <= dim < ndim:
        raise IndexError(
            f"{op}: dim must be in [{-ndim}, {ndim - 1}] for a {ndim}-d {arg}, got {dim}"
        )
    return dim % ndim


def _check_weight_rank(op: str, arg: str, w) -> None:
    if w.dim() not in (2, 3):
        raise ValueError(
            f"{op}: {arg} must be 2-d (N, K) or 3-d (E, N, K), got shape {list(w.shape)}"
        )


def _check_scale_matches(op, data_arg, scale_arg, data, scale, dim) -> None:
    expected = _scale_shape(data.shape, dim)
    if list(scale.shape) != list(expected):
        raise ValueError(
            f"{op}: {scale_arg} must have shape {list(expected)} for {data_arg} of "
            f"shape {list(data.shape)} blocked along dim {dim}, got "
            f"{list(scale.shape)}"
        )


def _check_quantize(op, x, weight, elem_dtype, scale_mode, param_dtype=None) -> None:
    """The checks of the quantize ops, in the kernels' order: the input (an FP32 master where
    `param_dtype` is given), a weight's rank, param_dtype, elem_dtype, scale_mode."""
    if param_dtype is None:
        _check_float(op, "w" if weight else "x", x.dtype)
    elif x.dtype != torch.float32:
        raise TypeError(
            f"{op}: master must be torch.float32 (the FP32 master weight), got {x.dtype}"
        )
    if weight:
        _check_weight_rank(op, "w" if param_dtype is None else "master", x)
    if param_dtype is not None and param_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(
            f"{op}: param_dtype must be torch.bfloat16 or torch.float16, got {param_dtype}"
        )
    _check_elem(op, "elem_dtype", elem_dtype)
    _check_mode(op, scale_mode)


def _axis_outputs(x, d, elem_dtype):
    """The one-axis outputs for an input of x's shape: data and scales along dim d."""
    return x.new_empty(x.shape, dtype=elem_dtype), x.new_empty(
        _scale_shape(x.shape, d), dtype=_E8M0
    )


def _dual_outputs(w, elem_dtype):
    """The dual-axis outputs for a weight of w's shape: data and scales along K, then along N."""
    return (*_axis_outputs(w, w.dim() - 1, elem_dtype), *_axis_outputs(w, w.dim() - 2, elem_dtype))


def _block_outputs(w, elem_dtype):
    """The 32x32 outputs for a weight of w's shape: data and one scale per tile."""
    bshape = _scale_shape(_scale_shape(w.shape, w.dim() - 1), w.dim() - 2)
    return w.new_empty(w.shape, dtype=elem_dtype), w.new_empty(bshape, dtype=_E8M0)


@torch.library.register_fake("zrw::mx_quantize")
def _(x, dim, elem_dtype, scale_mode):
    op = "zrw.mx_quantize"
    _check_quantize(op, x, False, elem_dtype, scale_mode)
    return _axis_outputs(x, _wrap(op, "x", dim, x.dim()), elem_dtype)


@torch.library.register_fake("zrw::mx_quantize_dual")
def _(w, elem_dtype, scale_mode):
    _check_quantize("zrw.mx_quantize_dual", w, True, elem_dtype, scale_mode)
    return _dual_outputs(w, elem_dtype)


@torch.library.register_fake("zrw::mx_quantize_block")
def _(w, elem_dtype, scale_mode):
    _check_quantize("zrw.mx_quantize_block", w, True, elem_dtype, scale_mode)
    return _block_outputs(w, elem_dtype)


# The *_from_master ops: an FP32 master quantized as its bf16/fp16 parameter; the outputs are
# those of the plain ops (the master's shape, never its dtype).
@torch.library.register_fake("zrw::mx_quantize_from_master")
def _(master, dim, param_dtype, elem_dtype, scale_mode):
    op = "zrw.mx_quantize_from_master"
    _check_quantize(op, master, False, elem_dtype, scale_mode, param_dtype)
    return _axis_outputs(master, _wrap(op, "master", dim, master.dim()), elem_dtype)


@torch.library.register_fake("zrw::mx_quantize_dual_from_master")
def _(master, param_dtype, elem_dtype, scale_mode):
    op = "zrw.mx_quantize_dual_from_master"
    _check_quantize(op, master, True, elem_dtype, scale_mode, param_dtype)
    return _dual_outputs(master, elem_dtype)


@torch.library.register_fake("zrw::mx_quantize_block_from_master")
def _(master, param_dtype, elem_dtype, scale_mode):
    op = "zrw.mx_quantize_block_from_master"
    _check_quantize(op, master, True, elem_dtype, scale_mode, param_dtype)
    return _block_outputs(master, elem_dtype)


@torch.library.register_fake("zrw::mx_dequantize")
def _(data, scale, dim, out_dtype):
    op = "zrw.mx_dequantize"
    _check_devices(op, data=data, scale=scale)
    _check_elem(op, "data", data.dtype)
    _check_scale(op, "scale", scale)
    _check_float(op, "out_dtype", out_dtype)
    d = _wrap(op, "data", dim, data.dim())
    _check_scale_matches(op, "data", "scale", data, scale, d)
    return data.new_empty(data.shape, dtype=out_dtype)


@torch.library.register_fake("zrw::mx_matmul")
def _(a, a_scale, b, b_scale, out_dtype):
    op = "zrw.mx_matmul"
    _check_devices(op, a=a, a_scale=a_scale, b=b, b_scale=b_scale)
    _check_elem(op, "a", a.dtype)
    _check_elem(op, "b", b.dtype)
    _check_scale(op, "a_scale", a_scale)
    _check_scale(op, "b_scale", b_scale)
    _check_float(op, "out_dtype", out_dtype)
    if a.dim() != 2:
        raise ValueError(f"{op}: a must be 2-d (M, K), got shape {list(a.shape)}")
    if b.dim() != 2:
        raise ValueError(f"{op}: b must be 2-d (N, K), got shape {list(b.shape)}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"{op}: a (M, K) and b (N, K) must share K (both blocked along K), got "
            f"a {list(a.shape)} and b {list(b.shape)}"
        )
    _check_scale_matches(op, "a", "a_scale", a, a_scale, 1)
    _check_scale_matches(op, "b", "b_scale", b, b_scale, 1)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.register_fake("zrw::mx_expand_block_scale")
def _mx_expand_block_scale_fake(block_scale, n, k, dim):
    op = "zrw.mx_expand_block_scale"
    _check_scale(op, "block_scale", block_scale)
    nd = block_scale.dim()
    tiles = (_ceil_div(n, BLOCK), _ceil_div(k, BLOCK))
    if nd not in (2, 3) or n < 0 or k < 0 or tuple(block_scale.shape[-2:]) != tiles:
        raise ValueError(
            f"{op}: block_scale of a weight with N={n}, K={k} must end in {tiles}, got shape "
            f"{tuple(block_scale.shape)}"
        )
    if dim in (-1, nd - 1):
        shape = (*block_scale.shape[:-2], n, block_scale.shape[-1])
    elif dim in (-2, nd - 2):
        shape = (*block_scale.shape[:-1], k)
    else:
        raise IndexError(
            f"{op}: dim must be -1 (the forward scale, blocks along K) or -2 (the "
            f"backward scale, blocks along N), got {dim}"
        )
    return block_scale.new_empty(shape)


@torch.library.register_fake("zrw::quant_and_release")
def _(w, recipe, release, release_frozen, elem_dtype, scale_mode, name, trainable=None):
    dual = list(_dual_outputs(w, elem_dtype))
    if recipe == "mxfp8":
        return dual
    data, block = _block_outputs(w, elem_dtype)
    return [data, dual[1], data, dual[3], block]


def _eager_only(name: str):
    def fake(*args, **kwargs):
        raise RuntimeError(
            f"zrw.{name} is a stateful, eager-only op (the native weight cache): it cannot run on "
            "fake or meta tensors or inside a compiled graph; zrw.cache wraps it with "
            "torch._dynamo.disable, so call it through zrw.cache"
        )

    return fake


# The cache ops that take tensors (weights; restore_all its skip list): no meaningful fake exists
# (their effect is on the weights' storage and the process-wide table), so the fake says so
# instead of pretending. The tensorless bookkeeping ops have none: no fake tensor reaches them.
_EAGER_ONLY = "restore restore_weights assign_weights cache_invalidate cache_state cache_states"
for _name in (*_EAGER_ONLY.split(), "cache_master", "restore_all"):
    torch.library.register_fake(f"zrw::{_name}")(_eager_only(_name))
