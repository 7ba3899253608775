"""Timing helpers for hardware-curve profiling: median wall time of a call after warm-up (numpy only)."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np


def median_seconds(call: Callable[[], object], repeats: int = 7, warmup: int = 2) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def cost_table(sizes: Sequence[int], make_call: Callable[[int], Callable[[], object]], repeats: int = 7,
               progress: Callable[[int], None] | None = None) -> np.ndarray:
    """Median seconds of `make_call(n)()` for every n in `sizes`, made non-decreasing.

    A bigger batch never costs less in a real step; the running maximum removes timer noise that would
    otherwise make the scheduler chase dips in the curve.
    """
    costs = []
    for size in sizes:
        costs.append(median_seconds(make_call(size), repeats))
        if progress:
            progress(size)
    return np.maximum.accumulate(np.asarray(costs))
