"""Sampling parameters and the *processed* target distribution that verification must reproduce.

Processing order (as llama.cpp): repetition / presence / frequency penalties over the tokens so far,
then temperature, top-k, top-p, min-p. Temperature 0 is greedy: the argmax of the penalised logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dspark_common.errors import InvalidRequestError


TEMPERATURE_FLOOR = 1e-5  # a positive temperature below this samples greedily (float32 cannot divide by it)
LIMIT = (1 << 31) - 1  # the largest max_tokens, top_k or token id a request may give
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI allows


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, validated on construction: every field of the wrong type, not finite or
    out of range is named in one `InvalidRequestError`. A temperature above 0 but below `TEMPERATURE_FLOOR`
    is greedy (temperature 0)."""

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
    logprobs: int | None = None  # the emitted tokens' log-probabilities, with this many alternatives (None: off)

    def __post_init__(self) -> None:
        problems: list[str] = []
        check = _Checker(self, problems)
        check.integer("max_tokens", 1, LIMIT)
        check.number("temperature", 0.0, None)
        check.integer("top_k", 0, LIMIT)
        check.number("top_p", 0.0, 1.0, low_open=True)
        check.number("min_p", 0.0, 1.0, high_open=True)
        check.number("repetition_penalty", 0.0, None, low_open=True)
        check.number("presence_penalty", None, None)
        check.number("frequency_penalty", None, None)
        if self.seed is not None:
            check.integer("seed", 0, (1 << 63) - 1)
        if self.logprobs is not None:
            check.integer("logprobs", 0, MAX_LOGPROBS)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            problems.append("stop must be a string or a list of non-empty strings")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_integer(t) and 0 <= t <= LIMIT for t in ids):
            problems.append("stop_token_ids must be a list of non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            problems.append("ignore_eos must be true or false")
        if problems:
            raise InvalidRequestError("; ".join(problems))
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        if self.temperature < TEMPERATURE_FLOOR:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def _is_integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class _Checker:
    """Validates the fields of `params` one by one, collecting problems, and stores numbers as int or float."""

    def __init__(self, params: SamplingParams, problems: list[str]):
        self.params, self.problems = params, problems

    def integer(self, name: str, low: int, high: int) -> None:
        value = getattr(self.params, name)
        if not _is_integer(value):
            self.problems.append(f"{name} must be an integer (got {_shown(value)})")
        elif not low <= value <= high:
            self.problems.append(f"{name} must be in [{low}, {high}] (got {_shown(value)})")
        else:
            object.__setattr__(self.params, name, int(value))

    def number(
        self, name: str, low: float | None, high: float | None, low_open: bool = False, high_open: bool = False
    ) -> None:
        value = getattr(self.params, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float, np.integer, np.floating))
            or not np.isfinite(value)
        ):
            self.problems.append(f"{name} must be a finite number (got {_shown(value)})")
            return
        below = low is not None and (value <= low if low_open else value < low)
        above = high is not None and (value >= high if high_open else value > high)
        if below or above:
            low_text = "(-inf" if low is None else f"{'(' if low_open else '['}{low:g}"
            high_text = "inf)" if high is None else f"{high:g}{')' if high_open else ']'}"
            self.problems.append(f"{name} must be in {low_text}, {high_text} (got {_shown(value)})")
        else:
            object.__setattr__(self.params, name, float(value))


def _shown(value) -> str:
    if _is_integer(value) and abs(value) > 10**30:
        return f"an integer of {int(value).bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
        logits = np.stack(
            [penalise(logits[k], np.concatenate([history, drafts[:k]]), params) for k in range(len(logits))]
        )
    return logits if params.greedy else truncated_distribution(logits, params)


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the processed target distribution at its position, and the
    `top` most likely tokens there (token id, log-probability), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(rows: np.ndarray, tokens: list[int], params: SamplingParams) -> list[TokenLogprob]:
    """Each token's entry from the processed row it was emitted at (`target_rows`' output: penalised logits when
    greedy, whose softmax is the distribution at temperature 1; else the probabilities sampled from). Tokens
    that truncation removed have no entry among the alternatives (their log-probability is -inf)."""
    rows = rows[: len(tokens)].astype(np.float64)
    if params.greedy:
        shifted = rows - rows.max(-1, keepdims=True)
        logs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    else:
        with np.errstate(divide="ignore"):
            logs = np.log(rows)
    entries = []
    for row, token in zip(logs, tokens):
        top = np.argpartition(-row, params.logprobs - 1)[: params.logprobs] if params.logprobs else []
        top = sorted(top, key=lambda t: (-row[t], t))
        entries.append(TokenLogprob(int(token), float(row[token]),
                                    tuple((int(t), float(row[t])) for t in top if np.isfinite(row[t]))))
    return entries
