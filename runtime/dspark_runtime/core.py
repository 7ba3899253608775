"""The step loop: one target call and one drafter call per step for all active requests, flattened.

A step: the scheduler picks how many drafts ℓ_r each decoding request verifies -> the target runs
[anchor_r, d_r1..d_rℓ] of every decoding request plus prefill chunks of new ones -> the verifier keeps
a prefix and emits one more token per request -> accepted K/V stay committed (the cache length moves)
-> the drafter reads the new target features and proposes the next γ tokens from each new anchor.

One owner per job: admission, slots and finishing here; the batch layout in `batches.lay_out`; the lossless
rule in `dspark_common.lossless.verify`; drafting, the schedulers and the gate in `drafting.Drafting`. Stop
strings are found where the text is made (`Engine._publish`), and callers reach the loop only through `Engine`.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Callable, TypeVar

import numpy as np

from dspark_common.engine_dir import Manifest
from dspark_common.errors import DSparkError
from dspark_common.lossless import point_masses, verify
from dspark_runtime.batches import Row, lay_out
from dspark_runtime.drafting import Drafting
from dspark_runtime.kv_cache import SlotPool
from dspark_runtime.logprobs import token_logprobs
from dspark_runtime.runner import GraphRunner
from dspark_runtime.scheduler import SpeedCurve
from dspark_runtime.sequence import NO_TOKENS, Sequence

FINISH_REASONS = ("stop", "length", "cancelled", "error")
Result = TypeVar("Result")


class EngineCore:
    """Single-threaded engine state; `Engine` drives it from a background thread."""

    def __init__(self, manifest: Manifest, target: GraphRunner, drafter: GraphRunner | None,
                 curve: SpeedCurve | None = None, sts: dict[float, tuple[np.ndarray, np.ndarray]] | None = None,
                 row_multiple: int = 1):
        """`row_multiple` 2 pads every step to an even number of rows (`lay_out`): every row then runs in a pair."""
        self.manifest, self.target, self.row_multiple = manifest, target, row_multiple
        self.slots = SlotPool(manifest.cache_slots)
        self.waiting: deque[Sequence] = deque()
        self.active: list[Sequence] = []
        self.changed: list[Sequence] = []  # requests with new tokens or a finish in the current step
        # requests ended so far, by finish reason (every key present: another thread may copy it while it counts)
        self.finished = Counter(dict.fromkeys(FINISH_REASONS, 0))
        self.round_log: list[tuple[int, np.ndarray, int]] | None = (
            None  # (request id, confidence logits, accepted) when recording
        )
        self.seconds = {"step": 0.0, "schedule": 0.0, "target": 0.0, "drafter": 0.0}  # steps, and the parts of them
        self.drafting = Drafting(manifest, drafter, curve, sts, self.isolated, self.timed, row_multiple)
        self.gamma = self.drafting.gamma

    def timed(self, part: str, call: Callable[..., Result], *args) -> Result:
        """`call(*args)`, its time added to `self.seconds[part]`."""
        started = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.seconds[part] += time.perf_counter() - started

    # ---- admission ------------------------------------------------------------------------------
    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    def _admit(self) -> None:
        while self.waiting and self.slots.free:
            sequence = self.waiting.popleft()
            if sequence.cancelled:
                self.finish(sequence, "cancelled")
                continue
            sequence.slot = self.slots.acquire()
            self.drafting.admit(sequence)
            self.active.append(sequence)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    # ---- what the engine reads and sets (between steps, on the loop's thread) ------------------------------
    @property
    def curve(self) -> SpeedCurve | None:
        return self.drafting.curve

    def set_curve(self, curve: SpeedCurve | None) -> None:
        self.drafting.set_curve(curve)

    @property
    def sts(self) -> dict[float, tuple[np.ndarray, np.ndarray]]:
        """The STS fits in use, by sampling temperature (a copy)."""
        return dict(self.drafting.sts or {})

    def set_sts(self, sts: dict[float, tuple[np.ndarray, np.ndarray]] | None) -> None:
        self.drafting.sts = sts

    def set_draft_gate(self, enabled: bool) -> None:
        self.drafting.draft_gate = enabled

    def gate_steps(self) -> dict[str, int]:
        """The draft gate's decisions so far, by kind (a copy)."""
        return dict(self.drafting.gate_steps)

    def load(self) -> dict[str, int]:
        """Requests running and waiting for a slot, and slots free (a snapshot)."""
        return {"active": len(self.active), "waiting": len(self.waiting), "free_slots": len(self.slots.free),
                "slots": self.slots.total}

    @property
    def drafter(self) -> GraphRunner | None:
        return self.drafting.drafter

    def fail_all(self, exc: Exception) -> list[Sequence]:
        """An engine fault: every request in flight or waiting ends "error" with it, its slot freed."""
        failed = list(self.active) + list(self.waiting)
        for sequence in failed:
            sequence.error = DSparkError(f"engine step failed: {exc}")
            self.finish(sequence, "error")
        for sequence in list(self.active):
            self.release(sequence)
        self.waiting.clear()
        return failed

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One step for every active request; returns the requests that got tokens or finished."""
        self.changed = []
        self.timed("step", self._step)
        return self.changed

    def _step(self) -> None:
        self._admit()
        for sequence in [s for s in self.active if s.cancelled]:
            self.finish(sequence, "cancelled")
            self.release(sequence)
        if not self.active:
            return
        started, decoding_only = time.perf_counter(), all(s.decoding for s in self.active)
        lengths = self.timed("schedule", self.drafting.schedule, [s for s in self.active if s.decoding])
        rows, batch = lay_out(self.active, lengths, self.manifest, self.row_multiple)
        outputs = self.timed("target", self.target.run, batch)
        for row in rows:
            self.isolated(row.sequence, self._advance, row, outputs)
        if decoding_only:  # what this step cost in the loop (prefill steps aside), its drafter call apart
            self.drafting.step_cost(len(batch.input_ids), time.perf_counter() - started)
        self.drafting.draft([s for s in self.active if s.decoding and s.spec.drafting and s.finish_reason is None],
                            self.active)
        for sequence in [s for s in self.active if s.finish_reason is not None]:
            self.release(sequence)

    def _advance(self, row: Row, outputs: dict[str, np.ndarray]) -> None:
        s = row.sequence
        features = outputs.get("features")
        if features is not None and s.spec.drafting and self.gamma:
            s.pending_features.append(features[row.start : row.start + row.count])
        logits = outputs["logits"][row.logit_start : row.logit_start + row.logit_count]
        if row.drafts < 0:  # a prefill chunk
            s.prefilled += row.count
            s.target_len = s.prefilled
            if row.logit_count:  # the last chunk: the first token, keyed by its position
                verdict = verify(logits, NO_TOKENS, None, s.penalty_history, s.params,
                                 lambda k, purpose: s.random.uniform(s.target_len + k, purpose))
                self._commit(s, [verdict.token], verdict.rows)
            return
        drafts = NO_TOKENS if row.drafts == 0 else s.drafts[: row.drafts]
        proposed = None if s.params.greedy or row.drafts == 0 else (
            point_masses(drafts, logits.shape[-1]) if s.free else s.draft_probs[: row.drafts])
        first = s.target_len + 1  # the position of the first draft, and of the token a plain step emits
        verdict = verify(logits, drafts, proposed, s.penalty_history, s.params,
                         lambda k, purpose: s.random.uniform(first + k, purpose))
        accepted = verdict.accepted
        if self.round_log is not None and row.drafts == self.gamma and s.confidence_logits is not None:
            self.round_log.append(
                (s.request_id, s.confidence_logits.copy(), accepted)
            )  # full-length rounds calibrate STS
        s.verifications.append((0 if s.drafts is None else len(s.drafts), row.drafts, accepted))
        if row.drafts:
            s.stats.rounds += 1
            s.stats.verified += row.drafts
            s.stats.accepted += accepted
        self.drafting.verified(s, row.drafts, accepted)
        s.target_len += accepted + 1  # the anchor and the accepted drafts are now committed
        if features is not None and s.spec.drafting and self.gamma:
            s.pending_features[-1] = s.pending_features[-1][: accepted + 1]
        self._commit(s, drafts[:accepted].tolist() + [verdict.token], verdict.rows, drafted=accepted)

    def _commit(self, s: Sequence, tokens: list[int], rows: np.ndarray, drafted: int = 0) -> None:
        """Append a step's tokens to the request and decide whether it finishes: an end or stop token, its token
        budget or a full context (a stop string in the text is found where the text is made: `stop`). `rows`: the
        processed target rows the tokens were emitted at (their log-probabilities, when the request asks); the
        first `drafted` tokens are accepted drafts."""
        if not np.isfinite(rows[np.arange(len(tokens)), tokens]).all():  # argmax and sampling both pick a NaN
            raise DSparkError("the target's logits for this request are not finite (NaN or inf): its numbers "
                              "overflowed; an fp32 engine may not")
        s.stats.steps += 1
        if s.stats.first_token is None:
            s.stats.first_token = time.perf_counter()
        s.anchor = tokens[-1]
        reason, first_new = None, len(s.generated)
        for index, token in enumerate(tokens):
            s.generated.append(token)
            s.from_draft.append(index < drafted)
            if token in s.stop_ids:
                reason = "stop"
                break
            s.visible += 1
            if len(s.generated) >= s.params.max_tokens:
                reason = "length"
                break
        if s.ngrams is not None:
            s.ngrams.extend(s.generated[first_new:])
        if s.params.logprobs is not None:
            s.logprobs += token_logprobs(rows, tokens[: len(s.generated) - len(s.logprobs)], s.params)
        if reason is None and s.target_len + 1 > self.manifest.max_context:  # the new anchor would not fit
            reason = "length"
        self.changed.append(s)
        if reason:
            self.finish(s, reason)

    def isolated(self, sequence: Sequence, work: Callable[..., Result], *args) -> Result | None:
        """`work(*args)` for one request; an exception it raises fails that request alone (finish "error")."""
        try:
            return work(*args)
        except Exception as exc:  # the request's own fault: the batch and the engine go on
            sequence.error = DSparkError(f"request failed: {type(exc).__name__}: {exc}")
            self.finish(sequence, "error")
            return None

    # ---- finishing ------------------------------------------------------------------------------
    def finish(self, sequence: Sequence, reason: str) -> None:
        """The one place a request's finish reason is set (the first reason stands)."""
        if sequence.finish_reason is None:
            sequence.finish_reason = reason
            sequence.stats.finished = time.perf_counter()
            self.finished[reason] += 1
            self.drafting.ended(sequence)
        if sequence not in self.changed:
            self.changed.append(sequence)

    def cancel(self, request_id: int) -> None:
        """Mark a queued or running request cancelled: the next step ends it and frees its slot."""
        for sequence in [*self.waiting, *self.active]:
            if sequence.request_id == request_id:
                sequence.cancelled = True

    def stop(self, sequence: Sequence) -> None:
        """A stop string appeared in the request's text: it ends "stop" now and frees its slot."""
        self.finish(sequence, "stop")
        if sequence in self.active:
            self.release(sequence)

    def release(self, sequence: Sequence) -> None:
        self.active.remove(sequence)
        self.slots.release(sequence.slot)
        sequence.slot = -1
