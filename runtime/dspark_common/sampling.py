"""A request's sampling parameters, validated once: what the processed target distribution
(`dspark_common.lossless`) is made from, and the request's limits (tokens, stops, log-probabilities)."""

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
