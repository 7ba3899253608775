"""Reliability diagram of prefix-survival predictions before and after STS (matplotlib, imported lazily)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark_calibration.sts import prefix_outcomes, prefix_survival


def reliability_png(logits: np.ndarray, accepted: np.ndarray, temperatures: np.ndarray, biases: np.ndarray,
                    file: str | Path, bins: int = 20) -> bool:
    """Write the diagram; returns False (and writes nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    gamma = logits.shape[1]
    outcomes = prefix_outcomes(accepted, gamma)
    figure, axes = plt.subplots(1, 2, figsize=(9, 4), dpi=110, sharey=True)
    for axis, (title, temps, offsets) in zip(axes, [("raw", np.ones(gamma), 0.0), ("after STS", temperatures, biases)]):
        predicted = prefix_survival(logits, temps, offsets)
        for k in range(gamma):
            index = np.minimum((predicted[:, k] * bins).astype(int), bins - 1)
            filled = [b for b in range(bins) if (index == b).any()]
            axis.plot(
                [predicted[index == b, k].mean() for b in filled],
                [outcomes[index == b, k].mean() for b in filled],
                marker=".",
                label=f"k={k + 1}",
            )
        axis.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1)
        axis.set_title(f"prefix survival, {title}")
        axis.set_xlabel("predicted Π c_i")
    axes[0].set_ylabel("observed: drafts 1..k accepted")
    axes[1].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(file)
    plt.close(figure)
    return True
