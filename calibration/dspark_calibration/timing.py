"""Timing helpers for hardware-curve profiling (numpy only).

A busy machine only ever makes a call slower, and it does so in bursts. So every size is timed in several
rounds that interleave all sizes (a burst lands on one round of many sizes, not on every call of one size),
the figure for a size is the median over its rounds, a size whose rounds still disagree is measured again,
and the table is made non-decreasing from the right: a slow outlier is capped by the cheaper cost measured
for a bigger size, instead of being carried up to every bigger size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
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


def spread(samples: Sequence[float]) -> float:
    """How much rounds disagree: (max - min) / median."""
    values = np.asarray(samples, dtype=float)
    return float((values.max() - values.min()) / np.median(values))


@dataclass(frozen=True)
class CostTable:
    """Seconds per size (non-decreasing) and the spread of the rounds each figure is the median of."""

    seconds: np.ndarray
    spreads: np.ndarray


def cost_table(sizes: Sequence[int], make_call: Callable[[int], Callable[[], object]], rounds: int = 5,
               repeats: int = 3, noisy: float = 0.25, retries: int = 2,
               progress: Callable[[int], None] | None = None, timer=median_seconds) -> CostTable:
    """Median seconds of `make_call(n)()` for every n in `sizes`, timed in `rounds` interleaved rounds of
    `repeats` calls each (a round's figure is `timer(call, repeats, warmup=0)`, the median of its calls); a size
    whose rounds spread by more than `noisy` gets another `rounds` rounds, up to `retries` times. `progress(n)`
    after each size's first rounds."""
    calls = [make_call(size) for size in sizes]
    for call in calls:  # warm-up: first runs allocate
        call()
    samples: list[list[float]] = [[] for _ in sizes]

    def measure(indices: list[int]) -> None:
        for round_ in range(rounds):
            shift = round_ % len(indices)  # each round starts elsewhere, so no size always follows the same one
            for index in indices[shift:] + indices[:shift]:
                samples[index].append(timer(calls[index], repeats, warmup=0))
                if progress and round_ == rounds - 1:
                    progress(sizes[index])

    measure(list(range(len(sizes))))
    for _ in range(retries):
        noisy_sizes = [i for i, s in enumerate(samples) if spread(s) > noisy]
        if not noisy_sizes:
            break
        measure(noisy_sizes)
    medians = np.array([np.median(s) for s in samples])
    return CostTable(np.minimum.accumulate(medians[::-1])[::-1], np.array([spread(s) for s in samples]))
