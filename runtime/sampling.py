"""Sampling parameters and the *processed* target distribution that verification must reproduce.

Processing order (as llama.cpp): repetition / presence / frequency penalties over the tokens so far,
then temperature, top-k, top-p, min-p. Temperature 0 is greedy: the argmax of the penalised logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dspark_runtime.errors import DSparkError


class InvalidRequestError(DSparkError):
    """A request that cannot run (bad sampling parameters, a prompt that does not fit)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens already present (HF / llama.cpp rule)
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every present token's logit
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be at least 1 (got {self.max_tokens})")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            problems.append(f"temperature must be >= 0 (got {self.temperature})")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (got {self.top_k})")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1] (got {self.top_p})")
        if not 0 <= self.min_p < 1:
            problems.append(f"min_p must be in [0, 1) (got {self.min_p})")
        if self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty must be > 0 (got {self.repetition_penalty})")
        if problems:
            raise InvalidRequestError("; ".join(problems))
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


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


def truncated_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """softmax(logits / T) restricted by top-k, top-p and min-p, along the last axis; float64 rows summing to 1."""
    scaled = logits.astype(np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    keep = np.ones(probs.shape, dtype=bool)
    if params.top_k and params.top_k < probs.shape[-1]:
        keep &= probs >= np.partition(probs, -params.top_k, axis=-1)[..., -params.top_k, None]
    if params.top_p < 1:
        order = np.argsort(-probs, axis=-1, kind="stable")
        ranked = np.take_along_axis(probs, order, -1)
        nucleus = np.zeros(probs.shape, dtype=bool)
        np.put_along_axis(nucleus, order, np.cumsum(ranked, -1) - ranked < params.top_p, -1)  # mass strictly above
        keep &= nucleus
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs.max(-1, keepdims=True)
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum(-1, keepdims=True)


def target_rows(logits: np.ndarray, history: np.ndarray, drafts: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Processed target rows for verification: row k sees history + drafts[:k] (penalties) -> [k+1, V].

    Greedy: the logits after penalties (the caller takes argmax). Sampling: float64 probabilities. Only
    penalties read `history`.
    """
    if params.penalised:
        logits = np.stack([penalise(logits[k], np.concatenate([history, drafts[:k]]), params) for k in range(len(logits))])
    return logits if params.greedy else truncated_distribution(logits, params)
