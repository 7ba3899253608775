"""Profiling statistics: one slow round does not move a size's figure nor reach bigger sizes, a noisy size is
measured again, and rounds interleave the sizes (timed by a scripted clock, not the machine's)."""

from __future__ import annotations

import numpy as np

from dspark_calibration.timing import cost_table, spread


def scripted(costs: dict[int, list[float]], log: list[int]):
    """A timer that returns the next scripted figure of the size a call belongs to, and logs the order."""
    def timer(call, repeats, warmup=0):
        size = call()
        log.append(size)
        return costs[size].pop(0)
    return timer


def test_a_slow_round_neither_moves_its_size_nor_reaches_bigger_ones():
    # size 2 has one slow round (a burst on the machine); the old running maximum carried 9.0 to sizes 3 and 4
    costs = {1: [1.0] * 5, 2: [2.0, 9.0, 2.1, 2.0, 1.9], 3: [3.0] * 5, 4: [4.0] * 5}
    costs[2] += [2.0] * 10  # the re-measurement its spread triggers
    log: list[int] = []
    table = cost_table([1, 2, 3, 4], lambda n: lambda: n, timer=scripted(costs, log))
    assert table.seconds.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert log[:4] == [1, 2, 3, 4] and log[4:8] == [2, 3, 4, 1]  # interleaved, each round starting elsewhere
    assert log.count(2) == 15 and log.count(1) == 5  # only the noisy size was measured again (twice: still noisy)
    assert table.spreads[1] == spread([2.0, 9.0, 2.1, 2.0, 1.9] + [2.0] * 10) and table.spreads[0] == 0


def test_a_cost_table_never_falls_with_the_size():
    costs = {1: [1.0] * 5, 2: [3.0] * 5, 3: [2.5] * 5}  # a dip at 3 is taken for the truth: 2 costs at most 2.5
    table = cost_table([1, 2, 3], lambda n: lambda: n, timer=scripted(costs, []))
    assert table.seconds.tolist() == [1.0, 2.5, 2.5] and np.all(np.diff(table.seconds) >= 0)
