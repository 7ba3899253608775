"""The lossless verifier: exact algebra, and a sampled two-token chain against the target's distribution
(with broken verifiers as negative controls, so the test provably has the power to fail)."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_common.randomness import ACCEPT, EMIT, KeyedRandom
from dspark_common.lossless import point_masses, residual, sample, verify_greedy, verify_sampled

scipy_stats = pytest.importorskip("scipy.stats")


def random_probs(rng, size, kind="dirichlet"):
    if kind == "onehot":
        out = np.zeros(size)
        out[rng.integers(size)] = 1.0
        return out
    return rng.dirichlet(np.full(size, 0.5))


@pytest.mark.parametrize("kind", ["dirichlet", "onehot", "equal", "disjoint"])
def test_accept_plus_residual_mass_is_the_target(kind):
    rng = np.random.default_rng(0)
    for _ in range(50):
        target = random_probs(rng, 6, "onehot" if kind == "onehot" else "dirichlet")
        draft = {"equal": target, "disjoint": np.roll(np.eye(6)[np.argmax(target)], 1)}.get(kind, random_probs(rng, 6))
        accept = draft * np.minimum(1.0, np.divide(target, draft, out=np.zeros(6), where=draft > 0))
        emitted = accept + (1 - accept.sum()) * residual(target, draft)
        assert np.allclose(emitted, target, atol=1e-12)
        assert np.isfinite(residual(target, target)).all()


def test_greedy_rule():
    assert verify_greedy(np.array([5, 6, 7, 8]), np.array([5, 6, 7])) == (3, 8)  # all kept, bonus
    assert verify_greedy(np.array([5, 9, 7, 8]), np.array([5, 6, 7])) == (1, 9)  # early mismatch
    assert verify_greedy(np.array([4, 6]), np.array([5])) == (0, 4)


# A context-dependent toy: first-token and second-token-given-first distributions for target and draft.
V = 3
TARGET_1 = np.array([0.5, 0.3, 0.2])
TARGET_2 = np.array([[0.1, 0.6, 0.3], [0.7, 0.2, 0.1], [0.3, 0.3, 0.4]])
DRAFT_1 = np.array([0.2, 0.2, 0.6])
DRAFT_2 = np.array([[0.4, 0.4, 0.2], [0.1, 0.1, 0.8], [0.6, 0.2, 0.2]])


def reject_from_target(target_probs, draft_probs, draft_tokens, uniform):
    """Accepts with min(1, p/q) but resamples from p itself on rejection (the classic bug)."""
    for k, token in enumerate(draft_tokens):
        if uniform(k, ACCEPT) * draft_probs[k, token] >= target_probs[k, token]:
            return k, sample(target_probs[k], uniform(k, EMIT))
    return len(draft_tokens), sample(target_probs[len(draft_tokens)], uniform(len(draft_tokens), EMIT))


def always_accept(target_probs, draft_probs, draft_tokens, uniform):
    return len(draft_tokens), sample(target_probs[len(draft_tokens)], uniform(len(draft_tokens), EMIT))


def first_two_tokens(verifier, samples: int, seed: int) -> np.ndarray:
    """Counts [V, V] of the first two emitted tokens when drafting two tokens per round."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V), dtype=np.int64)
    for _ in range(samples):
        d1 = rng.choice(V, p=DRAFT_1)
        d2 = rng.choice(V, p=DRAFT_2[d1])
        target_probs = np.stack([TARGET_1, TARGET_2[d1], np.full(V, 1 / V)])
        accepted, token = verifier(target_probs, np.stack([DRAFT_1, DRAFT_2[d1]]), np.array([d1, d2]),
                                   lambda k, purpose: rng.random())
        if accepted == 0:  # a new round would draft the second token given the first
            second = rng.choice(V, p=TARGET_2[token])
            counts[token, second] += 1
        elif accepted == 1:
            counts[d1, token] += 1
        else:
            counts[d1, d2] += 1
    return counts


def p_value(counts: np.ndarray) -> float:
    expected = (TARGET_1[:, None] * TARGET_2).ravel() * counts.sum()
    return scipy_stats.chisquare(counts.ravel(), expected).pvalue


