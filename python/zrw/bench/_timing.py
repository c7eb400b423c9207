"""Small timing and measuring helpers shared by the benchmarks."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from collections import Counter
from typing import Callable, Sequence

import torch

import zrw


def cpu_model() -> str:
    """The CPU's name as /proc/cpuinfo gives it ("model name"), else the platform's."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


# The CPU features that set a machine's class in docs/benchmarks.md (AVX2; AVX-512 with
# avx512_bf16; AMX): which kernels run, and which GEMM torch has for bf16.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_flags() -> list[str]:
    """Those of CPU_FLAGS that /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [x for x in CPU_FLAGS if x in have]
    except OSError:
        pass
    return []


def _git(*args: str) -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(zrw.__file__))))
    try:
        out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.rstrip() if out.returncode == 0 else None


def stamp() -> dict:
    """What a benchmark's figures were measured on, put in every --json object: the CPU model
    and its class-setting features, the kernel ISA and GEMM path zrw picked, torch's and zrw's
    versions, and the commit of the source tree (None outside a git checkout; `dirty` lists the
    files under csrc/ and python/ that differ from it). `python -m zrw.bench report` prints it
    over each table it makes."""
    commit = _git("rev-parse", "--short", "HEAD")
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", "csrc", "python")
    return {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_isa": zrw._C.cpu_isa(),
        "gemm_path": zrw._C.cpu_gemm(),
        "native_bf16": bool(zrw._C.cpu_native_bf16()),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "zrw": zrw.__version__,
        "commit": commit,
        # the files under csrc/ and python/ that differ from the commit (empty: a clean tree)
        "dirty": sorted(line[3:] for line in changed.splitlines()) if changed else [],
        # the command's arguments (`python -m zrw.bench` + these) and the 1-minute load average
        # when the figures were taken: a shared machine's load moves every time
        "argv": sys.argv[1:],
        "load_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def best_of(fn: Callable[[], object], repeat: int = 7, warmup: int = 2) -> float:
    """Best wall time in seconds over `repeat` calls, after `warmup` calls.

    The minimum, not the mean: on a shared 2-core machine the noise is all upward.
    """
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    cells = [header] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(header))]
    print(title)
    for i, r in enumerate(cells):
        print(
            "  "
            + "  ".join(
                str(c).rjust(w) if j else str(c).ljust(w) for j, (c, w) in enumerate(zip(r, widths))
            )
        )
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))


def _fmt(c: object) -> str:
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 100 else f"{c:.0f}"
    return str(c)


def best_of_interleaved(
    fns: dict[str, Callable[[], object]], rounds: int = 7, warmup: int = 2
) -> dict[str, float]:
    """Best wall time in seconds of each function, calling them in turn for `rounds` rounds.

    Round-robin rather than one function after the other: this machine's speed drifts over
    seconds (shared host), and interleaving lets every function see the same drift, so their
    ratios stay meaningful even when the absolute times move.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def glibc_malloc(mmap_threshold: int, trim_threshold: int) -> bool:
    """Sets glibc's M_MMAP_THRESHOLD and M_TRIM_THRESHOLD for this process; False where the C
    library is not glibc (or refuses the values). Setting them turns off glibc's dynamic
    thresholds for the rest of the process, so only the benchmarks' own processes call this."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )


def warm_heap() -> bool:
    """Keep freed memory in glibc's heap (blocks up to 32 MiB from the heap, no trimming), so
    that a kernel's output allocation reuses pages instead of faulting in fresh ones."""
    return glibc_malloc(32 << 20, 1 << 30)


def fresh_pages() -> bool:
    """Serve every block of 64 KiB or more with fresh pages (mmap per allocation, munmap on
    free): what a kernel pays when the allocator has returned its memory to the OS."""
    return glibc_malloc(64 << 10, 128 << 10)


def recording(fn: Callable, record: Callable[[float], None]) -> Callable:
    """fn, wrapped to pass the seconds of each call (also one that raises) to `record`."""

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record(time.perf_counter() - t0)

    return timed


def typical_step(savings: Sequence[int]) -> int:
    """The step (after the first, unless there is only one) whose saving the most steps measured
    to the byte; among values measured equally often, the one nearest the median (the lower
    middle), then the smaller; the earliest step with it.

    A step's saving is the difference of two deterministic peaks (both modes train the same
    data), so steps without noise agree to the byte, whatever the routing does to the peaks
    themselves. The noise is one-off and one-sided: a gloo worker thread drops its reference to
    a collective's buffers after the waiting rank has moved on, at a moment the scheduler picks,
    so now and then they are still alive at one step's peak in one mode (at the tests' tiny
    shapes, the all-gathered logits of a TP lm_head and their shard: 32-40 KiB), which moves that
    step's saving by that much. The median would need more than half the steps clean; the most
    common value needs only that the clean steps outnumber each repeated noise value. With two
    measured steps that differ it is the lower one, as the median's lower middle was.
    """
    steps = list(range(1, len(savings))) or [0]
    counts = Counter(savings[i] for i in steps)
    mid = sorted(savings[i] for i in steps)[(len(steps) - 1) // 2]
    best = min(counts, key=lambda v: (-counts[v], abs(v - mid), v))
    return next(i for i in steps if savings[i] == best)
