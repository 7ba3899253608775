"""ECE, AUC and Brier on hand-checked cases."""

import numpy as np
import pytest

from dspark_calibration.metrics import auc, brier, ece


def test_ece_by_hand():
    predicted = np.array([0.1, 0.1, 0.9, 0.9])
    outcome = np.array([0, 1, 1, 1])
    # bin of 0.1: |0.1 - 0.5| weighted 2/4; bin of 0.9: |0.9 - 1.0| weighted 2/4
    assert ece(predicted, outcome) == pytest.approx(0.5 * 0.4 + 0.5 * 0.1)
    assert ece(np.array([1.0, 1.0]), np.array([1, 1])) == 0.0  # p = 1 falls in the last bin


def test_auc_by_hand_and_ties():
    assert auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auc(np.array([0.5, 0.5]), np.array([0, 1])) == pytest.approx(0.5)
    assert np.isnan(auc(np.array([0.2, 0.3]), np.array([1, 1])))


def test_auc_is_rank_based():
    rng = np.random.default_rng(0)
    predicted, outcome = rng.random(500), rng.random(500) < 0.4
    assert auc(predicted, outcome) == pytest.approx(auc(predicted**3, outcome))


def test_brier():
    assert brier(np.array([0.0, 1.0, 0.5]), np.array([0, 1, 1])) == pytest.approx(0.25 / 3)
