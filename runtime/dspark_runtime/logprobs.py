"""The emitted tokens' log-probabilities, read from the processed rows verification already has."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark_common.sampling import SamplingParams


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
