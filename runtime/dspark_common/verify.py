"""Lossless chain verification: pure numpy, no model calls, randomness injected.

Chain rejection sampling (Leviathan et al. 2023; Chen et al. 2023): draft token x_k, sampled from the
draft distribution q_k, is accepted with probability min(1, p_k(x_k) / q_k(x_k)), where p_k is the
target's *processed* distribution at that position. At the first rejection the emitted token is
drawn from the residual norm(max(0, p_k - q_k)); when every draft passes, a bonus token is drawn
from p_{ℓ+1}. The emitted sequence then has exactly the target's distribution, whatever q is.
Randomness comes in as `uniform(k, purpose)`: the uniform deciding offset k for ACCEPT or EMIT.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from dspark_common.randomness import ACCEPT, EMIT

Uniform = Callable[[int, int], float]  # (offset among the verified positions, purpose) -> a uniform in (0, 1)


def sample(probs: np.ndarray, u: float) -> int:
    """One token from a probability vector, by inverse CDF at the uniform u."""
    cdf = np.cumsum(probs, dtype=np.float64)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(probs) - 1))


def residual(target_probs: np.ndarray, draft_probs: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)); when p == q (no residual mass) the target itself, never NaN."""
    mass = np.maximum(target_probs.astype(np.float64) - draft_probs, 0.0)
    total = mass.sum()
    return mass / total if total > 0 else target_probs.astype(np.float64) / target_probs.sum()


def verify_sampled(target_probs: np.ndarray, draft_probs: np.ndarray, draft_tokens: np.ndarray,
                   uniform: Uniform) -> tuple[int, int]:
    """Chain rejection sampling.

    Args:
        target_probs: [ℓ+1, V] processed target distributions at the ℓ draft positions and the bonus position.
        draft_probs: [ℓ, V] the distributions the drafts were sampled from.
        draft_tokens: [ℓ] the drafts.
        uniform: the request's uniforms, by offset and purpose.
    Returns:
        (accepted, token): how many drafts are kept, and the token emitted after them.
    """
    for k, token in enumerate(draft_tokens):
        p, q = float(target_probs[k, token]), float(draft_probs[k, token])
        if q <= 0.0 or uniform(k, ACCEPT) * q >= p:  # accept with probability min(1, p / q)
            return k, sample(residual(target_probs[k], draft_probs[k]), uniform(k, EMIT))
    return len(draft_tokens), sample(target_probs[len(draft_tokens)], uniform(len(draft_tokens), EMIT))


def point_masses(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """[ℓ, V] distributions each certain of its token: what a draft proposed without sampling was drawn from."""
    masses = np.zeros((len(tokens), vocab_size), dtype=np.float32)
    masses[np.arange(len(tokens)), tokens] = 1.0
    return masses


def verify_greedy(target_tokens: np.ndarray, draft_tokens: np.ndarray) -> tuple[int, int]:
    """Greedy: keep the drafts that equal the target's argmax; emit the target's token at the first mismatch.

    target_tokens: [ℓ+1] the target's argmax at each position (lowest index on ties).
    """
    if not len(draft_tokens):
        return 0, int(target_tokens[0])
    mismatches = np.flatnonzero(np.asarray(target_tokens[: len(draft_tokens)]) != np.asarray(draft_tokens))
    accepted = int(mismatches[0]) if len(mismatches) else len(draft_tokens)
    return accepted, int(target_tokens[accepted])
