"""Comparing MX quantizations byte for byte, stable seeds and ids, and the CPU kernel builds this
machine runs (shared by tests/ops/test_quantize.py and test_quantize_from_master.py)."""

import math
import zlib

import torch

from zrw import reference as ref

E8M0 = torch.float8_e8m0fnu
NAN_BYTE = 0xFF
BLOCK = 32


def as_bytes(t):
    return t.view(torch.uint8)


def stable_seed(*parts):
    """A seed from the test's parameters that is the same in every run (hash() is salted)."""
    return zlib.crc32(repr(parts).encode())


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


class RowsOfBlocks:
    """A tensor of `shape` blocked along `dim`, built as `rows` rows of `nblocks` blocks of 32
    (the blocked axis last, padded to whole blocks) and moved into place by `place`."""

    def __init__(self, shape, dim):
        self.shape = tuple(shape)
        self.dim = dim % len(self.shape)
        self.length = self.shape[self.dim]
        self.moved_shape = self.shape[: self.dim] + self.shape[self.dim + 1 :] + (self.length,)
        self.rows = math.prod(self.moved_shape[:-1])
        self.nblocks = -(-self.length // BLOCK)

    def place(self, blocks):
        """(rows, nblocks, 32) or (rows, nblocks * 32) values as a contiguous tensor of `shape`."""
        x = blocks.reshape(self.rows, self.nblocks * BLOCK)[:, : self.length]
        return x.reshape(self.moved_shape).movedim(-1, self.dim).contiguous()


# ------------------------------------------------------------------------------------------------
# comparison


def nan_block_mask(scale, shape, dim):
    """Elements (of a tensor of ``shape`` blocked along ``dim``) whose block has scale byte 0xFF."""
    dim = dim % len(shape)
    per_element = (as_bytes(scale) == NAN_BYTE).repeat_interleave(BLOCK, dim=dim)
    return per_element.narrow(dim, 0, shape[dim])


def assert_same_quantization(got, expected, dim, what=""):
    """(data, scale) pairs equal byte for byte, except the elements of 0xFF blocks."""
    got_data, got_scale = got
    exp_data, exp_scale = expected
    assert got_data.shape == exp_data.shape, what
    assert got_data.dtype == exp_data.dtype, what
    assert got_scale.shape == exp_scale.shape, what
    assert got_scale.dtype == E8M0, what
    assert got_data.is_contiguous() and got_scale.is_contiguous(), what
    scale_equal = torch.equal(as_bytes(got_scale), as_bytes(exp_scale))
    assert scale_equal, f"{what}: scale bytes differ at {_first_mismatches(got_scale, exp_scale)}"
    mask = nan_block_mask(exp_scale, exp_data.shape, dim)
    got_bytes = as_bytes(got_data).masked_fill(mask, 0)
    exp_bytes = as_bytes(exp_data).masked_fill(mask, 0)
    assert torch.equal(got_bytes, exp_bytes), (
        f"{what}: element bytes differ at {_first_mismatches(got_bytes, exp_bytes)}"
    )


def _first_mismatches(a, b, count=5):
    a, b = a.view(torch.uint8), b.view(torch.uint8)
    where = (a != b).nonzero()[:count]
    return [(tuple(i.tolist()), a[tuple(i)].item(), b[tuple(i)].item()) for i in where]


def assert_block_quantization_equal(got, expected, shape, what=""):
    """(data, block_scale) pairs equal byte for byte, except the elements of 0xFF tiles."""
    got_data, got_scale = got
    exp_data, exp_scale = expected
    assert got_scale.shape == exp_scale.shape and got_scale.dtype == E8M0, what
    assert torch.equal(as_bytes(got_scale), as_bytes(exp_scale)), (
        f"{what}: block scale bytes differ at {_first_mismatches(got_scale, exp_scale)}"
    )
    fwd_scale = ref.expand_block_scale(exp_scale, shape, -1)
    assert_same_quantization((got_data, fwd_scale), (exp_data, fwd_scale), -1, what)


# ------------------------------------------------------------------------------------------------
# every CPU kernel build (ZRW_CPU_ISA)


def cpu_flags():
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# ZRW_CPU_ISA -> the CPU flags its kernel build needs.
ISA_REQUIREMENTS = {
    "base": set(),
    "avx2": {"avx2", "fma"},
    "avx512": {"avx512f", "avx512bw", "avx512vl"},
}


# ------------------------------------------------------------------------------------------------
# float8 as bytes (torch's comparisons do not understand float8)

FP8_DTYPES = {
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    E8M0,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
}


def is_fp8(t):
    return isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES


def bytes_if_fp8(t):
    return t.view(torch.uint8) if is_fp8(t) else t
