"""Calibration metrics of predicted acceptance probabilities against realised outcomes (numpy only)."""

from __future__ import annotations

import numpy as np


def ece(predicted: np.ndarray, outcome: np.ndarray, bins: int = 20) -> float:
    """Expected calibration error over equal-width bins: Σ_b (n_b / n)·|mean(pred_b) - mean(outcome_b)|."""
    predicted, outcome = np.asarray(predicted, dtype=np.float64), np.asarray(outcome, dtype=np.float64)
    if predicted.size == 0:
        return float("nan")
    index = np.minimum((predicted * bins).astype(int), bins - 1)
    gaps = np.bincount(index, predicted, bins) - np.bincount(index, outcome, bins)  # n_b·(mean pred - mean outcome)
    return float(np.abs(gaps).sum() / predicted.size)


def ece_floor(predicted: np.ndarray, bins: int = 20, draws: int = 50, seed: int = 0) -> float:
    """The ECE that a perfectly calibrated predictor shows on this many samples (median over `draws` sets of
    outcomes drawn as Bernoulli(predicted)): a measured ECE near it is sampling noise, not miscalibration."""
    predicted = np.asarray(predicted, dtype=np.float64)
    rng = np.random.default_rng(seed)
    return float(np.median([ece(predicted, rng.random(predicted.shape) < predicted, bins) for _ in range(draws)]))


def auc(predicted: np.ndarray, outcome: np.ndarray) -> float:
    """Area under the ROC curve (the probability that a positive outranks a negative; ties count half)."""
    predicted, outcome = np.asarray(predicted, dtype=np.float64), np.asarray(outcome).astype(bool)
    positives, negatives = outcome.sum(), (~outcome).sum()
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(predicted, kind="mergesort")
    ranks = np.empty(len(predicted), dtype=np.float64)
    sorted_values = predicted[order]
    # average ranks over ties
    _, starts, counts = np.unique(sorted_values, return_index=True, return_counts=True)
    for start, count in zip(starts, counts):
        ranks[order[start : start + count]] = start + (count + 1) / 2
    return float((ranks[outcome].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def brier(predicted: np.ndarray, outcome: np.ndarray) -> float:
    predicted, outcome = np.asarray(predicted, dtype=np.float64), np.asarray(outcome, dtype=np.float64)
    return float(np.mean((predicted - outcome) ** 2)) if predicted.size else float("nan")
