"""Lossless chain verification: pure numpy, no model calls, randomness injected.

Chain rejection sampling (Leviathan et al. 2023; Chen et al. 2023): draft token x_k, sampled from the
draft distribution q_k, is accepted with probability min(1, p_k(x_k) / q_k(x_k)), where p_k is the
target's *processed* distribution at that position. At the first rejection the emitted token is
drawn from the residual norm(max(0, p_k - q_k)); when every draft passes, a bonus token is drawn
from p_{ℓ+1}. The emitted sequence then has exactly the target's distribution, whatever q is.
"""

from __future__ import annotations

import numpy as np


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a probability vector (inverse CDF: one uniform draw)."""
    cdf = np.cumsum(probs, dtype=np.float64)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))


def residual(target_probs: np.ndarray, draft_probs: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)); when p == q (no residual mass) the target itself, never NaN."""
    mass = np.maximum(target_probs.astype(np.float64) - draft_probs, 0.0)
    total = mass.sum()
    return mass / total if total > 0 else target_probs.astype(np.float64) / target_probs.sum()


def verify_sampled(target_probs: np.ndarray, draft_probs: np.ndarray, draft_tokens: np.ndarray,
                   rng: np.random.Generator) -> tuple[int, int]:
    """Chain rejection sampling.

    Args:
        target_probs: [ℓ+1, V] processed target distributions at the ℓ draft positions and the bonus position.
        draft_probs: [ℓ, V] the distributions the drafts were sampled from.
        draft_tokens: [ℓ] the drafts.
        rng: the request's generator.
    Returns:
        (accepted, token): how many drafts are kept, and the token emitted after them.
    """
    for k, token in enumerate(draft_tokens):
        p, q = float(target_probs[k, token]), float(draft_probs[k, token])
        if q <= 0.0 or rng.random() * q >= p:  # accept with probability min(1, p / q)
            return k, sample(residual(target_probs[k], draft_probs[k]), rng)
    return len(draft_tokens), sample(target_probs[len(draft_tokens)], rng)


def verify_greedy(target_tokens: np.ndarray, draft_tokens: np.ndarray) -> tuple[int, int]:
    """Greedy: keep the drafts that equal the target's argmax; emit the target's token at the first mismatch.

    target_tokens: [ℓ+1] the target's argmax at each position (lowest index on ties).
    """
    mismatches = np.flatnonzero(np.asarray(target_tokens[: len(draft_tokens)]) != np.asarray(draft_tokens))
    accepted = int(mismatches[0]) if len(mismatches) else len(draft_tokens)
    return accepted, int(target_tokens[accepted])
