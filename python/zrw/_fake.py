"""Fake (meta) kernels of every zrw op: shapes and dtypes only, never data.

They let torch.compile, FakeTensor and torch.library.opcheck reason about the ops. Each one
mirrors the layout contract of the CPU kernel it stands for (see zrw.ops).
"""
import torch

BLOCK = 32


def _ceil_div(a: int, b: int):
    return (a + b - 1) // b


def _scale_shape(shape, dim: int):
    s = list(shape)
    s[dim] = _ceil_div(s[dim], BLOCK)
    return s


def _wrap(dim: int, ndim: int) -> int:
    torch._check(ndim > 0, lambda: "zrw: expected a tensor with at least one dimension")
    torch._check(-ndim <= dim < ndim, lambda: f"zrw: dim {dim} out of range for a {ndim}-d tensor")
    return dim % ndim


@torch.library.register_fake("zrw::mx_quantize")
def _(x, dim, elem_dtype, scale_mode):
    d = _wrap(dim, x.dim())
    return (
        x.new_empty(x.shape, dtype=elem_dtype),
        x.new_empty(_scale_shape(x.shape, d), dtype=torch.float8_e8m0fnu),
    )


@torch.library.register_fake("zrw::mx_quantize_dual")
def _(w, elem_dtype, scale_mode):
    nd = w.dim()
    return (
        w.new_empty(w.shape, dtype=elem_dtype),
        w.new_empty(_scale_shape(w.shape, nd - 1), dtype=torch.float8_e8m0fnu),
        w.new_empty(w.shape, dtype=elem_dtype),
        w.new_empty(_scale_shape(w.shape, nd - 2), dtype=torch.float8_e8m0fnu),
    )


@torch.library.register_fake("zrw::mx_quantize_block")
def _(w, elem_dtype, scale_mode):
    nd = w.dim()
    bshape = _scale_shape(_scale_shape(w.shape, nd - 1), nd - 2)
    return w.new_empty(w.shape, dtype=elem_dtype), w.new_empty(bshape, dtype=torch.float8_e8m0fnu)


@torch.library.register_fake("zrw::mx_dequantize")
def _(data, scale, dim, out_dtype):
    return data.new_empty(data.shape, dtype=out_dtype)


@torch.library.register_fake("zrw::mx_matmul")
def _(a, a_scale, b, b_scale, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.register_fake("zrw::quant_and_release")
def _(w, recipe, release, release_frozen, elem_dtype, scale_mode, name):
    nd = w.dim()
    if recipe == "mxfp8":
        return [
            w.new_empty(w.shape, dtype=elem_dtype),
            w.new_empty(_scale_shape(w.shape, nd - 1), dtype=torch.float8_e8m0fnu),
            w.new_empty(w.shape, dtype=elem_dtype),
            w.new_empty(_scale_shape(w.shape, nd - 2), dtype=torch.float8_e8m0fnu),
        ]
    data = w.new_empty(w.shape, dtype=elem_dtype)
    bshape = _scale_shape(_scale_shape(w.shape, nd - 1), nd - 2)
    return [
        data,
        w.new_empty(_scale_shape(w.shape, nd - 1), dtype=torch.float8_e8m0fnu),
        data,
        w.new_empty(_scale_shape(w.shape, nd - 2), dtype=torch.float8_e8m0fnu),
        w.new_empty(bshape, dtype=torch.float8_e8m0fnu),
    ]
