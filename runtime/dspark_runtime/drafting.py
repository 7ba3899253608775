"""Drafting and how much of it the target verifies: the drafter call and its STS survivals, the schedulers
(`fixed:K`, `sync`, `async`), the draft gate with each request's probes and the priors by temperature, and free
drafts from prompt lookup. The step loop (`EngineCore`) asks it for each step's lengths and calls it after
verification to draft from the new anchors."""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable

import numpy as np

from dspark_calibration.sts import prefix_survival
from dspark_common.engine_dir import Manifest
from dspark_runtime.batches import DraftBatch, DraftRequest
from dspark_runtime.loop_costs import LoopCosts
from dspark_runtime.ngram import LONGEST, NgramIndex, drafts_worth_verifying
from dspark_runtime.priors import Priors
from dspark_runtime.runner import GraphRunner
from dspark_runtime.scheduler import AsyncScheduler, DraftGate, SpeedCurve, schedule_sync
from dspark_runtime.sequence import Sequence

SCHEDULED = ("sync", "async")  # the modes whose drafts the speed curve and the gate decide


class Drafting:
    """One engine's drafter side. `isolated(sequence, work, *args)` runs one request's part so that its failure
    ends it alone; `timed(part, call, *args)` adds a call's time to the step's parts."""

    def __init__(self, manifest: Manifest, drafter: GraphRunner | None, curve: SpeedCurve | None,
                 sts: dict[float, tuple[np.ndarray, np.ndarray]] | None, isolated: Callable, timed: Callable,
                 row_multiple: int = 1):
        """`row_multiple`: the step loop pads every step to a multiple of that many rows (`EngineCore`)."""
        self.manifest, self.drafter, self.row_multiple = manifest, drafter, row_multiple
        self.gamma = manifest.gamma if drafter else 0
        self.sts = sts  # (STS temperatures, offsets) by the sampling temperature they were fitted at
        self.isolated, self.timed = isolated, timed
        self.draft_gate = True  # sync/async skip the drafter when it would not pay (False: draft every step)
        self.priors = Priors()  # what ended sync/async requests teach new ones at their temperature
        self.gate_steps = Counter(draft=0, probe=0, plain=0, free=0)  # sync/async steps: the gate's decisions, and
        # the steps that verified free drafts
        self.set_curve(curve)

    def set_curve(self, curve: SpeedCurve | None) -> None:
        """Decide from `curve` (as profiled), repriced by what steps cost in the loop (`LoopCosts`)."""
        self.curve = curve
        self.loop_costs = self.priced = self.async_scheduler = self.gate = None
        if curve is not None:
            self.loop_costs = LoopCosts(curve, self.row_multiple)
            self.priced = self.loop_costs.priced(sampling=True)  # this step's curve
            self.async_scheduler = AsyncScheduler(self.priced, self.gamma)
            self.gate = DraftGate(self.priced, self.gamma)

    def _price(self, decoding: list[Sequence]) -> None:
        """Price this step by the curve of its drafter calls (sampling where any request samples) and the loop's
        costs."""
        priced = self.loop_costs.priced(any(s.params.temperature > 0 for s in decoding))
        if priced is not self.priced:
            self.priced = self.async_scheduler.curve = priced
            self.gate.reprice(priced)

    def step_cost(self, tokens: int, seconds: float) -> None:
        """A decoding step of `tokens` tokens took `seconds` in the loop, before its drafter call."""
        if self.loop_costs is not None:
            self.loop_costs.target_step(tokens, seconds)

    def admit(self, sequence: Sequence) -> None:
        """A request takes a slot: a `sync`/`async` one starts from the priors at its temperature."""
        if sequence.spec.kind in SCHEDULED:
            sequence.probes = self.priors.probes(sequence.params.temperature)
            sequence.free_acceptance = self.priors.free_acceptance(sequence.params.temperature)
            sequence.ngrams = NgramIndex(sequence.prompt)

    def ended(self, sequence: Sequence) -> None:
        """A request finished: what its looks and free drafts showed becomes the priors at its temperature."""
        if sequence.spec.kind in SCHEDULED:
            self.priors.ended(sequence.params.temperature, sequence.probes, sequence.free_acceptance)

    def schedule(self, decoding: list[Sequence]) -> dict[int, int]:
        """Drafts to verify per decoding request (request id -> ℓ), within the request's limits."""
        lengths = {}
        if self.curve is not None:
            self._price(decoding)
        scheduled: dict[str, list[Sequence]] = {kind: [] for kind in SCHEDULED}
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
                chosen = schedule_sync(survival, self.priced, self.gamma)
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
        verified = drafts_worth_verifying(len(proposed), rate, self.priced, tokens, expected)
        if not verified:
            return 0, 0.0
        s.drafts, s.draft_probs, s.free = proposed, None, True
        s.stats.drafted += len(proposed)
        self.gate_steps["free"] += 1
        return verified, float(np.sum(rate ** np.arange(1, verified + 1)))

    def verified(self, s: Sequence, verified: int, accepted: int) -> None:
        """The target checked `verified` of the request's drafts and kept `accepted`: free drafts are spent, their
        record kept (the drafter's stay until the next draft call replaces them)."""
        if s.free:
            s.free_acceptance.add(verified, accepted)
            s.stats.free_accepted += accepted
            s.drafts, s.free = None, False

    def _survival(self, logits: np.ndarray | None, temperature: float) -> np.ndarray:
        """Prefix survival from confidence logits, with the STS fit nearest the request's sampling temperature."""
        if logits is None:
            return np.ones(self.gamma)
        scales, offsets = self.sts[min(self.sts, key=lambda t: abs(t - temperature))] if self.sts else (1.0, 0.0)
        return prefix_survival(logits[None], scales, offsets)[0]

    def _gated(self, sequences: list[Sequence]) -> list[Sequence]:
        """The requests to draft for: all of them while a `fixed:K` request is among them (it pays for the drafter
        call anyway), when the `sync`/`async` requests' survivals say drafting pays, or when one of them is due to
        look again (`Probes`) and a look can repay itself; else none (their drafts are dropped, so the next step
        verifies nothing and runs no drafter)."""
        scheduled = [s for s in sequences if s.spec.kind in SCHEDULED]
        if not self.draft_gate or not scheduled or len(scheduled) < len(sequences):
            return sequences
        if self.gate.can_pay(len(scheduled)):
            unread = sum(s.target_len - s.drafter_len for s in scheduled)
            remaining = sum(s.params.max_tokens - len(s.generated) for s in scheduled)
            if all(s.survival is not None for s in scheduled):
                if self.gate.worth_drafting(tuple(s.survival for s in scheduled), unread, remaining):
                    for s in scheduled:
                        s.probes.paid()
                    self.gate_steps["draft"] += 1
                    return sequences
                for s in scheduled:  # what the survivals said (a catch-up the tokens left cannot repay aside)
                    s.probes.paying |= self.gate.steady_pays
                    s.probes.declined |= not self.gate.steady_pays
            if any(len(s.generated) >= s.probes.due for s in scheduled) and \
                    self.gate.worth_a_look(len(scheduled), remaining, unread):
                for s in scheduled:  # the call refreshes every request's survivals
                    s.probes.looked(len(s.generated))
                self.gate_steps["probe"] += 1
                return sequences
        for s in scheduled:
            s.drafts = s.draft_probs = s.confidence_logits = None
        self.gate_steps["plain"] += 1
        return []

    def draft(self, sequences: list[Sequence], active: list[Sequence]) -> None:
        """Draft from the new anchors of `sequences` (decoding, drafting, unfinished), those the gate lets through."""
        self._draft(self._gated(sequences), active)

    def _draft(self, sequences: list[Sequence], active: list[Sequence]) -> None:
        if not sequences or not self.gamma:
            return
        started = time.perf_counter()
        cache_len = np.zeros(self.manifest.cache_slots, dtype=np.int64)
        for s in active:
            cache_len[s.slot] = s.drafter_len
        prepared = [(s, self.isolated(s, self._draft_request, s)) for s in sequences]
        sequences = [s for s, request in prepared if request is not None]
        if not sequences:
            return
        batch = DraftBatch([request for _, request in prepared if request is not None], cache_len)
        outputs = self.timed("drafter", self.drafter.run, batch)
        for index, s in enumerate(sequences):
            s.drafts = outputs["draft_tokens"][index]
            s.stats.drafted += len(s.drafts)
            s.draft_probs = outputs["draft_probs"][index]
            s.confidence_logits = outputs["confidence_logits"][index] if "confidence_logits" in outputs else None
            s.survival = self._survival(s.confidence_logits, s.params.temperature)
            s.drafter_len = s.target_len
            s.pending_features = []
        if self.loop_costs is not None:
            self.loop_costs.drafter_call(len(batch.requests), sum(len(r.features) for r in batch.requests),
                                         any(r.temperature > 0 for r in batch.requests), time.perf_counter() - started)

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
