"""Test and benchmark instruments: fault injection, kernel counters, collective byte counts,
zrw.fsdp's shard quantization count. `import zrw` does not load it (`import zrw.testing` opts
in). It changes process-wide state (the allocator's failure plan, the CPU GEMM counters,
ProcessGroup's all-gather methods): use it from one thread, around the code under test; each
context manager restores what it changed.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Dict, Iterator

from . import _C, fsdp, memory

__all__ = [
    "fail_allocations",
    "pending_failures",
    "gemm_counts",
    "reset_gemm_counts",
    "count_all_gather_bytes",
    "shard_quantizations",
]


def _non_negative_int(fn: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"zrw.testing.{fn}: {name} must be an int >= 0, got {type(value).__name__} {value!r}"
        )
    if value < 0:
        raise ValueError(f"zrw.testing.{fn}: {name} must be an int >= 0, got {value}")
    return value


def fail_allocations(min_bytes: int = 0, count: int = 1, after: int = 0) -> ContextManager[None]:
    """Fault injection (test builds only, ZRW_TEST_OPS=ON): within the block, of the CPU
    allocations of at least `min_bytes`, the first `after` succeed and the `count` after them
    raise torch.OutOfMemoryError, as a real out-of-memory would. Needs zrw.memory's counting
    allocator: allocations go through it only once zrw.memory.install() ran (a storage created
    earlier keeps the allocator it had). On exit the failures not yet consumed are cancelled.
    Wrong arguments are refused by the call itself, before the block."""
    min_bytes = _non_negative_int("fail_allocations", "min_bytes", min_bytes)
    count = _non_negative_int("fail_allocations", "count", count)
    after = _non_negative_int("fail_allocations", "after", after)
    if not _C.fault_injection_built():
        raise RuntimeError(
            "zrw.testing.fail_allocations: this build of zrw has no fault injection (it is "
            "compiled into test builds only: build with ZRW_TEST_OPS=ON, the default)"
        )
    if not memory.installed():
        raise RuntimeError(
            "zrw.testing.fail_allocations: the counting allocator is not installed: call "
            "zrw.memory.install() before building the tensors whose allocations should fail"
        )
    return _failing(min_bytes, count, after)


@contextlib.contextmanager
def _failing(min_bytes: int, count: int, after: int) -> Iterator[None]:
    _C.memory_fail_next(min_bytes, after, count)
    try:
        yield
    finally:
        _C.memory_fail_next(0, 0, 0)


def pending_failures() -> int:
    """Failures that fail_allocations planned and that have not happened yet (0 without the
    counting allocator)."""
    return _C.memory_pending_failures() if memory.installed() else 0


def gemm_counts() -> Dict[str, int]:
    """CPU mx_matmul calls per inner GEMM since the last reset_gemm_counts() (process-wide):
    {"fp32": n, "bf16": n, "bf16_to_fp32": n}, the last counting the calls that would have taken
    the BF16 GEMM but took the FP32 one (scales at the e8m0 extremes, NaN blocks)."""
    return dict(_C.cpu_gemm_counts())


def reset_gemm_counts() -> None:
    """Set every gemm_counts() counter to 0."""
    _C.cpu_reset_gemm_counts()


@contextlib.contextmanager
def count_all_gather_bytes() -> Iterator[Dict[str, int]]:
    """Count the bytes all-gathered at the process group: for the block, wraps
    ProcessGroup.all_gather_single (what FSDP2 calls) and ProcessGroup._allgather_base
    (all_gather_into_tensor) of every process group in the process. Yields a dict with "bytes"
    (output bytes: what each rank receives, its own shard included) and "calls", updated as
    collectives run; the methods are put back on exit."""
    from torch.distributed import ProcessGroup

    counts = {"bytes": 0, "calls": 0}
    originals = {}
    for meth in ("all_gather_single", "_allgather_base"):
        orig = getattr(ProcessGroup, meth, None)
        if orig is None:
            continue
        originals[meth] = orig

        def counting(self, output_tensor, input_tensor, *args, _orig=orig, **kwargs):
            counts["bytes"] += output_tensor.numel() * output_tensor.element_size()
            counts["calls"] += 1
            return _orig(self, output_tensor, input_tensor, *args, **kwargs)

        setattr(ProcessGroup, meth, counting)
    try:
        yield counts
    finally:
        for meth, orig in originals.items():
            setattr(ProcessGroup, meth, orig)


def shard_quantizations() -> int:
    """How many times this process quantized a zrw.fsdp.PreQuantWeight's shard for an FSDP2
    all-gather since it started: once per weight and optimizer step (every micro-batch's gather
    and the backward re-gather reuse it)."""
    with fsdp._lock:
        return fsdp._stats["shard_quantizations"]
