"""The step loop: one target call and one drafter call per step for all active requests, flattened.

A step: the scheduler picks how many drafts ℓ_r each decoding request verifies -> the target runs
[anchor_r, d_r1..d_rℓ] of every decoding request plus prefill chunks of new ones -> the verifier keeps
a prefix and emits one more token per request -> accepted K/V stay committed (the cache length moves)
-> the drafter reads the new target features and proposes the next γ tokens from each new anchor.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, TypeVar

import numpy as np

from dspark_calibration.sts import prefix_survival
from dspark_runtime.batches import DraftBatch, DraftRequest, TargetBatch
from dspark_common.engine_dir import Manifest
from dspark_common.errors import DSparkError
from dspark_runtime.kv_cache import SlotPool
from dspark_runtime.ngram import LONGEST, NgramIndex, drafts_worth_verifying
from dspark_runtime.priors import Priors
from dspark_runtime.sampling import target_rows, token_logprobs
from dspark_runtime.scheduler import AsyncScheduler, DraftGate, SpeedCurve, schedule_sync
from dspark_common.randomness import EMIT
from dspark_runtime.runner import GraphRunner
from dspark_runtime.sequence import Sequence
from dspark_common.verify import point_masses, sample, verify_greedy, verify_sampled

FINISH_REASONS = ("stop", "length", "cancelled", "error")
Result = TypeVar("Result")


@dataclass
class _Row:
    """Where one request's tokens sit in the flattened target batch."""

    sequence: Sequence
    start: int  # first token index in the batch
    count: int  # tokens in the batch
    logit_start: int  # first row in the logits output
    logit_count: int
    drafts: int  # drafts verified (decode) or -1 (prefill chunk)


