"""Verify mode (docs/design.md §5): `verify()`, or ZRW_VERIFY=1 for a whole run, makes every use
of a cached weight re-quantize the weight's current value and compare the bytes with the copy
it is served (zrw.lifecycle.use calls `check`); a mismatch raises StaleCopyError naming the
weight and the last lifecycle event that touched it. Users turn it on for a few steps of their
own training to prove no stale copy reaches a GEMM."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import ContextManager, Iterator, List

import torch
from torch import Tensor

from . import ops

_ENV = os.environ.get("ZRW_VERIFY", "") not in ("", "0")
_local = threading.local()


class StaleCopyError(RuntimeError):
    """verify mode: a cached FP8 copy is not the quantization of its weight's current value."""


def verify(enabled: bool = True) -> ContextManager[None]:
    """Within this block every use of a cached weight re-quantizes the weight's current value
    and compares the bytes with the copy it is served; a mismatch raises StaleCopyError naming
    the weight and the last lifecycle event that touched it. ZRW_VERIFY=1 turns it on for a
    whole run. A wrong `enabled` is refused by the call, before the block."""
    if not isinstance(enabled, bool):
        raise TypeError(f"zrw.cache.verify: enabled must be a bool, got {type(enabled).__name__}")
    return _block(enabled)


@contextlib.contextmanager
def _block(enabled: bool) -> Iterator[None]:
    prev = getattr(_local, "on", None)
    _local.on = enabled
    try:
        yield
    finally:
        _local.on = prev


def verifying() -> bool:
    on = getattr(_local, "on", None)
    return _ENV if on is None else on


def expected_tensors(value: Tensor, layout: tuple) -> List[Tensor]:
    """The quantization of `value` in the native entry's tensor order (layout: recipe, element
    dtype, scale mode)."""
    recipe, elem_dtype, scale_mode = layout
    if recipe == "mxfp8":
        return list(ops.mx_quantize_dual(value, elem_dtype, scale_mode))
    data, block = ops.mx_quantize_block(value, elem_dtype, scale_mode)
    fwd = ops.expand_block_scale(block, value.shape, -1)
    return [data, fwd, data, ops.expand_block_scale(block, value.shape, -2), block]


def _bits(t: Tensor) -> Tensor:
    return t.detach().contiguous().view(torch.uint8)


def check(served: List[Tensor], value: Tensor, layout: tuple, name: str, state: str, event: str):
    """Raise StaleCopyError unless `served` is the quantization of `value`."""
    with torch.inference_mode():
        want = expected_tensors(value, layout)
    for i, (a, b) in enumerate(zip(served, want)):
        if a.shape != b.shape or not torch.equal(_bits(a), _bits(b)):
            raise StaleCopyError(
                f"zrw.cache.verify: the FP8 copy served for weight {name!r} ({state}) is stale: "
                f"tensor {i} differs from the quantization of its current value; last "
                f"lifecycle event: {event or 'none'}"
            )
