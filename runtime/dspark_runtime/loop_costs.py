"""What decoding steps cost in the step loop beside what `profile` timed.

The profile times the graphs' calls alone. A step in the loop also lays out its batch, verifies, commits and
computes the drafts' survivals, and shares the machine with whatever else runs now: on the demo a drafter call
cost 2.3 ms in the loop against 1.65 ms in its curve. Running means of each part's excess over its profiled cost
reprice the curve that the draft gate and the schedulers decide from (`SpeedCurve.priced`), so that their decisions
follow what a drafted step costs here. The target's excess is kept for each step size the loop has run often
enough (a profile taken on a busy machine can misstate what one more verified token costs: on a 2-core EPYC one
read t(5) - t(4) as 0.6 ms where quiet steps took 9 ms), and one mean over all sizes prices the others.
"""

from __future__ import annotations

import numpy as np

from dspark_runtime.scheduler import SpeedCurve

WEIGHT = 0.1  # each step's share in the running means (they follow about the last 10-20 steps)
REPRICE_STEPS = 16  # the curves are repriced every this many decoding steps
SIZE_STEPS = 4  # steps of one size after which its own mean prices it


class LoopCosts:
    """Running means of what a decoding step's target part and a drafter call cost in the loop beyond `curve`
    (the drafter's apart for calls that sample and all-greedy ones), and the curves priced from them."""

    def __init__(self, curve: SpeedCurve, row_multiple: int = 1):
        """`row_multiple`: the loop pads every step to a multiple of that many rows, and the priced curves say so
        (`SpeedCurve.padded`)."""
        self.curve, self.row_multiple = curve, row_multiple
        self.profiled = {sampling: curve.priced(sampling) for sampling in (False, True)}
        self.target_extra = 0.0  # over all step sizes
        self.size_extra = np.zeros(len(curve.target_seconds))  # by step size (tokens - 1)
        self.size_steps = np.zeros(len(curve.target_seconds), dtype=int)
        self.draft_extra = {False: 0.0, True: 0.0}  # by whether the calls sampled
        self.steps = 0
        self._priced: dict[bool, SpeedCurve] = {}

    def target_step(self, tokens: int, seconds: float) -> None:
        """A decoding step of `tokens` tokens (no prefill among them) took `seconds`, its drafter call aside."""
        excess = seconds - self.curve.target_time(tokens)
        self.target_extra = self._mean(self.target_extra, excess)
        if tokens <= len(self.size_steps):
            size = tokens - 1
            self.size_steps[size] += 1  # a plain average of its first steps, then the running mean
            self.size_extra[size] = self._mean(self.size_extra[size], excess, max(WEIGHT, 1 / self.size_steps[size]))
        self.steps += 1
        if self.steps % REPRICE_STEPS == 0:
            self._priced.clear()

    def drafter_call(self, requests: int, context_rows: int, sampling: bool, seconds: float) -> None:
        """A drafter call for `requests` requests reading `context_rows` new positions took `seconds` in the loop."""
        profiled = self.profiled[sampling].draft_time(requests, context_rows)
        self.draft_extra[sampling] = self._mean(self.draft_extra[sampling], seconds - profiled)

    def priced(self, sampling: bool) -> SpeedCurve:
        """The curve to decide a step by (the same object between repricings)."""
        curve = self._priced.get(sampling)
        if curve is None:
            target_extra = np.where(self.size_steps >= SIZE_STEPS, self.size_extra, self.target_extra)
            curve = self._priced[sampling] = self.curve.priced(sampling, target_extra, self.draft_extra[sampling]) \
                .padded(self.row_multiple)
        return curve

    def _mean(self, mean: float, excess: float, weight: float = WEIGHT) -> float:
        """The running mean after one more step; one slow step (a collection, a burst of other work) moves it by at
        most `weight` times a one-token step."""
        bound = self.curve.target_time(1)
        return mean + weight * (float(np.clip(excess, -bound, bound)) - mean)
