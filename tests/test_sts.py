"""Sequential Temperature Scaling on synthetic rounds with a known miscalibration."""

import numpy as np

from dspark_calibration.sts import DEFAULT_BIASES, calibration_report, fit_sts, sigmoid, prefix_survival


def synthetic_rounds(n=20_000, gamma=5, true_temperature=2.5, seed=0, true_bias=0.0):
    """An overconfident head: logits z, but position k really survives with σ(z_k / T + b) given 1..k-1 did."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(1.5, 2.0, size=(n, gamma))
    survive = rng.random((n, gamma)) < sigmoid(logits / true_temperature + true_bias)
    accepted = np.where(survive.all(1), gamma, np.argmin(survive, axis=1))
    return logits, accepted


def test_sts_recovers_the_temperature_and_fixes_calibration():
    logits, accepted = synthetic_rounds()
    temperatures, biases = fit_sts(logits, accepted)
    assert np.all(biases == 0)
    # early positions see every round; later ones fewer (only rounds that survive that far), so a wider band
    assert np.all(np.abs(temperatures[:2] - 2.5) < 0.3) and np.all(np.abs(temperatures - 2.5) < 0.8), temperatures
    report = calibration_report(logits, accepted, temperatures, biases)
    assert max(report["after"]["ece"]) < 0.02 < min(report["before"]["ece"])
    # once calibrated, what is left is sampling noise: about what a perfect predictor shows on as many rounds
    floor, after = np.array(report["after"]["ece_floor"]), np.array(report["after"]["ece"])
    assert np.all(floor > 0) and np.all(after < 2.5 * floor + 0.002), (after, floor)


def test_ece_floor_shrinks_with_more_rounds():
    from dspark_calibration.metrics import ece_floor

    rng = np.random.default_rng(1)
    small, large = ece_floor(rng.uniform(0, 1, 500)), ece_floor(rng.uniform(0, 1, 50_000))
    assert 0.01 < small < 0.06 and large < small / 5


def test_temperatures_preserve_ranking_within_a_position():
    logits, accepted = synthetic_rounds(n=2000, true_bias=1.0)
    temperatures, biases = fit_sts(logits, accepted, biases=DEFAULT_BIASES)
    calibrated = sigmoid(logits / temperatures + biases)
    for k in range(logits.shape[1]):
        assert np.array_equal(np.argsort(logits[:, k], kind="stable"), np.argsort(calibrated[:, k], kind="stable"))
    report = calibration_report(logits, accepted, temperatures, biases)
    assert (
        report["before"]["auc"][0] == report["after"]["auc"][0]
    )  # the first position's ranking is exactly the raw one
    assert np.all(np.diff(prefix_survival(logits, temperatures, biases), axis=1) <= 0)


def test_offsets_fix_what_a_temperature_cannot():
    """Acceptance far above what the logits say (like greedy requests against a head trained for T=1): a
    temperature alone leaves a large ECE at the first position; with offsets, STS recovers T and b there."""
    logits, accepted = synthetic_rounds(n=10_000, gamma=3, true_temperature=2.0, true_bias=2.0)
    logits -= 3.0  # the head sees the same rounds through lower logits
    plain = calibration_report(logits, accepted, *fit_sts(logits, accepted))
    temperatures, biases = fit_sts(logits, accepted, biases=DEFAULT_BIASES)
    with_offsets = calibration_report(logits, accepted, temperatures, biases)
    assert abs(temperatures[0] - 2.0) < 0.3 and abs(biases[0] - 3.5) < 0.5, (temperatures, biases)
    assert with_offsets["after"]["ece"][0] < 0.02 < plain["after"]["ece"][0]