class EngineCore:
    """Single-threaded engine state; `Engine` drives it from a background thread."""

    def __init__(self, manifest: Manifest, target: GraphRunner, drafter: GraphRunner | None,
                 curve: SpeedCurve | None = None, sts: dict[float, tuple[np.ndarray, np.ndarray]] | None = None):
        self.manifest = manifest
        self.target, self.drafter = target, drafter
        self.gamma = manifest.gamma if drafter else 0
        self.slots = SlotPool(manifest.cache_slots)
        self.waiting: deque[Sequence] = deque()
        self.active: list[Sequence] = []
        self.changed: list[Sequence] = []  # requests with new tokens or a finish in the current step
        # requests ended so far, by finish reason (every key present: another thread may copy it while it counts)
        self.finished = Counter(dict.fromkeys(FINISH_REASONS, 0))
        self.sts = sts  # (STS temperatures, offsets) by the sampling temperature they were fitted at
        self.set_curve(curve)
        self.draft_gate = True  # sync/async skip the drafter when it would not pay (False: draft every step)
        self.priors = Priors()  # what ended sync/async requests teach new ones at their temperature
        self.gate_steps = Counter(draft=0, probe=0, plain=0, free=0)  # sync/async steps: the gate's decisions, and
        # the steps that verified free drafts
        self.round_log: list[tuple[int, np.ndarray, int]] | None = (
            None  # (request id, confidence logits, accepted) when recording
        )
        self.seconds = {"step": 0.0, "schedule": 0.0, "target": 0.0, "drafter": 0.0}  # steps, and the parts of them

    def _timed(self, part: str, call: Callable[..., Result], *args) -> Result:
        """`call(*args)`, its time added to `self.seconds[part]`."""
        started = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.seconds[part] += time.perf_counter() - started

    def set_curve(self, curve: SpeedCurve | None) -> None:
        self.curve = curve
        self.async_scheduler = AsyncScheduler(curve, self.gamma) if curve is not None else None
        self.gate = DraftGate(curve, self.gamma) if curve is not None else None

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
            if sequence.spec.kind in ("sync", "async"):
                sequence.probes = self.priors.probes(sequence.params.temperature)
                sequence.free_acceptance = self.priors.free_acceptance(sequence.params.temperature)
                sequence.ngrams = NgramIndex(sequence.prompt)
            self.active.append(sequence)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One step for every active request; returns the requests that got tokens or finished."""
        self.changed = []
        self._timed("step", self._step)
        return self.changed

    def _step(self) -> None:
        self._admit()
        for sequence in [s for s in self.active if s.cancelled]:
            self.finish(sequence, "cancelled")
            self.release(sequence)
        if not self.active:
            return
        lengths = self._timed("schedule", self._schedule, [s for s in self.active if s.decoding])
        rows, batch = self._target_batch(lengths)
        outputs = self._timed("target", self.target.run, batch)
        for row in rows:
            self._isolated(row.sequence, self._advance, row, outputs)
        self._draft(self._gated([s for s in self.active if s.decoding and s.spec.drafting and s.finish_reason is None]))
        for sequence in [s for s in self.active if s.finish_reason is not None]:
            self.release(sequence)

    def _schedule(self, decoding: list[Sequence]) -> dict[int, int]:
        """Drafts to verify per decoding request (request id -> ℓ), within the request's limits."""
        lengths = {}
        scheduled = {"sync": [], "async": []}
        for s in decoding:
            if s.drafts is None or not s.spec.drafting:
                lengths[s.request_id] = 0
            elif s.spec.kind == "fixed":
                lengths[s.request_id] = min(s.spec.drafts, self.gamma)
            else:
                scheduled[s.spec.kind].append(s)
        for kind, group in scheduled.items():
            if not group:
                continue
            survival = np.stack([s.survival for s in group])
            if kind == "sync":
                chosen = schedule_sync(survival, self.curve, self.gamma)
            else:
                chosen = self.async_scheduler.schedule(survival)
            lengths.update({s.request_id: int(n) for s, n in zip(group, chosen)})
        if self.curve is not None:  # free drafts where the drafter is not drafting, priced beside the rest
            tokens = len(decoding) + sum(lengths.values())
            expected = float(len(decoding))
            for s in decoding:
                if s.drafts is None and s.spec.kind in scheduled:
                    lengths[s.request_id], gain = self._free_drafts(s, tokens, expected)
                    tokens, expected = tokens + lengths[s.request_id], expected + gain
        for s in decoding:  # never past the context, the token budget or what was drafted
            room = min(self.manifest.max_context - s.target_len - 1, s.params.max_tokens - len(s.generated) - 1)
            lengths[s.request_id] = max(0, min(lengths[s.request_id], room))
        return lengths

    def _free_drafts(self, s: Sequence, tokens: int, expected: float) -> tuple[int, float]:
        """Free drafts (`dspark_runtime.ngram`) for a request the drafter is not drafting for: how many to add to a
        step of `tokens` tokens expected to emit `expected`, priced by the speed curve at the request's record of
        them, and the tokens they are expected to add."""
        proposed = s.ngrams.lookup(self.gamma or LONGEST)
        rate = s.free_acceptance.rate
        verified = drafts_worth_verifying(len(proposed), rate, self.curve, tokens, expected)
        if not verified:
            return 0, 0.0
        s.drafts, s.draft_probs, s.free = proposed, None, True
        s.stats.drafted += len(proposed)
        self.gate_steps["free"] += 1
        return verified, float(np.sum(rate ** np.arange(1, verified + 1)))

    def _survival(self, logits: np.ndarray | None, temperature: float) -> np.ndarray:
        """Prefix survival from confidence logits, with the STS fit nearest the request's sampling temperature."""
        if logits is None:
            return np.ones(self.gamma)
        scales, offsets = self.sts[min(self.sts, key=lambda t: abs(t - temperature))] if self.sts else (1.0, 0.0)
        return prefix_survival(logits[None], scales, offsets)[0]

    def _gated(self, sequences: list[Sequence]) -> list[Sequence]:
        """The requests to draft for: all of them while a `fixed:K` request is among them (it pays for the drafter
        call anyway), when the `sync`/`async` requests' survivals say drafting pays, or when one of them is due to
        look again (`Probes`); else none (their drafts are dropped, so the next step verifies nothing and runs no
        drafter)."""
        scheduled = [s for s in sequences if s.spec.kind in ("sync", "async")]
        if not self.draft_gate or not scheduled or len(scheduled) < len(sequences):
            return sequences
        if self.gate.can_pay(len(scheduled)):
            if all(s.survival is not None for s in scheduled):
                unread = sum(s.target_len - s.drafter_len for s in scheduled)
                remaining = sum(s.params.max_tokens - len(s.generated) for s in scheduled)
                if self.gate.worth_drafting(tuple(s.survival for s in scheduled), unread, remaining):
                    for s in scheduled:
                        s.probes.paid()
                    self.gate_steps["draft"] += 1
                    return sequences
                for s in scheduled:  # what the survivals said (a catch-up the tokens left cannot repay aside)
                    s.probes.paying |= self.gate.steady_pays
                    s.probes.declined |= not self.gate.steady_pays
            if any(len(s.generated) >= s.probes.due for s in scheduled):
                for s in scheduled:  # the call refreshes every request's survivals
                    s.probes.looked(len(s.generated))
                self.gate_steps["probe"] += 1
                return sequences
        for s in scheduled:
            s.drafts = s.draft_probs = s.confidence_logits = None
        self.gate_steps["plain"] += 1
        return []

    def _target_batch(self, lengths: dict[int, int]) -> tuple[list[_Row], TargetBatch]:
        ids, slots, positions, logit_index, rows = [], [], [], [], []
        budget = self.manifest.max_batch_tokens
        decoding = [s for s in self.active if s.decoding]
        prefilling = [s for s in self.active if not s.decoding]
        for s in decoding:
            drafts = lengths[s.request_id]
            tokens = [s.anchor] + ([] if drafts == 0 else s.drafts[:drafts].tolist())
            rows.append(_Row(s, len(ids), len(tokens), len(logit_index), len(tokens), drafts))
            logit_index += range(len(ids), len(ids) + len(tokens))
            ids += tokens
            slots += [s.slot] * len(tokens)
            positions += range(s.target_len, s.target_len + len(tokens))
        # a slot's new tokens are padded to the step's longest in a cache of cache_rows positions: a chunk may
        # not run past the end of the fullest slot's rows (decoding rows always fit: cache_rows leaves γ + 1)
        longest = self.manifest.cache_rows - max(s.target_len for s in self.active)
        for s in prefilling:
            room = min(budget - len(ids), longest)
            if room <= 0 and ids:
                break
            chunk = s.prompt[s.prefilled : s.prefilled + max(room, 1)]
            final = s.prefilled + len(chunk) == len(s.prompt)
            rows.append(_Row(s, len(ids), len(chunk), len(logit_index), int(final), -1))
            if final:
                logit_index.append(len(ids) + len(chunk) - 1)
            ids += chunk
            slots += [s.slot] * len(chunk)
            positions += range(s.prefilled, s.prefilled + len(chunk))
        cache_len = np.zeros(self.manifest.cache_slots, dtype=np.int64)
        for s in self.active:
            cache_len[s.slot] = s.target_len
        batch = TargetBatch(np.asarray(ids, dtype=np.int64), np.asarray(positions, dtype=np.int64),
                            np.asarray(slots, dtype=np.int64), cache_len, np.asarray(logit_index, dtype=np.int64))
        return rows, batch

    def _advance(self, row: _Row, outputs: dict[str, np.ndarray]) -> None:
        s = row.sequence
        features = outputs.get("features")
        if features is not None and s.spec.drafting and self.gamma:
            s.pending_features.append(features[row.start : row.start + row.count])
        logits = outputs["logits"][row.logit_start : row.logit_start + row.logit_count]
        if row.drafts < 0:  # a prefill chunk
            s.prefilled += row.count
            s.target_len = s.prefilled
            if row.logit_count:
                processed = target_rows(logits, s.penalty_history, np.zeros(0, np.int64), s.params)
                greedy = s.params.greedy
                token = (
                    int(np.argmax(processed[0]))
                    if greedy
                    else sample(processed[0], s.random.uniform(s.target_len, EMIT))
                )
                self._commit(s, [token], processed)
            return
        drafts = np.zeros(0, np.int64) if row.drafts == 0 else s.drafts[: row.drafts]
        processed = target_rows(logits, s.penalty_history, drafts, s.params)
        if s.params.greedy:
            accepted, token = verify_greedy(processed.argmax(-1), drafts)
        elif row.drafts == 0:
            accepted, token = 0, sample(processed[0], s.random.uniform(s.target_len + 1, EMIT))
        else:
            first = s.target_len + 1  # the position the first draft proposes
            proposed = point_masses(drafts, processed.shape[-1]) if s.free else s.draft_probs[: row.drafts]
            accepted, token = verify_sampled(processed, proposed, drafts,
                                             lambda k, purpose: s.random.uniform(first + k, purpose))
        if self.round_log is not None and row.drafts == self.gamma and s.confidence_logits is not None:
            self.round_log.append(
                (s.request_id, s.confidence_logits.copy(), accepted)
            )  # full-length rounds calibrate STS
        s.verifications.append((0 if s.drafts is None else len(s.drafts), row.drafts, accepted))
        if row.drafts:
            s.stats.rounds += 1
            s.stats.verified += row.drafts
            s.stats.accepted += accepted
        if s.free:
            s.free_acceptance.add(row.drafts, accepted)
            s.stats.free_accepted += accepted
            s.drafts, s.free = None, False
        s.target_len += accepted + 1  # the anchor and the accepted drafts are now committed
        if features is not None and s.spec.drafting and self.gamma:
            s.pending_features[-1] = s.pending_features[-1][: accepted + 1]
        self._commit(s, drafts[:accepted].tolist() + [token], processed, drafted=accepted)

    def _commit(self, s: Sequence, tokens: list[int], rows: np.ndarray, drafted: int = 0) -> None:
        """Append a step's tokens to the request and decide whether it finishes: an end or stop token, its token
        budget, a full context, or a stop string in the text (which the text sink reports). `rows`: the processed
        target rows the tokens were emitted at (their log-probabilities, when the request asks); the first
        `drafted` tokens are accepted drafts."""
        if not np.isfinite(rows[np.arange(len(tokens)), tokens]).all():  # argmax and sampling both pick a NaN
            raise DSparkError("the target's logits for this request are not finite (NaN or inf): its numbers "
                              "overflowed; an fp32 engine may not")
        s.stats.steps += 1
        if s.stats.first_token is None:
            s.stats.first_token = time.perf_counter()
        s.anchor = tokens[-1]
        visible, reason, first_new = [], None, len(s.generated)
        for index, token in enumerate(tokens):
            s.generated.append(token)
            s.from_draft.append(index < drafted)
            if token in s.stop_ids:
                reason = "stop"
                break
            visible.append(token)
            if len(s.generated) >= s.params.max_tokens:
                reason = "length"
                break
        if s.ngrams is not None:
            s.ngrams.extend(s.generated[first_new:])
        if s.params.logprobs is not None:
            s.logprobs += token_logprobs(rows, tokens[: len(s.generated) - len(s.logprobs)], s.params)
        if reason is None and s.target_len + 1 > self.manifest.max_context:  # the new anchor would not fit
            reason = "length"
        if s.stop_text(visible) and reason is None:
            reason = "stop"
        self.changed.append(s)
        if reason:
            self.finish(s, reason)

    def _draft(self, sequences: list[Sequence]) -> None:
        if not sequences or not self.gamma:
            return
        cache_len = np.zeros(self.manifest.cache_slots, dtype=np.int64)
        for s in self.active:
            cache_len[s.slot] = s.drafter_len
        prepared = [(s, self._isolated(s, self._draft_request, s)) for s in sequences]
        sequences = [s for s, request in prepared if request is not None]
        if not sequences:
            return
        batch = DraftBatch([request for _, request in prepared if request is not None], cache_len)
        outputs = self._timed("drafter", self.drafter.run, batch)
        for index, s in enumerate(sequences):
            s.drafts = outputs["draft_tokens"][index]
            s.stats.drafted += len(s.drafts)
            s.draft_probs = outputs["draft_probs"][index]
            s.confidence_logits = outputs["confidence_logits"][index] if "confidence_logits" in outputs else None
            s.survival = self._survival(s.confidence_logits, s.params.temperature)
            s.drafter_len = s.target_len
            s.pending_features = []

    def _draft_request(self, s: Sequence) -> DraftRequest:
        return DraftRequest(
            slot=s.slot,
            anchor=s.anchor,
            anchor_pos=s.target_len,
            context_start=s.drafter_len,
            features=np.concatenate(s.pending_features),
            next_tokens=s.tokens_at(s.drafter_len + 1, s.target_len + 1),
            temperature=s.params.temperature,
            noise=s.random.draft_noise(s.target_len + 1, self.gamma).clip(1e-12, 1 - 1e-7),
        )

    def _isolated(self, sequence: Sequence, work: Callable[..., Result], *args) -> Result | None:
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
            if sequence.spec.kind in ("sync", "async"):
                self.priors.ended(sequence.params.temperature, sequence.probes, sequence.free_acceptance)
        if sequence not in self.changed:
            self.changed.append(sequence)

    def release(self, sequence: Sequence) -> None:
        self.active.remove(sequence)
        self.slots.release(sequence.slot)
        sequence.slot = -1
