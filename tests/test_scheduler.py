"""Verification schedulers: hand-computed cases, and the paper's Appendix-A construction, which the
early-stopping scheduler passes and a global search (kept here, in the tests only) fails."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_runtime.scheduler import (AsyncScheduler, DraftGate, Probes, SpeedCurve, candidates, capacity,
                                      path_throughputs, schedule_sync, schedule_top_k)
from dspark_common.lossless import verify_sampled

scipy_stats = pytest.importorskip("scipy.stats")


def curve_from_sps(sps: list[float]) -> SpeedCurve:
    """A curve whose SPS(B) for one request is `sps[B - 1]` (no drafter cost)."""
    return SpeedCurve(1.0 / np.asarray(sps), np.zeros(1))


def test_flat_curve_verifies_everything():
    survival = np.cumprod(np.full((2, 4), 0.5), axis=1)
    flat = SpeedCurve(np.full(16, 0.01), np.full(4, 0.001))
    assert schedule_sync(survival, flat).tolist() == [4, 4]


def test_steep_curve_cuts():
    survival = np.cumprod(np.array([[0.9, 0.5, 0.5, 0.5]]), axis=1)  # a = .9, .45, .225, .1125
    steep = SpeedCurve(np.array([1.0, 1.1, 1.6, 2.5, 4.0]), np.zeros(1))
    # Θ: 1/1 -> 1.9/1.1 = 1.73 -> 2.35/1.6 = 1.47 (stop): verify one draft
    assert schedule_sync(survival, steep).tolist() == [1]


def test_budget_goes_to_the_confident_request():
    survival = np.array([[0.95, 0.9, 0.85], [0.05, 0.0025, 0.0001]])
    curve = SpeedCurve(np.array([1.0, 1.0, 1.05, 1.1, 1.3, 1.6, 2.0]), np.zeros(2))
    assert schedule_sync(survival, curve).tolist() == [3, 0]
    assert schedule_top_k(survival, 3).tolist() == [3, 0]


def test_ties_keep_prefix_order():
    survival = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.5]])
    order = [(j, r) for _, j, r in candidates(survival)]
    assert order.index((0, 0)) < order.index((1, 0)) < order.index((2, 0))
    assert schedule_top_k(survival, 2).tolist() == [1, 1]


def test_async_uses_capacity_from_two_steps_earlier():
    curve = SpeedCurve(np.array([1.0, 1.0, 1.0, 1.0, 3.0, 9.0]), np.zeros(2))
    scheduler = AsyncScheduler(curve)
    confident, hopeless = np.full((2, 3), 0.99), np.full((2, 3), 0.01)
    assert scheduler.schedule(confident).tolist() == [1, 1]  # cold start: one draft each
    assert scheduler.schedule(hopeless).tolist() == [1, 1]
    assert capacity(confident, curve) == 2
    assert scheduler.schedule(hopeless).sum() == 2  # K from step 1 (confident), choice from now
    assert scheduler.schedule(confident).sum() == capacity(hopeless, curve)


def test_gate_drafts_only_when_drafting_pays():
    survival = np.cumprod(np.full((2, 3), 0.8), axis=1)  # a = .8, .64, .512 for each of two requests
    target = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # flat: verifying is free
    # Θ with all six drafts: (2 + 2·1.952) / (t_draft + 1); without drafting: 2 / 1
    assert path_throughputs(survival, SpeedCurve(target, np.array([1.0, 1.0]))).max() == pytest.approx(5.904 / 2)
    assert DraftGate(SpeedCurve(target, np.array([1.0, 1.0]))).worth_drafting(survival)
    # 5.904 / 3 < 2 loses, asked again with the same survivals too; sure drafts would win (8 / 3 > 2)
    costly = DraftGate(SpeedCurve(target, np.array([2.0, 2.0])))
    assert costly.can_pay(2) and not any(costly.worth_drafting(tuple(survival)) for _ in range(3))
    # a drafter that costs more than γ sure tokens save at this load: never worth it, whatever the survivals
    hopeless = DraftGate(SpeedCurve(target, np.array([9.0, 9.0])))
    assert not hopeless.can_pay(2) and not hopeless.worth_drafting(np.ones((2, 3)))


def test_probes_look_at_once_then_after_doubling_intervals_and_reset_when_drafting_pays():
    probes, looks = Probes(), []
    for generated in range(400):
        if generated >= probes.due:
            looks.append(generated)
            probes.looked(generated)
    assert looks == [0, 16, 48, 112, 240]  # a shrinking share: 5 looks in 400 tokens, 1 + log2(n / 16) in n
    probes.paid()
    probes.looked(400)
    assert probes.due == 416


def test_gate_pays_a_catch_up_only_when_the_remaining_tokens_repay_it():
    """A drafter that has not read the last 200 positions must read them first (0.01 each: 2 seconds); drafting
    saves 1/2 - 1/5.904 (0.33 seconds) a token here, so 5 remaining tokens do not repay it and 7 do."""
    curve = SpeedCurve(np.ones(8), np.array([0.0, 0.0]), draft_seconds_per_context_row=0.01)
    survival = np.cumprod(np.full((2, 3), 0.8), axis=1)
    assert not DraftGate(curve).worth_drafting(survival, context_rows=206, remaining=5)
    assert DraftGate(curve).worth_drafting(survival, context_rows=206, remaining=7)


def test_a_probe_is_bought_only_where_sure_drafts_could_repay_it_twice():
    """A look costs a drafter call (0.5 s here); at best it finds drafts that are always accepted, which save
    1/plain - 1/sure seconds a token: a look is worth it once the tokens left could save twice its cost, and never
    where even sure drafts lose. Here t(B) = 0.8 + 0.2 B: plain decoding 1 s a token; seven sure drafts give 8
    tokens in 0.5 + 2.4 s, 0.3625 s a token, saving 0.6375 s each: 2 tokens repay 1 s, 1 token does not."""
    curve = SpeedCurve(0.8 + 0.2 * np.arange(1, 9), np.array([0.5]))
    gate = DraftGate(curve, 7)
    assert gate.worth_a_look(1, 2) and not gate.worth_a_look(1, 1)
    hopeless = DraftGate(SpeedCurve(np.ones(8), np.array([9.0])), 7)
    assert not hopeless.can_pay(1) and not hopeless.worth_a_look(1, 10**6)


# ---- Appendix A (R = 1, γ = 2): scheduler decisions that peek at x1 break losslessness ------------

def schedule_global(survival: np.ndarray, curve: SpeedCurve) -> np.ndarray:
    """Global search along the greedy path, no early stop: NOT lossless (used only as a negative control)."""
    budget = capacity(survival, curve)
    return schedule_top_k(survival, budget)


TARGET_1, DRAFT = np.array([0.7, 0.3]), np.array([0.5, 0.5])
A, B = 0, 1


def emit(lengths: int, drafts, target_rows, draft_rows, rng) -> list[int]:
    """Verify `lengths` drafts; the round's emitted tokens."""
    accepted, token = verify_sampled(
        np.stack(target_rows[: lengths + 1]),
        np.reshape(draft_rows[:lengths], (lengths, 2)),
        np.array(drafts[:lengths], dtype=np.int64),
        lambda k, purpose: rng.random(),
    )
    return list(drafts[:accepted]) + [token]


