"""Lossless verification, in one place: from a request's target logits at the verified positions, its drafts and
the distributions they were drawn from, its token history, its sampling parameters and its uniforms, to the drafts
kept, the token emitted after them and the processed rows (`verify`). The step loop and offline evaluation both
call it.

The processed target distribution (as llama.cpp orders it): repetition / presence / frequency penalties over the
tokens so far, then temperature, top-k, top-p, min-p; temperature 0 is greedy, the argmax of the penalised logits.

Chain rejection sampling (Leviathan et al. 2023; Chen et al. 2023): draft token x_k, sampled from the draft
distribution q_k, is accepted with probability min(1, p_k(x_k) / q_k(x_k)), where p_k is the target's processed
distribution at that position. At the first rejection the emitted token is drawn from the residual
norm(max(0, p_k - q_k)); when every draft passes, a bonus token is drawn from p_{ℓ+1}. The emitted sequence then has
exactly the target's distribution, whatever q is. Randomness comes in as `uniform(k, purpose)`: the uniform deciding
offset k (the emitted token's position less the first verified one) for ACCEPT or EMIT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from dspark_common.randomness import ACCEPT, EMIT
from dspark_common.sampling import SamplingParams

Uniform = Callable[[int, int], float]  # (offset among the verified positions, purpose) -> a uniform in (0, 1)


def sample(probs: np.ndarray, u: float) -> int:
    """One token from a probability vector, by inverse CDF at the uniform u."""
    cdf = np.cumsum(probs, dtype=np.float64)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(probs) - 1))


def residual(target_probs: np.ndarray, draft_probs: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)); when p == q (no residual mass) the target itself, never NaN."""
    mass = np.maximum(target_probs.astype(np.float64) - draft_probs, 0.0)
    total = mass.sum()
    return mass / total if total > 0 else target_probs.astype(np.float64) / target_probs.sum()


def verify_sampled(target_probs: np.ndarray, draft_probs: np.ndarray, draft_tokens: np.ndarray,
                   uniform: Uniform) -> tuple[int, int]:
    """Chain rejection sampling.

    Args:
        target_probs: [ℓ+1, V] processed target distributions at the ℓ draft positions and the bonus position.
        draft_probs: [ℓ, V] the distributions the drafts were sampled from.
        draft_tokens: [ℓ] the drafts.
        uniform: the request's uniforms, by offset and purpose.
    Returns:
        (accepted, token): how many drafts are kept, and the token emitted after them.
    """
    for k, token in enumerate(draft_tokens):
        p, q = float(target_probs[k, token]), float(draft_probs[k, token])
        if q <= 0.0 or uniform(k, ACCEPT) * q >= p:  # accept with probability min(1, p / q)
            return k, sample(residual(target_probs[k], draft_probs[k]), uniform(k, EMIT))
    return len(draft_tokens), sample(target_probs[len(draft_tokens)], uniform(len(draft_tokens), EMIT))


