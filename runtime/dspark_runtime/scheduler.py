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

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np


PROFILED_CONTEXT_ROWS = 3  # new context positions per request in the drafter's profiled calls


@dataclass(frozen=True)
class SpeedCurve:
    """Measured step costs: target_seconds[B - 1] for B tokens, draft_seconds[R - 1] for R requests (each
    bringing PROFILED_CONTEXT_ROWS new context positions) in calls that sample, greedy_draft_seconds[R - 1] in
    all-greedy calls (which skip the distributions; None in curves profiled before they were timed apart), and the
    drafter's cost per further position."""

    target_seconds: np.ndarray
    draft_seconds: np.ndarray
    draft_seconds_per_context_row: float = 0.0
    greedy_draft_seconds: np.ndarray | None = None

    @classmethod
    def from_json(cls, data: dict) -> "SpeedCurve":
        greedy = data.get("greedy_draft_seconds")
        return cls(np.asarray(data["target_seconds"]), np.asarray(data["draft_seconds"]),
                   float(data.get("draft_seconds_per_context_row", 0.0)), greedy and np.asarray(greedy))

    def priced(self, sampling: bool, target_extra: float | np.ndarray = 0.0, draft_extra: float = 0.0) -> "SpeedCurve":
        """The curve steps are priced by: the drafter's table for calls that sample or not, and each table plus
        what the step loop adds to it (`dspark_runtime.loop_costs`; the target's per step size or one for all),
        never below half the profiled cost, the target's still non-decreasing."""
        draft = self.draft_seconds if sampling or self.greedy_draft_seconds is None else self.greedy_draft_seconds
        target = np.maximum(self.target_seconds + target_extra, self.target_seconds / 2)
        return SpeedCurve(np.maximum.accumulate(target), np.maximum(draft + draft_extra, draft / 2),
                          self.draft_seconds_per_context_row)

    def padded(self, multiple: int) -> "SpeedCurve":
        """The curve of a step loop that pads every step to a multiple of `multiple` tokens (`exact_greedy`): B
        tokens cost what ⌈B / multiple⌉ · multiple tokens cost, so that a scheduler verifies the drafts a padded
        row would carry anyway rather than pay for padding."""
        if multiple == 1:
            return self
        sizes = np.arange(1, len(self.target_seconds) + 1)
        return replace(self, target_seconds=self._lookup(self.target_seconds, -(-sizes // multiple) * multiple))

    @classmethod
    def _at(cls, table: np.ndarray, index: int) -> float:
        """table[index - 1] for one int: a single read within the table (the loop asks several times a step)."""
        return float(table[index - 1]) if 0 < index <= len(table) else float(cls._lookup(table, index))

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
        return self._at(self.draft_seconds, requests) + self.catch_up(requests, context_rows)

    def catch_up(self, requests: int, context_rows: int) -> float:
        """What reading `context_rows` new target positions costs a drafter call beyond a profiled one."""
        return self.draft_seconds_per_context_row * max(0, context_rows - PROFILED_CONTEXT_ROWS * requests)

    def steps_per_second(self, tokens, requests: int, context_rows: int = 0):
        """SPS(B; R) for B = `tokens` (an int or an array)."""
        return 1.0 / (self.draft_time(requests, context_rows) + self._lookup(self.target_seconds, tokens))

    def target_time(self, tokens: int) -> float:
        """t_target(B) for B = `tokens`."""
        return self._at(self.target_seconds, tokens)

    def target_times(self, tokens: np.ndarray) -> np.ndarray:
        """t_target(B) for an array of B."""
        return self._lookup(self.target_seconds, tokens)

    def plain_steps_per_second(self, tokens: int) -> float:
        """Steps per second when nothing was drafted: the target alone."""
        return 1.0 / self.target_time(tokens)


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


LOOK_RETURN = 2.0  # how many times its drafter call a probe's best case must save (see `DraftGate.worth_a_look`)


class DraftGate:
    """Whether the next step drafts at all for `sync`/`async` requests, so that they take the drafter's win where
    it pays and cost no more than `off` plus a bounded share where it does not.

    SPS(B; R) charges every speculative step the drafter's t_draft(R), while a step with nothing drafted costs only
    t_target(R). Three rules, all priced from the measured curve and decided from finished steps only (so
    verification stays lossless):
    - the load: where even drafts that are always accepted cannot beat plain steps at R requests (the drafter and
      the longer verification cost more than γ sure tokens save), nothing is drafted and nothing probed;
    - the survivals: drafting pays when the best expected throughput of the greedy path over each request's
      latest prefix survivals (searched globally, as for `async`) beats R·SPS_plain(R), and the time it saves over
      the requests' remaining tokens repays the catch-up (a drafter that skipped n target positions reads them
      first);
    - probes: each request looks for itself (`Probes`): its first decoding step drafts, and while its survivals
      say no it drafts again after a number of tokens that doubles with every no, so a request whose drafts do
      not pay spends a shrinking share of its time on them and none stays shut for good; a look is bought only
      where sure drafts could repay it twice over the tokens left (`worth_a_look`).
    """

    def __init__(self, curve: SpeedCurve, cap: int | None = None):
        self.curve, self.cap = curve, cap
        self.declined: tuple[np.ndarray, ...] | None = None  # the survivals drafting last lost with
        self.steady_pays = False  # whether the last survivals asked about would pay, catch-up aside
        self.costs: dict[int, _LoadCosts] = {}  # by request count

    def reprice(self, curve: SpeedCurve) -> None:
        """Decide from `curve` from now on (what it priced with the old one is forgotten)."""
        self.curve, self.costs, self.declined = curve, {}, None

    def _costs(self, requests: int) -> _LoadCosts:
        costs = self.costs.get(requests)
        if costs is None:
            curve, plain = self.curve, requests * self.curve.plain_steps_per_second(requests)
            sure = np.ones((requests, self.cap or len(curve.target_seconds)))
            best = float(path_throughputs(sure, curve, self.cap).max())
            costs = self.costs[requests] = _LoadCosts(plain, best > plain, best)
        return costs

    def can_pay(self, requests: int) -> bool:
        """Whether drafts that are always accepted would beat plain steps at this many requests (else nothing is
        drafted or probed)."""
        return self._costs(requests).can_pay

    def worth_a_look(self, requests: int, remaining: int, context_rows: int = 0) -> bool:
        """Whether a probe can repay itself: drafts that are always accepted would save, over the requests'
        `remaining` tokens, at least `LOOK_RETURN` times the drafter call a look costs (a look finds less than sure
        drafts). Where even those barely beat plain steps (four requests on 2 AVX2 cores: 4%), looking costs more
        than it can find."""
        costs = self._costs(requests)
        saving = remaining * (1 / costs.plain - 1 / costs.sure) if costs.can_pay else 0.0
        return saving >= LOOK_RETURN * self.curve.draft_time(requests, context_rows)

    def worth_drafting(self, survivals: Sequence[np.ndarray], context_rows: int = 0, remaining: int = 0) -> bool:
        """`survivals`: each request's latest prefix survivals (the same objects while they have not changed);
        `context_rows`: the target positions the drafter has not yet read; `remaining`: the tokens the requests
        may still generate (what a catch-up is paid back over). Called every step: cheap when nothing changed."""
        requests = len(survivals)
        costs = self._costs(requests)
        if not costs.can_pay:
            return False
        # the same survivals that lost before lose again: the catch-up only grows while nothing is drafted
        declined = self.declined
        if declined is not None and len(declined) == requests and all(a is b for a, b in zip(declined, survivals)):
            return False
        steady = path_throughputs(np.stack(survivals), self.curve, self.cap).max()
        catch_up = self.curve.catch_up(requests, context_rows)
        self.steady_pays = bool(steady > costs.plain)
        if self.steady_pays and remaining * (1 / costs.plain - 1 / steady) >= catch_up:
            self.declined = None
            return True
        self.declined = tuple(survivals)
        return False


@dataclass
class Probes:
    """When a request whose survivals say no drafts again to look (a probe): at `due` generated tokens, then after
    `interval` more, the interval doubling with every no (from `FIRST`, at most `LONGEST`) and back to `FIRST`
    once drafting pays. A new request looks at once, or later where its temperature's last requests' looks said no
    (`dspark_runtime.priors`)."""

    FIRST = 16
    LONGEST = 512

    due: int = 0
    interval: int = FIRST
    paying: bool = False  # whether its survivals ever said drafting pays
    declined: bool = False  # whether its survivals ever said it does not

    def looked(self, generated: int) -> None:
        """A probe ran at `generated` tokens: the next one waits `interval` tokens, and the one after twice that."""
        self.due = generated + self.interval
        self.interval = min(2 * self.interval, self.LONGEST)

    def paid(self) -> None:
        self.interval, self.paying = self.FIRST, True


@dataclass(frozen=True)
class _LoadCosts:
    """What the gate prices at one request count: plain steps' throughput, and whether sure drafts would beat it."""

    plain: float
    can_pay: bool
    sure: float  # the best throughput with drafts that are always accepted
