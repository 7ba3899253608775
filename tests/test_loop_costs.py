"""Pricing steps by what they cost: the drafter's all-greedy calls apart from those that sample, and the step
loop's own costs added to the profiled curve, so that the gate's decisions follow them."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_runtime.loop_costs import REPRICE_STEPS, SIZE_STEPS, WEIGHT, LoopCosts
from dspark_runtime.scheduler import DraftGate, SpeedCurve, capacity

FLAT = np.ones(8)  # verifying up to 8 tokens costs one step of 1 s


def test_greedy_calls_are_priced_by_the_greedy_table_and_old_curves_by_the_sampling_one():
    curve = SpeedCurve.from_json({"target_seconds": FLAT.tolist(), "draft_seconds": [2.0, 3.0],
                                  "greedy_draft_seconds": [1.0, 1.5]})
    assert curve.priced(sampling=False).draft_time(2) == 1.5
    assert curve.priced(sampling=True).draft_time(2) == 3.0
    old = SpeedCurve.from_json({"target_seconds": FLAT.tolist(), "draft_seconds": [2.0, 3.0]})
    assert old.priced(sampling=False).draft_time(1) == 2.0


def test_extras_are_added_and_never_take_a_cost_below_half_its_profile():
    priced = SpeedCurve(FLAT, np.array([2.0]), greedy_draft_seconds=np.array([1.0])).priced(False, 0.25, -0.75)
    assert priced.target_time(3) == 1.25
    assert priced.draft_time(1) == 0.5


def test_the_loop_reprices_every_few_steps_from_its_running_means():
    costs = LoopCosts(SpeedCurve(FLAT, np.array([1.0]), greedy_draft_seconds=np.array([1.0])))
    first = costs.priced(False)
    for step in range(1, REPRICE_STEPS + 1):
        costs.target_step(4, 1.5)
        costs.drafter_call(1, 0, sampling=False, seconds=1.8)
        if step < REPRICE_STEPS:
            assert costs.priced(False) is first  # the same curve between repricings
    kept = 1 - (1 - WEIGHT) ** REPRICE_STEPS
    assert costs.priced(False).target_time(3) == pytest.approx(1 + 0.5 * kept)  # sizes not run: the overall mean
    assert costs.priced(False).target_time(4) == pytest.approx(1.5)  # the size run: its own mean
    assert costs.priced(False).draft_time(1) == pytest.approx(1 + 0.8 * kept)
    assert costs.priced(True).draft_time(1) == 1.0  # calls that sample have their own record: none yet


def test_one_slow_step_moves_the_means_by_a_bounded_amount():
    costs = LoopCosts(SpeedCurve(FLAT, np.array([1.0])))
    costs.target_step(1, 100.0)
    assert costs.target_extra == pytest.approx(WEIGHT * 1.0)


def test_a_drafter_dearer_in_the_loop_than_in_its_profile_turns_the_gate():
    survival = np.cumprod(np.full((2, 3), 0.8), axis=1)  # two requests: a = .8, .64, .512
    costs = LoopCosts(SpeedCurve(FLAT, np.array([1.0, 1.0])))
    assert DraftGate(costs.priced(True)).worth_drafting(tuple(survival))  # (2 + 3.904) / 2 > 2 plain tokens
    for _ in range(4 * REPRICE_STEPS):
        costs.target_step(8, 1.0)
        costs.drafter_call(2, 0, sampling=True, seconds=2.0)  # twice its profile
    assert not DraftGate(costs.priced(True)).worth_drafting(tuple(survival))  # 5.904 / (1 + 2) < 2


def test_a_curve_that_misstates_one_more_token_is_corrected_by_the_sizes_the_loop_runs():
    curve = SpeedCurve(np.array([1.0, 1.1, 1.2, 1.5, 1.51, 1.6, 1.7, 1.8]), np.array([1.0]))  # t(5) - t(4) read 0.01
    costs = LoopCosts(curve)
    for _ in range(SIZE_STEPS):
        costs.target_step(4, 1.5)  # in the loop: as profiled
        costs.target_step(5, 1.8)  # 0.29 above
    costs.steps = REPRICE_STEPS - 1
    costs.target_step(2, 1.1)  # the next repricing
    priced = costs.priced(True)
    assert priced.target_time(5) - priced.target_time(4) == pytest.approx(0.3)
    assert np.all(np.diff(priced.target_seconds) >= 0)  # still non-decreasing
    assert priced.target_time(8) == pytest.approx(1.8 + costs.target_extra)  # unseen sizes: the overall mean


def test_a_loop_that_pads_steps_to_pairs_prices_an_odd_row_count_as_the_pair_after_it():
    """With `exact_greedy` every step runs an even number of rows: 3 tokens cost what 4 do, so verifying one draft
    fewer than a pair holds saves nothing and the async budget lands on full pairs."""
    rising = np.linspace(1.0, 2.4, 8)
    curve = SpeedCurve(rising, np.array([0.5]))
    assert curve.padded(1) is curve
    assert curve.padded(2).target_seconds.tolist() == pytest.approx(np.repeat(rising[1::2], 2).tolist())
    costs = LoopCosts(curve, row_multiple=2)
    for _ in range(SIZE_STEPS):
        costs.target_step(6, 2.0)  # steps run padded: the loop sees even sizes only
    costs.steps = REPRICE_STEPS - 1
    costs.target_step(4, 1.6)
    priced = costs.priced(False)
    assert [priced.target_time(n) for n in (5, 7)] == [priced.target_time(6), priced.target_time(8)]
    survival = np.array([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]])
    assert (capacity(survival, priced) + 1) % 2 == 0  # drafts + the anchor fill whole pairs