def point_masses(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """[ℓ, V] distributions each certain of its token: what a draft proposed without sampling was drawn from."""
    masses = np.zeros((len(tokens), vocab_size), dtype=np.float32)
    masses[np.arange(len(tokens)), tokens] = 1.0
    return masses


def verify_greedy(target_tokens: np.ndarray, draft_tokens: np.ndarray) -> tuple[int, int]:
    """Greedy: keep the drafts that equal the target's argmax; emit the target's token at the first mismatch.

    target_tokens: [ℓ+1] the target's argmax at each position (lowest index on ties).
    """
    if not len(draft_tokens):
        return 0, int(target_tokens[0])
    mismatches = np.flatnonzero(np.asarray(target_tokens[: len(draft_tokens)]) != np.asarray(draft_tokens))
    accepted = int(mismatches[0]) if len(mismatches) else len(draft_tokens)
    return accepted, int(target_tokens[accepted])


def penalise(logits: np.ndarray, history: np.ndarray, params: SamplingParams) -> np.ndarray:
    """One row of logits [V] after the penalties for the tokens in `history`."""
    if not params.penalised or len(history) == 0:
        return logits
    out = logits.astype(np.float64).copy()
    tokens, counts = np.unique(history, return_counts=True)
    if params.repetition_penalty != 1:
        values = out[tokens]
        out[tokens] = np.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    out[tokens] -= params.presence_penalty + params.frequency_penalty * counts
    return out


def _exponentials(logits: np.ndarray, temperature: float) -> np.ndarray:
    """e^(logits / T less their maximum) along the last axis, in float32 (SIMD)."""
    scaled = logits.astype(np.float32) / np.float32(temperature)
    scaled -= scaled.max(-1, keepdims=True)
    return np.exp(scaled, out=scaled)


def _normalized(exponentials: np.ndarray) -> np.ndarray:
    """float64 rows summing to 1, in proportion to `exponentials`."""
    probs = exponentials.astype(np.float64)
    probs /= probs.sum(-1, keepdims=True)
    return probs


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    """softmax(logits / T) along the last axis, float64 rows summing to 1. The exponentials are float32's (SIMD:
    four rows of 151,936 tokens cost 1.5 ms, float64's 4.4 ms; the probabilities differ by float32's rounding)."""
    return _normalized(_exponentials(logits, temperature))


def truncated_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """softmax(logits / T) restricted by top-k, top-p and min-p, along the last axis; float64 rows summing to 1.

    Each rule works on the tokens the rules before it kept: top-k finds its k-th largest exponential (float32's
    order and ties are the probabilities' own), top-p ranks only the kept tokens (every token ranked above a kept
    one is kept too, so the sums are those of ranking the whole vocabulary)."""
    exponentials = _exponentials(logits, params.temperature)
    probs = _normalized(exponentials)
    top_k = bool(params.top_k) and params.top_k < probs.shape[-1]
    if not top_k and params.top_p >= 1 and params.min_p <= 0:
        return probs
    kept_probs = np.zeros(probs.shape)  # zero pages: only the kept tokens' are written
    for row in np.ndindex(probs.shape[:-1]):
        row_probs = probs[row]
        if top_k:
            row_exponentials = exponentials[row]
            kth = np.partition(row_exponentials, -params.top_k)[-params.top_k]
            kept = np.flatnonzero(row_exponentials >= kth)
        else:
            kept = np.arange(len(row_probs))
        if params.top_p < 1:
            order = kept[np.argsort(-row_probs[kept], kind="stable")]
            ranked = row_probs[order]
            kept = order[np.cumsum(ranked) - ranked < params.top_p]  # the mass strictly above
        if params.min_p > 0:
            kept = kept[row_probs[kept] >= params.min_p * row_probs.max()]
        row_kept = kept_probs[row]
        row_kept[kept] = row_probs[kept]
        row_kept[kept] /= row_kept.sum()  # over the whole row, zeros too: the sum a dense row gives
    return kept_probs


def target_rows(logits: np.ndarray, history: np.ndarray, drafts: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Processed target rows for verification: row k sees history + drafts[:k] (penalties) -> [k+1, V].

    Greedy: the logits after penalties (the caller takes argmax). Sampling: float64 probabilities. Only
    penalties read `history`.
    """
    if params.penalised:
        logits = np.stack(
            [penalise(logits[k], np.concatenate([history, drafts[:k]]), params) for k in range(len(logits))]
        )
    return logits if params.greedy else truncated_distribution(logits, params)


@dataclass(frozen=True)
class Verdict:
    """What verification decided for one request's row of a step."""

    accepted: int  # drafts kept
    token: int  # the token emitted after them
    rows: np.ndarray  # [ℓ+1, V] processed target rows: penalised logits when greedy, else probabilities


def verify(logits: np.ndarray, drafts: np.ndarray, proposed: np.ndarray | None, history: np.ndarray,
           params: SamplingParams, uniform: Uniform) -> Verdict:
    """The lossless rule for one request: `logits` [ℓ+1, V] at the newest token and the ℓ `drafts`, `proposed` [ℓ, V]
    the distributions the drafts were drawn from (unused when greedy; `point_masses` for drafts proposed without
    sampling), `history` the tokens before the drafts (read by penalties only). Greedy keeps the drafts equal to the
    target's argmax; sampling draws a plain step's token or runs chain rejection sampling."""
    rows = target_rows(logits, history, drafts, params)
    if params.greedy:
        accepted, token = verify_greedy(rows.argmax(-1), drafts)
    elif not len(drafts):
        accepted, token = 0, sample(rows[0], uniform(0, EMIT))
    else:
        accepted, token = verify_sampled(rows, proposed, drafts, uniform)
    return Verdict(accepted, token, rows)
