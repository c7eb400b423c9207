"""Bit-for-bit comparison of tensors: the one helper every test that says "bit for bit" uses.

torch.equal is not a bitwise comparison for floating point (it holds -0.0 equal to +0.0 and a NaN
unequal to itself) and refuses float8 dtypes; these helpers compare the tensors' bits, read as
integers of the element's width.
"""

import torch

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as integers of its element's width (detached, contiguous; bool as uint8)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(_INT_OF_WIDTH[t.element_size()])


def same_bits(a, b) -> bool:
    """Same shape, dtype and bits; for tuples or lists of tensors (an op's outputs), each."""
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def assert_bitwise(got, want, what="", nan_equal=False):
    """`got` has `want`'s shape, dtype and bits. With `nan_equal`, NaNs need only stand at the
    same places (their payload bits are not compared)."""
    assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor), what
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    )
    got_bits, want_bits = bits(got), bits(want)
    if nan_equal and got.dtype.is_floating_point:
        got_nan, want_nan = got.detach().isnan(), want.detach().isnan()
        assert torch.equal(got_nan, want_nan), f"{what}: NaN positions differ"
        got_bits = got_bits.masked_fill(got_nan, 0)
        want_bits = want_bits.masked_fill(want_nan, 0)
    assert torch.equal(got_bits, want_bits), _mismatches(got, want, got_bits, want_bits, what)


def _mismatches(got, want, got_bits, want_bits, what):
    where = (got_bits != want_bits).nonzero()[:5].tolist()
    pairs = [(w, got[tuple(w)].item(), want[tuple(w)].item()) for w in where]
    return f"{what}: bits differ at (index, got, expected) {pairs}"


def assert_bitwise_dicts(got, want, what=""):
    """Same keys, and each value bit for bit (state dicts, weights by name)."""
    assert got.keys() == want.keys(), (what, sorted(got), sorted(want))
    for k in want:
        assert_bitwise(got[k], want[k], f"{what} {k}")
