"""How many drafts of each request the target verifies this step (DSpark §3.2.2, Algorithm 1, §5.2).

Inputs are prefix-survival probabilities a[r, j] = Π_{i≤j} c[r, i] from calibrated confidences
(non-increasing in j) and the measured speed curve SPS(B; R) = 1 / (t_draft(R) + t_target(B)).
Verifying ℓ_r drafts of each of R requests sends B = Σ (1 + ℓ_r) tokens and yields
τ = Σ (1 + Σ_{j<ℓ_r} a[r, j]) tokens in expectation; schedulers maximise Θ = τ·SPS(B).

Lossless by construction: `sync` decides candidate (r, j) when it reaches it in descending order of a
and stops at the first non-improvement, so nothing that depends on a later draft token influences
whether an earlier one is verified; `async` takes its capacity from confidences two steps old and
then the top K by current a (no stop needed). A global search without the stop is *not* lossless
(paper Appendix A; see the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


PROFILED_CONTEXT_ROWS = 3  # new context positions per request in the drafter's profiled calls


@dataclass(frozen=True)
class SpeedCurve:
    """Measured step costs: target_seconds[B - 1] for B tokens, draft_seconds[R - 1] for R requests (each
    bringing PROFILED_CONTEXT_ROWS new context positions), and the drafter's cost per further position."""

    target_seconds: np.ndarray
    draft_seconds: np.ndarray
    draft_seconds_per_context_row: float = 0.0

    @classmethod
    def from_json(cls, data: dict) -> "SpeedCurve":
        return cls(np.asarray(data["target_seconds"]), np.asarray(data["draft_seconds"]),
                   float(data.get("draft_seconds_per_context_row", 0.0)))

    @staticmethod
    def _lookup(table: np.ndarray, index):
        """table[index - 1] for an int or an array of them, linear beyond the measured range."""
        index, size = np.asarray(index), len(table)
        if index.max() <= size:  # the usual case, and the cheap one (the gate asks every step)
            return table[np.maximum(index, 1) - 1]
        slope = table[-1] - table[-2] if size > 1 else table[-1]
        return np.where(
            index <= size, table[np.minimum(np.maximum(index, 1), size) - 1], table[-1] + slope * (index - size)
        )

    def draft_time(self, requests: int, context_rows: int = 0) -> float:
        """t_draft(R), plus the catch-up of context rows beyond what the profile fed (after plain steps)."""
        extra = max(0, context_rows - PROFILED_CONTEXT_ROWS * requests)
        return float(self._lookup(self.draft_seconds, requests)) + self.draft_seconds_per_context_row * extra

    def steps_per_second(self, tokens, requests: int, context_rows: int = 0):
        """SPS(B; R) for B = `tokens` (an int or an array)."""
        return 1.0 / (self.draft_time(requests, context_rows) + self._lookup(self.target_seconds, tokens))

    def plain_steps_per_second(self, tokens: int) -> float:
        """Steps per second when nothing was drafted: the target alone."""
        return float(1.0 / self._lookup(self.target_seconds, tokens))


def candidates(survival: np.ndarray) -> list[tuple[float, int, int]]:
    """(a, j, r) with a > 0, best first; ties broken by position then request so prefixes stay ordered."""
    rows, cols = np.nonzero(survival > 0)
    order = sorted(zip(-survival[rows, cols], cols, rows))
    return [(-neg_a, int(j), int(r)) for neg_a, j, r in order]


def schedule_sync(survival: np.ndarray, curve: SpeedCurve, cap: int | None = None) -> np.ndarray:
    """Algorithm 1: admit candidates while Θ strictly improves; stop at the first that does not.

    survival [R, γ] -> drafts to verify per request [R] (at most `cap` each).
    """
    requests, gamma = survival.shape
    cap = gamma if cap is None else min(cap, gamma)
    lengths = np.zeros(requests, dtype=np.int64)
    tokens, expected = requests, float(requests)
    best = expected * curve.steps_per_second(tokens, requests)
    for a, j, r in candidates(survival[:, :cap]):
        theta = (expected + a) * curve.steps_per_second(tokens + 1, requests)
        if theta <= best:
            break
        best, tokens, expected = theta, tokens + 1, expected + a
        lengths[r] = j + 1
    return lengths


