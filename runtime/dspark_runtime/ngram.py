"""Free drafts: what followed the latest earlier occurrence of a request's last few tokens (prompt lookup, as
llama.cpp's and vLLM's n-gram drafters do). No model runs, so they cost only the longer verification; the step loop
takes them where the drafter is not drafting and the speed curve says their expected acceptance pays for it.

A draft token here was proposed with certainty: its draft distribution is a point mass, which chain rejection
sampling verifies as any other (accept with probability p(x); on a rejection, draw from p without x), so sampled
output stays the target's.
"""

from __future__ import annotations

import numpy as np

from dspark_runtime.scheduler import SpeedCurve

LONGEST, SHORTEST = 4, 2  # suffix lengths tried, longest first


class NgramIndex:
    """A request's tokens and, for every n-gram of them (n = SHORTEST..LONGEST), where its latest two occurrences
    end, kept as tokens arrive: a lookup is a few dictionary reads, not a scan of the history every step."""

    def __init__(self, tokens: list[int] = ()) -> None:
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], tuple[int, int | None]] = {}  # n-gram -> (latest end, the end before)
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(SHORTEST, min(LONGEST, end) + 1):
                key = tuple(self.tokens[end - n :])
                self.ends[key] = (end, self.ends[key][0] if key in self.ends else None)

    def lookup(self, limit: int) -> np.ndarray:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest suffix (at least
        SHORTEST tokens) that occurred before; empty when none did."""
        end = len(self.tokens)
        for n in range(min(LONGEST, end - 1), SHORTEST - 1, -1):
            before = self.ends.get(tuple(self.tokens[end - n :]), (end, None))[1]
            if before is not None:
                return np.asarray(self.tokens[before : before + limit], dtype=np.int64)
        return np.zeros(0, dtype=np.int64)


class FreeDraftAcceptance:
    """A request's record of free drafts: its own counts, and the share accepted after a prior `rate` worth
    `PRIOR_WEIGHT` drafts (what earlier requests at its temperature saw, `dspark_runtime.priors`)."""

    PRIOR_WEIGHT = 2.0

    def __init__(self, rate: float = 0.5) -> None:
        self.prior = rate
        self.verified = self.accepted = 0

    @property
    def rate(self) -> float:
        return (self.accepted + self.prior * self.PRIOR_WEIGHT) / (self.verified + self.PRIOR_WEIGHT)

    def add(self, verified: int, accepted: int) -> None:
        """A round verified `verified` free drafts and kept `accepted`; a rejected draft's followers went unseen."""
        self.verified += min(verified, accepted + 1)
        self.accepted += accepted


def drafts_worth_verifying(available: int, rate: float, curve: SpeedCurve, tokens: int,
                           expected: float | None = None) -> int:
    """How many of `available` free drafts to add to a step that sends `tokens` tokens and is expected to emit
    `expected` (default: one per token): the k that maximises expected tokens per second,
    (expected + rate + ... + rate^k) / t(tokens + k), against adding none."""
    if not available:
        return 0
    k = np.arange(available + 1)
    gained = (tokens if expected is None else expected) + np.cumsum(rate ** k) - 1
    seconds = curve.target_times(tokens + k)
    return int(np.argmax(gained / seconds))