def test_sampled_chain_matches_the_target_and_broken_rules_fail():
    samples = 40_000
    assert p_value(first_two_tokens(verify_sampled, samples, seed=1)) > 1e-3
    assert p_value(first_two_tokens(reject_from_target, samples, seed=2)) < 1e-6
    assert p_value(first_two_tokens(always_accept, samples, seed=3)) < 1e-6


TARGET_3 = np.random.default_rng(7).dirichlet(np.full(V, 0.7), size=(V, V))  # the third token given the first two


def bonus_from_the_last_draft_position(target_probs, draft_probs, draft_tokens, uniform):
    """Verifies correctly but draws the bonus token from the last draft's row instead of the row after it."""
    accepted, token = verify_sampled(target_probs, draft_probs, draft_tokens, uniform)
    if accepted == len(draft_tokens):
        token = sample(target_probs[accepted - 1], uniform(accepted, EMIT))
    return accepted, token


def first_three_tokens(verifier, samples: int, seed: int, rollback: bool = True) -> np.ndarray:
    """Counts [V, V, V] of the first three emitted tokens when each round drafts two; the tokens after a round come
    from the target alone given what was emitted, or, without `rollback`, given the drafts a rejection discarded
    (a cache that kept the rejected draft's row)."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V, V), dtype=np.int64)
    for _ in range(samples):
        d1 = rng.choice(V, p=DRAFT_1)
        d2 = rng.choice(V, p=DRAFT_2[d1])
        target_probs = np.stack([TARGET_1, TARGET_2[d1], TARGET_3[d1, d2]])
        accepted, token = verifier(target_probs, np.stack([DRAFT_1, DRAFT_2[d1]]), np.array([d1, d2]),
                                   lambda k, purpose: rng.random())
        emitted = [d1, d2][:accepted] + [token]
        context = emitted if rollback else [d1, d2][: len(emitted)]
        if len(emitted) == 1:
            emitted.append(rng.choice(V, p=TARGET_2[context[0]]))
            context = emitted if rollback else [context[0], emitted[1]]
        if len(emitted) == 2:
            emitted.append(rng.choice(V, p=TARGET_3[context[0], context[1]]))
        counts[tuple(emitted[:3])] += 1
    return counts


def test_three_tokens_match_the_target_and_a_wrong_bonus_or_rollback_fails():
    """Beyond the first two tokens: the bonus token's row and what follows a rejection."""
    expected = TARGET_1[:, None, None] * TARGET_2[:, :, None] * TARGET_3

    def p(counts):
        return scipy_stats.chisquare(counts.ravel(), expected.ravel() * counts.sum()).pvalue

    samples = 60_000
    assert p(first_three_tokens(verify_sampled, samples, seed=4)) > 1e-3
    assert p(first_three_tokens(bonus_from_the_last_draft_position, samples, seed=5)) < 1e-6
    assert p(first_three_tokens(verify_sampled, samples, seed=6, rollback=False)) < 1e-6


def test_truncation_rules_row_by_row_and_batched():
    from dspark_common.lossless import truncated_distribution
    from dspark_common.sampling import SamplingParams

    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    cases = [
        (dict(top_k=2), [0.4, 0.3, 0, 0]),
        (dict(top_p=0.6), [0.4, 0.3, 0, 0]),
        (dict(top_p=0.75), [0.4, 0.3, 0.2, 0]),
        (dict(min_p=0.5), [0.4, 0.3, 0.2, 0]),
        (dict(top_k=3, min_p=0.6), [0.4, 0.3, 0, 0]),
        ({}, [0.4, 0.3, 0.2, 0.1]),
    ]
    batch = np.stack([logits, logits[::-1], logits[[2, 0, 3, 1]]])
    for options, kept in cases:
        params = SamplingParams(temperature=1.0, **options)
        assert np.allclose(truncated_distribution(logits, params), np.array(kept) / sum(kept)), options
        rows = truncated_distribution(batch, params)
        assert np.allclose(rows, np.stack([truncated_distribution(row, params) for row in batch])), options
    sharp = truncated_distribution(logits, SamplingParams(temperature=0.5))
    assert np.allclose(sharp, np.array([16, 9, 4, 1]) / 30)


