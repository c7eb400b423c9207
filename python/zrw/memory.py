"""Live and peak CPU memory, measured by zrw's counting allocator (docs/design.md §9).

`install()` wraps c10's CPU allocator, so every CPU tensor allocated afterwards is counted:
`current()` live bytes, `peak()` since install or the last `reset_peak()`, like
torch.cuda.memory_allocated / max_memory_allocated. Install it before the model is built:
blocks allocated earlier are invisible to it, and so are their frees. Fault injection on this
allocator is a test instrument: zrw.testing.fail_allocations.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from . import _C

__all__ = ["install", "installed", "current", "peak", "reset_peak", "window"]


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
    reset_peak()  # (refuses without the counting allocator)
    out = {"start": current()}
    try:
        yield out
    finally:
        out["end"] = current()
        out["peak"] = peak()