def first_token_frequency(scheduler, curve, samples, seed) -> float:
    """Case 1: c1 = 0.8 always; c2 = 0.9 if x1 = A else 0. How often is the first emitted token A?"""
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(samples):
        x1 = int(rng.integers(2))  # drafted from p_d = (0.5, 0.5)
        x2 = int(rng.integers(2))
        survival = np.array([[0.8, 0.72 if x1 == A else 0.0]])
        length = int(scheduler(survival, curve)[0])
        uniform = np.array([0.5, 0.5])
        tokens = emit(length, [x1, x2], [TARGET_1, uniform, uniform], [DRAFT, DRAFT], rng)
        hits += tokens[0] == A
    return hits / samples


@pytest.mark.parametrize("scheduler, lossless", [(schedule_sync, True), (schedule_global, False)])
def test_appendix_a_case_one(scheduler, lossless):
    curve = curve_from_sps([1.0, 0.5, 0.45])
    samples = 100_000
    frequency = first_token_frequency(scheduler, curve, samples, seed=11)
    standard_error = np.sqrt(0.21 / samples)
    assert (abs(frequency - 0.7) < 5 * standard_error) == lossless, frequency


def joint_two_tokens(scheduler, samples, seed) -> np.ndarray:
    """Case 2: SPS(2) = 0.6 admits x1 always; x2 only when x1 = A. Joint counts of (Y1, Y2)."""
    curve = curve_from_sps([1.0, 0.6, 0.45])
    target_2 = {A: np.array([0.2, 0.8]), B: np.array([0.6, 0.4])}
    rng = np.random.default_rng(seed)
    counts = np.zeros((2, 2), dtype=np.int64)
    for _ in range(samples):
        x1 = int(rng.integers(2))
        x2 = int(rng.integers(2))
        survival = np.array([[0.8, 0.72 if x1 == A else 0.0]])
        length = int(scheduler(survival, curve)[0])
        tokens = emit(length, [x1, x2], [TARGET_1, target_2[x1], np.array([0.5, 0.5])], [DRAFT, DRAFT], rng)
        if len(tokens) == 1:
            tokens.append(int(rng.choice(2, p=target_2[tokens[0]])))
        counts[tokens[0], tokens[1]] += 1
    return counts


