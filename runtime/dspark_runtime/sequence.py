"""One request inside the engine: its tokens, cache bookkeeping, drafts, output text and statistics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from dspark_common.randomness import KeyedRandom
from dspark_common.sampling import SamplingParams
from dspark_runtime.logprobs import TokenLogprob
from dspark_runtime.ngram import FreeDraftAcceptance, NgramIndex
from dspark_runtime.scheduler import Probes
from dspark_runtime.spec_mode import SpecMode


@dataclass
class Stats:
    steps: int = 0  # target steps in which this request produced tokens
    rounds: int = 0  # verification rounds with at least one draft
    drafted: int = 0  # draft tokens proposed (by the drafter, γ per call, or free)
    verified: int = 0  # of them, sent to the target
    accepted: int = 0
    free_accepted: int = 0  # of `accepted`, free drafts (`dspark_runtime.ngram`)
    started: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None

    def summary(self, generated: int) -> "RequestStats":
        ttft = None if self.first_token is None else self.first_token - self.started
        decode_time = None if self.first_token is None or self.finished is None else self.finished - self.first_token
        return RequestStats(
            tau=generated / self.steps if self.steps else 0.0,
            steps=self.steps,
            rounds=self.rounds,
            accepted_per_step=self.accepted / self.rounds if self.rounds else 0.0,
            acceptance_rate=self.accepted / self.verified if self.verified else 0.0,
            drafted=self.drafted,
            verified=self.verified,
            accepted=self.accepted,
            free_drafts_accepted=self.free_accepted,
            tokens_per_s=(generated - 1) / decode_time if decode_time and generated > 1 else 0.0,
            ttft_s=ttft,
        )


@dataclass(frozen=True)
class RequestStats:
    """A finished request's figures."""

    tau: float  # tokens per target step
    steps: int  # target steps that gave it tokens
    rounds: int  # verification rounds with at least one draft
    accepted_per_step: float  # drafts accepted per round
    acceptance_rate: float  # drafts accepted per draft verified
    drafted: int  # draft tokens proposed (by the drafter or free)
    verified: int  # of them, verified by the target
    accepted: int  # of them, accepted
    free_drafts_accepted: int  # accepted drafts that were free (`dspark_runtime.ngram`), not the drafter's
    tokens_per_s: float  # after the first token
    ttft_s: float | None  # seconds to the first token


NO_TOKENS = np.zeros(0, dtype=np.int64)


@dataclass
class Sequence:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    spec: SpecMode
    random: KeyedRandom  # the request's uniforms, by position
    stop_ids: frozenset[int] = frozenset()  # tokens that end the request: end-of-text (unless ignored), stop_token_ids
    slot: int = -1
    prefilled: int = 0  # prompt positions already run through the target
    target_len: int = 0  # positions committed in the target cache
    drafter_len: int = 0  # positions committed in the drafter cache
    pending_features: list[np.ndarray] = field(default_factory=list)  # positions drafter_len..target_len-1
    anchor: int | None = None  # newest token, at position target_len, not yet run through the target
    drafts: np.ndarray | None = None  # [γ] proposed after the anchor
    draft_probs: np.ndarray | None = None  # [γ, V]
    confidence_logits: np.ndarray | None = None  # [γ]
    survival: np.ndarray | None = None  # [γ] calibrated prefix survival of the latest drafts (kept while not drafting)
    probes: Probes = field(default_factory=Probes)  # when the draft gate looks again (sync/async)
    free: bool = False  # `drafts` are free drafts (`dspark_runtime.ngram`), not the drafter's
    free_acceptance: FreeDraftAcceptance = field(default_factory=FreeDraftAcceptance)
    ngrams: NgramIndex | None = None  # prompt and generated tokens, indexed for free drafts (sync/async)
    generated: list[int] = field(default_factory=list)
    visible: int = 0  # of the generated tokens, those a reader sees (all but an end or stop token)
    from_draft: list[bool] = field(default_factory=list)  # per generated token: an accepted draft's (else the target's)
    verifications: list[tuple[int, int, int]] = field(default_factory=list)  # per decoding step: drafts proposed,
    # verified by the target, accepted
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, when params.logprobs
    finish_reason: str | None = None  # set by the step loop alone (EngineCore.finish)
    error: Exception | None = None  # why a request finished with "error"
    cancelled: bool = False  # set by the step loop (EngineCore.cancel)
    stats: Stats = field(default_factory=Stats)

    @property
    def decoding(self) -> bool:
        return self.anchor is not None

    def tokens_at(self, start: int, stop: int) -> list[int]:
        """The tokens at positions start..stop-1 (prompt, then generated) without building the whole history."""
        offset = len(self.prompt)
        return self.prompt[start:stop] + self.generated[max(0, start - offset) : max(0, stop - offset)]

    @property
    def penalty_history(self) -> np.ndarray:
        """Every token so far (prompt and generated, the anchor included) when a penalty reads them, else empty
        (building it costs O(context) per step)."""
        return np.asarray(self.prompt + self.generated, dtype=np.int64) if self.params.penalised else NO_TOKENS