def path_throughputs(survival: np.ndarray, curve: SpeedCurve, cap: int | None = None,
                     context_rows: int = 0) -> np.ndarray:
    """Θ after admitting the first k candidates of the greedy path, k = 0, 1, ..., every candidate."""
    requests, gamma = survival.shape
    a = survival[:, : (gamma if cap is None else min(cap, gamma))]
    gains = np.concatenate([[0.0], np.cumsum(np.sort(a[a > 0])[::-1])])  # the path takes the largest a first
    return (requests + gains) * curve.steps_per_second(requests + np.arange(len(gains)), requests, context_rows)


def capacity(survival: np.ndarray, curve: SpeedCurve, cap: int | None = None) -> int:
    """Drafts worth verifying along the greedy path, searched globally (for `async`, on old confidences)."""
    return int(np.argmax(path_throughputs(survival, curve, cap)))


def schedule_top_k(survival: np.ndarray, budget: int, cap: int | None = None) -> np.ndarray:
    """The `budget` best candidates by current a (prefix-closed per request)."""
    requests, gamma = survival.shape
    lengths = np.zeros(requests, dtype=np.int64)
    for _, j, r in candidates(survival[:, : (gamma if cap is None else min(cap, gamma))])[:budget]:
        lengths[r] = max(lengths[r], j + 1)
    return lengths


class AsyncScheduler:
    """`async`: this step verifies the top K drafts by current a, where K was computed (global search, no
    stop) from the confidences of two steps earlier; the first two steps verify one draft per request."""

    def __init__(self, curve: SpeedCurve, cap: int | None = None, lag: int = 2):
        self.curve, self.cap = curve, cap
        self.pending: list[int | None] = [None] * lag  # None: cold start

    def schedule(self, survival: np.ndarray) -> np.ndarray:
        budget = self.pending.pop(0)
        if budget is None:
            budget = survival.shape[0]
        lengths = schedule_top_k(survival, budget, self.cap)
        self.pending.append(capacity(survival, self.curve, self.cap))
        return lengths


class DraftGate:
    """Whether the next step drafts at all for `sync`/`async` requests.

    SPS(B; R) charges every speculative step the drafter's t_draft(R) (with the catch-up of the context it
    has not read yet), while a step with nothing drafted costs only t_target(R). After each step the gate
    compares the best expected throughput of drafting (the greedy path over each request's latest prefix
    survivals, searched globally as for `async`) with R·SPS_plain(R), and drafts only when drafting wins.
    While it does not, it still drafts after `probe` plain steps, doubling the wait up to `max_probe` while
    drafting keeps losing, so the survivals stay current. It decides from finished steps only, so
    verification stays lossless.
    """

    def __init__(self, curve: SpeedCurve, cap: int | None = None, probe: int = 4, max_probe: int = 128):
        self.curve, self.cap = curve, cap
        self.probe, self.max_probe = probe, max_probe
        self.wait, self.skipped = probe, 0
        self.declined: np.ndarray | None = None  # the survivals drafting last lost with

    def worth_drafting(self, survival: np.ndarray, context_rows: int = 0) -> bool:
        """`context_rows`: the target positions the drafter has not yet read (its call's catch-up cost)."""
        requests = survival.shape[0]
        # the same survivals that lost before lose again: the catch-up only grows while nothing is drafted
        same = self.declined is not None and self.declined.shape == survival.shape and \
            np.array_equal(self.declined, survival)
        if not same and path_throughputs(survival, self.curve, self.cap, context_rows).max() > \
                requests * self.curve.plain_steps_per_second(requests):
            self.wait, self.skipped, self.declined = self.probe, 0, None
            return True
        self.declined = survival
        self.skipped += 1
        if self.skipped <= self.wait:
            return False
        self.skipped, self.wait = 0, min(2 * self.wait, self.max_probe)
        return True  # a probe