def test_top_p_after_top_k_ranks_the_kept_tokens_as_the_whole_vocabulary_would():
    """top-p is ranked among the top-k tokens only (fast at 151,936 tokens): the same bits as ranking all of them,
    ties at the k-th value included."""
    from dspark_common.lossless import softmax, truncated_distribution
    from dspark_common.sampling import SamplingParams

    def whole_vocabulary(logits, params):  # the nucleus over a full stable sort
        probs = softmax(logits, params.temperature)
        keep = probs >= np.partition(probs, -params.top_k)[-params.top_k]
        order = np.argsort(-probs, kind="stable")
        nucleus = np.zeros(len(probs), dtype=bool)
        nucleus[order] = np.cumsum(probs[order]) - probs[order] < params.top_p
        probs = np.where(keep & nucleus, probs, 0.0)
        return probs / probs.sum()

    rng = np.random.default_rng(0)
    for _ in range(50):
        logits = np.round(rng.standard_normal(300) * 2, 1).astype(np.float32)  # many ties
        params = SamplingParams(temperature=0.7, top_k=int(rng.integers(1, 40)), top_p=float(rng.uniform(0.3, 1)))
        assert np.array_equal(truncated_distribution(logits, params), whole_vocabulary(logits, params))


def test_keyed_uniforms_depend_on_seed_position_and_purpose_only():
    a, b = KeyedRandom(7), KeyedRandom(7)
    assert a.uniform(12, ACCEPT) == b.uniform(12, ACCEPT) != a.uniform(12, EMIT) != a.uniform(13, EMIT)
    assert a.uniform(12, ACCEPT) != KeyedRandom(8).uniform(12, ACCEPT)
    values = np.array([a.uniform(p, EMIT) for p in range(20_000)])
    assert 0 < values.min() and values.max() < 1 and scipy_stats.kstest(values, "uniform").pvalue > 1e-3
    assert np.array_equal(a.draft_noise(5, 3), [a.uniform(p, 2) for p in (5, 6, 7)])


def test_token_logprobs_read_the_processed_rows():
    from dspark_common.lossless import truncated_distribution
    from dspark_common.sampling import SamplingParams
    from dspark_runtime.logprobs import token_logprobs

    logits = np.array([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 1.0]])
    greedy = token_logprobs(logits, [0, 2], SamplingParams(temperature=0, logprobs=2))
    expected = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert [e.logprob for e in greedy] == pytest.approx([expected[0, 0], expected[1, 2]])
    assert [t for t, _ in greedy[1].top] == [1, 2]  # ties (tokens 2 and 3) go to the lower id
    params = SamplingParams(temperature=0.7, top_k=2, logprobs=3)
    probs = truncated_distribution(logits, params)
    sampled = token_logprobs(probs, [1, 1], params)
    assert sampled[0].logprob == pytest.approx(np.log(probs[0, 1]))
    assert [t for t, _ in sampled[0].top] == [0, 1]  # what top-k removed is no alternative
    assert token_logprobs(logits, [0], SamplingParams(temperature=0, logprobs=0))[0].top == ()


def first_two_tokens_with_free_drafts(verifier, samples: int, seed: int) -> np.ndarray:
    """Counts [V, V] of the first two emitted tokens when two drafts proposed with certainty (free drafts: the
    tokens 0 then 1, drawn from point masses) are verified each round."""
    rng = np.random.default_rng(seed)
    drafts = np.array([0, 1])
    counts = np.zeros((V, V), dtype=np.int64)
    for _ in range(samples):
        target_probs = np.stack([TARGET_1, TARGET_2[0], np.full(V, 1 / V)])
        accepted, token = verifier(target_probs, point_masses(drafts, V), drafts, lambda k, purpose: rng.random())
        if accepted == 0:
            counts[token, rng.choice(V, p=TARGET_2[token])] += 1
        elif accepted == 1:
            counts[0, token] += 1
        else:
            counts[0, 1] += 1
    return counts


def test_free_drafts_from_point_masses_keep_the_target_and_broken_rules_fail():
    samples = 40_000
    assert p_value(first_two_tokens_with_free_drafts(verify_sampled, samples, seed=4)) > 1e-3
    assert p_value(first_two_tokens_with_free_drafts(reject_from_target, samples, seed=5)) < 1e-6
    assert p_value(first_two_tokens_with_free_drafts(always_accept, samples, seed=6)) < 1e-6
