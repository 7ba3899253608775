"""Offline drafter evaluation: real chain drafting and the real lossless acceptance rule, with the torch
target generating the continuation of each held-out prompt.

Per round: the drafter proposes γ tokens from the anchor (the newest committed token) and the target's
features of every earlier position; the target scores [anchor, drafts] in one cached forward; the
verifier (`dspark_runtime.verify`, the runtime's own) keeps a prefix and emits one more token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dspark_calibration.metrics import auc, ece
from dspark_export.drafters.block import block_draft
from dspark_export.drafters.eagle3 import eagle3_draft
from dspark_export.model import Qwen3Model
from dspark_runtime.verify import verify_greedy, verify_sampled


@dataclass
class RoundRecord:
    accepted: int  # drafts kept
    drafted: int  # drafts proposed (γ)
    confidence: list[float]  # the drafter's per-position confidences


@dataclass
class Generation:
    tokens: list[int]
    rounds: list[RoundRecord] = field(default_factory=list)


@torch.no_grad()
def speculative_generate(target: Qwen3Model, drafter, prompt: list[int], max_new: int, temperature: float,
                         seed: int, stop_ids: tuple[int, ...] = (), draft_fn=None) -> Generation:
    """Generate up to `max_new` tokens after `prompt` by drafting and verifying; returns tokens and rounds.

    `draft_fn(drafter, committed, features, temperature, noise) -> Draft` defaults to the drafter type's own.
    """
    config = drafter.config
    draft_fn = draft_fn or (eagle3_draft if config.drafter_type == "eagle3" else block_draft)
    rng = np.random.default_rng(seed)
    noise_gen = torch.Generator().manual_seed(seed)
    target.setup_caches(1, len(prompt) + max_new + config.block + 1)
    committed = torch.tensor([prompt])
    length = len(prompt) - 1  # positions 0..length-1 go through the target now; the last prompt token is the anchor
    out = target(committed[:, :length], torch.arange(length)[None], config.feature_layers, use_cache=True, logits=False)
    features = torch.cat([out.features[layer] for layer in config.feature_layers], -1)
    result = Generation([])
    while len(result.tokens) < max_new:
        noise = torch.rand(1, config.block, generator=noise_gen).clamp_(1e-12, 1 - 1e-7)
        draft = draft_fn(drafter, committed, features, temperature, noise)
        block = torch.cat([committed[:, -1:], draft.tokens], 1)
        verify = target(block, torch.arange(length, length + config.block + 1)[None], config.feature_layers, use_cache=True)
        logits = verify.logits[0].float()
        drafts = draft.tokens[0].numpy()
        if temperature == 0:
            accepted, token = verify_greedy(logits.argmax(-1).numpy(), drafts)
        else:
            target_probs = torch.softmax(logits / temperature, -1).double().numpy()
            accepted, token = verify_sampled(target_probs, draft.probs[0].double().numpy(), drafts, rng)
        new = drafts[:accepted].tolist() + [token]
        result.rounds.append(RoundRecord(accepted, config.block, draft.confidence[0].tolist()))
        step_features = torch.cat([verify.features[layer] for layer in config.feature_layers], -1)
        features = torch.cat([features, step_features[:, : accepted + 1]], 1)
        committed = torch.cat([committed, torch.tensor([new])], 1)
        length += accepted + 1
        for t in new:
            result.tokens.append(t)
            if t in stop_ids or len(result.tokens) >= max_new:
                return result
    return result


def summarize(rounds: list[RoundRecord], block: int) -> dict:
    """τ, per-position conditional acceptance, and calibration of the cumulative confidences."""
    accepted = np.array([r.accepted for r in rounds])
    reached = np.array([(accepted >= k).sum() for k in range(block)])
    passed = np.array([(accepted > k).sum() for k in range(block)])
    conditional = np.divide(passed, reached, out=np.full(block, np.nan), where=reached > 0)
    confidence = np.array([r.confidence for r in rounds])  # [rounds, γ]
    survival = np.cumprod(confidence, 1)  # a_k = Π_{i≤k} c_i
    prefix = accepted[:, None] > np.arange(block)[None]  # realised: positions 0..k all accepted
    return {
        "rounds": len(rounds),
        "tau": float(1 + accepted.mean()) if len(rounds) else float("nan"),
        "first_position_acceptance": float(conditional[0]),
        "per_position_acceptance": [round(float(x), 4) for x in conditional],
        "ece": [round(ece(survival[:, k], prefix[:, k]), 4) for k in range(block)],
        "auc": [round(auc(survival[:, k], prefix[:, k]), 4) for k in range(block)],
    }
