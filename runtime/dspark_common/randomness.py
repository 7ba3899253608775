"""Each request's random numbers, keyed by the position they decide (a counter-based generator, SplitMix64):
the uniform that accepts or rejects the draft at position p, the one that draws the token emitted at p, and
the one a draft for p is sampled with depend only on the request's seed and p. How the engine batched the
request, or what else ran beside it, does not change which number decides p, so a seed gives the same text
for the same prompt, parameters and `off` or `fixed:K` mode whatever else is running (as long as the models
compute the same probabilities). Modes differ in which numbers they use at p (a verified draft, or a plain
draw), so `off` and `fixed:K` give different samples of the same distribution; `sync`/`async` choose how many
drafts to verify from the load, so a seed does not fix their text."""

from __future__ import annotations

import numpy as np

MASK = (1 << 64) - 1
ACCEPT, EMIT, DRAFT = 0, 1, 2  # what a uniform decides at its position


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


class KeyedRandom:
    """Uniforms in (0, 1) for (position, purpose) under one seed."""

    def __init__(self, seed: int):
        self.key = _mix(seed & MASK)

    def uniform(self, position: int, purpose: int) -> float:
        return ((_mix(self.key ^ (position * 4 + purpose)) >> 11) + 0.5) * 2.0**-53

    def draft_noise(self, first: int, count: int) -> np.ndarray:
        """The uniforms drafts for positions first .. first + count - 1 are sampled with."""
        return np.asarray([self.uniform(first + i, DRAFT) for i in range(count)])
