"""Live and peak CPU memory, measured by zrw's counting allocator (DESIGN.md §9).

`install()` wraps c10's CPU allocator (c10::SetCPUAllocator), so every CPU tensor allocated
afterwards is counted: `current()` live bytes, `peak()` since install or the last `reset_peak()`,
like torch.cuda.memory_allocated / max_memory_allocated. Install it before the model is built:
blocks allocated earlier are invisible to it, and so are their frees. RSS is too coarse for this
and the CPU profiler does not see frees of earlier blocks either.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from . import _C


def install() -> None:
    """Start counting (idempotent). Tensors that already exist are not counted."""
    _C.memory_install()


def installed() -> bool:
    return _C.memory_installed()


def _require() -> None:
    if not _C.memory_installed():
        raise RuntimeError(
            "zrw.memory: the counting allocator is not installed: call zrw.memory.install() "
            "before building the model whose memory you measure"
        )


def current() -> int:
    """Live bytes of CPU tensors allocated since install()."""
    _require()
    return _C.memory_current()


def peak() -> int:
    """Peak live bytes since install() or the last reset_peak()."""
    _require()
    return _C.memory_peak()


def reset_peak() -> None:
    """Set the peak to the current live bytes."""
    _require()
    _C.memory_reset_peak()


@contextlib.contextmanager
def window() -> Iterator[dict]:
    """Measure a region: yields a dict that gets start, end and peak bytes when the block exits."""
    _require()
    reset_peak()
    out = {"start": current()}
    try:
        yield out
    finally:
        out["end"] = current()
        out["peak"] = peak()


@contextlib.contextmanager
def fail_allocations(min_bytes: int = 0, count: int = 1, after: int = 0) -> Iterator[None]:
    """Fault injection for tests: within the block, of the CPU allocations of at least
    `min_bytes`, the first `after` succeed and the `count` after them raise
    torch.OutOfMemoryError, as a real out-of-memory would. Allocations go through the counting
    allocator only once install() ran (a storage created earlier keeps the allocator it had)."""
    _require()
    if min(min_bytes, count, after) < 0:
        raise ValueError(f"zrw.memory.fail_allocations: min_bytes, count and after must be >= 0, "
                         f"got {min_bytes}, {count} and {after}")
    _C.memory_fail_next(int(min_bytes), int(after), int(count))
    try:
        yield
    finally:
        _C.memory_fail_next(0, 0, 0)


def pending_failures() -> int:
    """Injected allocation failures that have not happened yet."""
    return _C.memory_pending_failures() if _C.memory_installed() else 0