def test_appendix_a_case_two_joint_distribution():
    counts = joint_two_tokens(schedule_sync, 60_000, seed=5)
    expected = np.array([[0.14, 0.56], [0.18, 0.12]]) * counts.sum()
    assert scipy_stats.chisquare(counts.ravel(), expected.ravel()).pvalue > 1e-3


def test_priors_wait_longer_at_a_temperature_whose_requests_never_drafted_and_reset_when_one_does():
    from dspark_runtime.ngram import FreeDraftAcceptance
    from dspark_runtime.priors import Priors

    priors = Priors()
    assert priors.probes(1.0).due == 0  # nothing known: look at once
    declined = Probes(declined=True)
    firsts = []
    for _ in range(6):
        priors.ended(1.0, declined, FreeDraftAcceptance())
        firsts.append(priors.probes(1.0).due)
    assert firsts == [16, 32, 64, 128, 128, 128]  # at most 128 tokens: a longer request still looks
    assert priors.probes(0.0).due == 0  # another temperature keeps its own record
    priors.ended(1.0, Probes(due=16), FreeDraftAcceptance())  # ended before its survivals were weighed
    assert priors.probes(1.0).due == 128
    priors.ended(1.0, Probes(paying=True), FreeDraftAcceptance())
    assert priors.probes(1.0).due == 0


def test_priors_hand_new_requests_the_free_drafts_acceptance_of_their_temperature():
    from dspark_runtime.ngram import FreeDraftAcceptance
    from dspark_runtime.priors import Priors

    priors, record = Priors(), FreeDraftAcceptance()
    record.add(verified=4, accepted=0)  # one draft seen, rejected
    record.add(verified=4, accepted=0)
    priors.ended(1.0, Probes(), record)
    assert priors.free_acceptance(1.0).prior == 0.5 / 3 and priors.free_acceptance(0.0).prior == 0.5
    for _ in range(3):  # requests that verified none: the record fades
        priors.ended(1.0, Probes(), FreeDraftAcceptance())
    assert priors.free_acceptance(1.0).prior == 0.5 / 1.25
