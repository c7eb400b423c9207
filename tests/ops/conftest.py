"""Fixtures of the op tests."""

import pytest
import torch
from torch.utils import _pytree as pytree

from helpers.quant import bytes_if_fp8, is_fp8


@pytest.fixture
def fp8_aware_comparisons(monkeypatch):
    """torch.allclose and torch.testing.assert_close that compare float8 tensors as their bytes
    (and NaN as equal to NaN), for torch.library.opcheck: test_opcheck.py's docstring says why."""
    original_allclose = torch.allclose
    original_assert_close = torch.testing.assert_close

    def allclose(input, other, *args, **kwargs):
        if is_fp8(input) or is_fp8(other):
            return input.dtype == other.dtype and torch.equal(
                bytes_if_fp8(input), bytes_if_fp8(other)
            )
        return original_allclose(input, other, *args, **kwargs)

    def assert_close(actual, expected, *args, **kwargs):
        actual, expected = pytree.tree_map(bytes_if_fp8, (actual, expected))
        kwargs.setdefault("equal_nan", True)
        return original_assert_close(actual, expected, *args, **kwargs)

    monkeypatch.setattr(torch, "allclose", allclose)
    monkeypatch.setattr(torch.testing, "assert_close", assert_close)
