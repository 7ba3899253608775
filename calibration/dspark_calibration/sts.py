"""Sequential Temperature Scaling (DSpark §3.2.1): per draft position k, left to right, a 1-D grid search
for the temperature T_k on the confidence logit that minimises the ECE of the cumulative product
Π_{i≤k} σ(z_i / T_i) against the realised indicator "drafts 1..k were all accepted", with the earlier
temperatures fixed. σ(z / T) is monotone in z, so the ranking within a position is preserved.

Optionally (beyond the paper) each position also gets an offset, σ(z_k / T_k + b_k), found by the same
search over a grid of (T, b): a temperature cannot move confidences across 0.5, which is what greedy
requests need (they accept far more often than the T=1 acceptance the head was trained on).
"""

from __future__ import annotations

import numpy as np

from dspark_calibration.metrics import auc, brier, ece, ece_floor

DEFAULT_GRID = np.geomspace(0.25, 8.0, 200)
DEFAULT_BIASES = np.linspace(-4.0, 4.0, 33)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def prefix_outcomes(accepted: np.ndarray, gamma: int) -> np.ndarray:
    """accepted [n] drafts kept per round -> [n, γ] indicator that positions 0..k were all accepted."""
    return np.asarray(accepted)[:, None] > np.arange(gamma)[None, :]


def prefix_survival(logits: np.ndarray, temperatures: np.ndarray, biases: np.ndarray | float = 0.0) -> np.ndarray:
    """Prefix-survival a_k = Π_{i≤k} σ(z_i / T_i + b_i), [n, γ]."""
    return np.cumprod(sigmoid(np.asarray(logits, dtype=np.float64) / temperatures + biases), axis=1)


def fit_sts(logits: np.ndarray, accepted: np.ndarray, grid: np.ndarray = DEFAULT_GRID, bins: int = 20,
            biases: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(temperatures [γ], offsets [γ]) from confidence logits [n, γ] and accepted counts [n] of real rounds;
    the offsets are 0 unless a grid of `biases` is given."""
    logits = np.asarray(logits, dtype=np.float64)
    gamma = logits.shape[1]
    outcomes = prefix_outcomes(accepted, gamma)
    offsets = np.zeros(1) if biases is None else np.asarray(biases, dtype=np.float64)
    temperatures, chosen = np.ones(gamma), np.zeros(gamma)
    running = np.ones(len(logits))
    for k in range(gamma):
        errors = [[ece(running * sigmoid(logits[:, k] / t + b), outcomes[:, k], bins) for b in offsets] for t in grid]
        best_t, best_b = np.unravel_index(int(np.argmin(errors)), (len(grid), len(offsets)))
        temperatures[k], chosen[k] = grid[best_t], offsets[best_b]
        running = running * sigmoid(logits[:, k] / temperatures[k] + chosen[k])
    return temperatures, chosen


def calibration_report(logits: np.ndarray, accepted: np.ndarray, temperatures: np.ndarray, biases: np.ndarray,
                       bins: int = 20) -> dict:
    """Per-position ECE, AUC and Brier of the prefix survival before (T = 1) and after STS, and the ECE a
    perfectly calibrated predictor would show on as many rounds (`ece_floor`, after STS)."""
    gamma = np.asarray(logits).shape[1]
    outcomes = prefix_outcomes(accepted, gamma)
    report: dict = {
        "temperatures": [round(float(t), 4) for t in temperatures],
        "biases": [round(float(b), 4) for b in biases],
    }
    predictions = {
        "before": prefix_survival(logits, np.ones(gamma)),
        "after": prefix_survival(logits, temperatures, biases),
    }
    for name, predicted in predictions.items():
        report[name] = {
            "ece": [round(ece(predicted[:, k], outcomes[:, k], bins), 5) for k in range(gamma)],
            "auc": [round(auc(predicted[:, k], outcomes[:, k]), 5) for k in range(gamma)],
            "brier": [round(brier(predicted[:, k], outcomes[:, k]), 5) for k in range(gamma)],
        }
    report["after"]["ece_floor"] = [round(ece_floor(predictions["after"][:, k], bins), 5) for k in range(gamma)]
    return report
