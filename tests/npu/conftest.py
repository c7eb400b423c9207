"""Fixtures of the NPU adapter tests: stand-in torch_npu operators, one fixture per schema variant.

The adapter's kernels are reached on CPU through the test-only mirror namespace
``torch.ops.zrw_npu_test`` (same kernel functions, CPU key; csrc/npu/npu_test_ops.cpp says why),
which the test library libzrw_npu_test_ops defines, not zrw._C (npu_test_ops.py loads it).
"""

import npu_test_ops
import pytest

import zrw  # noqa: F401  (loads zrw._C: the zrw ops)
from helpers.npu_standins import PINNED, SCHEMAS, StandIns

VARIANTS = (PINNED, "26.0.0")


@pytest.fixture(params=VARIANTS)
def npu_ops(request):
    """The stand-in operators with the schemas of the pinned torch_npu 2.13.0, then with the
    older op-plugin 26.0.0 ones (by-name argument placement)."""
    with StandIns(SCHEMAS[request.param]) as ops:
        ops.variant = request.param
        yield ops


@pytest.fixture
def npu_pinned():
    """The pinned torch_npu 2.13.0's schemas, for tests whose subject is not the schema."""
    with StandIns(SCHEMAS[PINNED]) as ops:
        yield ops


@pytest.fixture
def adapter():
    """The adapter's kernels, as CPU ops of the mirror namespace (loads the test library)."""
    return npu_test_ops.load()
