"""Small timing helpers shared by the benchmarks."""
from __future__ import annotations

import time
from typing import Callable


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
        print("  " + "  ".join(str(c).rjust(w) if j else str(c).ljust(w)
                               for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))


def _fmt(c: object) -> str:
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 100 else f"{c:.0f}"
    return str(c)
