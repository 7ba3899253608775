"""Free drafts (prompt lookup): what they propose, and how many the speed curve takes."""

from __future__ import annotations

import numpy as np

from dspark_runtime.ngram import FreeDraftAcceptance, NgramIndex, drafts_worth_verifying


def lookup(history: np.ndarray, limit: int) -> np.ndarray:
    """The index's lookup over a history given at once, and the same history grown token by token."""
    at_once, grown = NgramIndex(history.tolist()), NgramIndex(history[:1].tolist())
    for token in history[1:].tolist():
        grown.extend([token])
    assert at_once.lookup(limit).tolist() == grown.lookup(limit).tolist()
    return at_once.lookup(limit)
from dspark_runtime.scheduler import SpeedCurve


def test_lookup_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    history = np.array([7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 8, 1, 2, 3])
    assert lookup(history, 3).tolist() == [4, 5, 8]  # [1, 2, 3] last seen before at 6..8
    assert lookup(history, 10).tolist() == [4, 5, 8, 1, 2, 3]  # up to the end of the history
    assert lookup(np.array([5, 6, 7, 5, 6]), 4).tolist() == [7, 5, 6]  # the 2-token suffix [5, 6]
    assert lookup(np.array([1, 2, 3, 4, 2]), 4).tolist() == []  # one matching token is not enough
    assert lookup(np.array([3]), 4).tolist() == []


def test_the_curve_prices_how_many_free_drafts_to_verify():
    flat = SpeedCurve(np.full(16, 0.01), np.zeros(1))
    steep = SpeedCurve(0.01 * np.arange(1, 17), np.zeros(1))  # t(B) = B t(1): verifying never pays
    assert drafts_worth_verifying(4, 0.5, flat, 1) == 4
    assert drafts_worth_verifying(4, 0.5, steep, 1) == 0
    assert drafts_worth_verifying(0, 0.9, flat, 1) == 0
    doubling = SpeedCurve(np.array([0.01, 0.02, 0.02, 0.02, 0.04]), np.zeros(1))  # t(2..4) = 2 t(1)
    assert drafts_worth_verifying(4, 0.9, doubling, 1) == 3  # (1 + .9 + .81 + .729) / 2 > 1, and t(5) doubles again
    assert drafts_worth_verifying(4, 0.4, doubling, 1) == 0  # 1.624 / 2 < 1


def test_acceptance_counts_the_drafts_the_target_saw():
    record = FreeDraftAcceptance()
    record.add(verified=4, accepted=1)  # the second draft was rejected: the last two went unseen
    assert (record.accepted, record.verified) == (1, 2) and record.rate == 2 / 4  # with the prior: 1 in 2
    record.add(verified=3, accepted=3)
    assert record.rate == 5 / 7
