"""Offline drafter evaluation: real chain drafting and the real lossless acceptance rule, with the torch
target generating the continuation of each held-out prompt.

Per round: the drafter proposes γ tokens from the anchor (the newest committed token) and the target's
features of every earlier position; the target scores [anchor, drafts] in one cached forward; the
verifier (`dspark_common.lossless.verify`, the step loop's own: penalties, temperature, top-k/p, min-p and every
branch) keeps a prefix and emits one more token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dspark_calibration.metrics import auc, ece
from dspark_export.drafters.block_drafter import block_draft
from dspark_export.drafters.eagle3 import eagle3_draft
from dspark_export.model import DecoderModel
from dspark_common.lossless import verify
from dspark_common.sampling import SamplingParams


@dataclass
class RoundRecord:
    accepted: int  # drafts kept
    drafted: int  # drafts proposed (γ)
    confidence: list[float]  # the drafter's per-position confidences
    acceptance: list[float]  # each draft's true conditional acceptance probability (1 - TV; 0/1 when greedy)


@dataclass
class Generation:
    tokens: list[int]
    rounds: list[RoundRecord] = field(default_factory=list)


@torch.no_grad()
def speculative_generate(target: DecoderModel, drafter, prompt: list[int], params: SamplingParams, seed: int,
                         stop_ids: tuple[int, ...] = (), draft_fn=None) -> Generation:
    """Generate up to `params.max_tokens` tokens after `prompt` by drafting and verifying; returns tokens and rounds.

    `draft_fn(drafter, committed, features, temperature, noise) -> Draft` defaults to the drafter type's own.
    """
    config = drafter.config
    draft_fn = draft_fn or (eagle3_draft if config.drafter_type == "eagle3" else block_draft)
    rng = np.random.default_rng(seed)
    noise_gen = torch.Generator().manual_seed(seed)
    target.setup_caches(1, len(prompt) + params.max_tokens + config.gamma + 1)
    # prefill the prompt and sample the first token from the target alone; it becomes the first anchor
    length = len(prompt)
    out = target(torch.tensor([prompt]), torch.arange(length)[None], config.feature_layers, use_cache=True)
    features = torch.cat([out.features[layer] for layer in config.feature_layers], -1)
    first = verified(out.logits[0, -1:], np.zeros(0, np.int64), None, np.asarray(prompt), params, rng).token
    committed = torch.tensor([prompt + [first]])
    result = Generation([first])
    if first in stop_ids:
        return result
    while len(result.tokens) < params.max_tokens:
        noise = torch.rand(1, config.gamma, generator=noise_gen).clamp_(1e-12, 1 - 1e-7)
        draft = draft_fn(drafter, committed, features, params.temperature, noise)
        candidates = torch.cat([committed[:, -1:], draft.tokens], 1)
        step = target(
            candidates, torch.arange(length, length + config.gamma + 1)[None], config.feature_layers, use_cache=True
        )
        drafts, proposed = draft.tokens[0].numpy(), draft.probs[0].double().numpy()
        verdict = verified(step.logits[0], drafts, proposed, committed[0].numpy(), params, rng)
        new = drafts[: verdict.accepted].tolist() + [verdict.token]
        result.rounds.append(RoundRecord(verdict.accepted, config.gamma, draft.confidence[0].tolist(),
                                         acceptance_probabilities(verdict.rows, drafts, proposed, params.greedy)))
        step_features = torch.cat([step.features[layer] for layer in config.feature_layers], -1)
        features = torch.cat([features, step_features[:, : verdict.accepted + 1]], 1)
        committed = torch.cat([committed, torch.tensor([new])], 1)
        length += verdict.accepted + 1
        for t in new:
            result.tokens.append(t)
            if t in stop_ids or len(result.tokens) >= params.max_tokens:
                return result
    return result


def verified(logits: torch.Tensor, drafts: np.ndarray, proposed: np.ndarray | None, history: np.ndarray,
             params: SamplingParams, rng: np.random.Generator):
    """The step loop's lossless rule on the target's logits for one request's drafts (uniforms from `rng`)."""
    return verify(logits.float().numpy(), drafts, proposed, history, params, lambda k, purpose: rng.random())


def acceptance_probabilities(rows: np.ndarray, drafts: np.ndarray, proposed: np.ndarray, greedy: bool) -> list[float]:
    """P(draft k accepted | drafts before it accepted), from the processed target rows: Σ_x min(p_k, q_k) =
    1 - TV(p_k, q_k) when sampling, and whether it equals the target's argmax when greedy. The best any confidence
    head could predict."""
    rows = rows[: len(drafts)]
    if greedy:
        return (rows.argmax(-1) == drafts).astype(float).tolist()
    return np.clip(1 - 0.5 * np.abs(rows - proposed).sum(-1), 0, 1).tolist()


def summarize(rounds: list[RoundRecord], gamma: int) -> dict:
    """τ, per-position conditional acceptance, and calibration of the cumulative confidences."""
    accepted = np.array([r.accepted for r in rounds])
    reached = np.array([(accepted >= k).sum() for k in range(gamma)])
    passed = np.array([(accepted > k).sum() for k in range(gamma)])
    conditional = np.divide(passed, reached, out=np.full(gamma, np.nan), where=reached > 0)
    confidence = np.array([r.confidence for r in rounds])  # [rounds, γ]
    survival = np.cumprod(confidence, 1)  # a_k = Π_{i≤k} c_i
    oracle = np.cumprod(np.array([r.acceptance for r in rounds]), 1)  # the true prefix-survival probability
    prefix = accepted[:, None] > np.arange(gamma)[None]  # realised: positions 0..k all accepted
    return {
        "rounds": len(rounds),
        "tau": float(1 + accepted.mean()) if len(rounds) else float("nan"),
        "first_position_acceptance": float(conditional[0]),
        "per_position_acceptance": [round(float(x), 4) for x in conditional],
        "ece": [round(ece(survival[:, k], prefix[:, k]), 4) for k in range(gamma)],
        "auc": [round(auc(survival[:, k], prefix[:, k]), 4) for k in range(gamma)],
        "auc_oracle": [round(auc(oracle[:, k], prefix[:, k]), 4) for k in range(gamma)],  # the ceiling for "auc"
    }


def evaluate(target: DecoderModel, drafter, prompts: list[dict], tokenizer, params: SamplingParams, seed: int = 0,
             progress=None) -> dict:
    """Run every prompt through speculative generation; τ overall and per domain, acceptance, calibration."""
    stop_ids = tuple(tokenizer.eos_token_ids)
    by_domain: dict[str, list[RoundRecord]] = {}
    for index, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt["prompt"])
        generation = speculative_generate(target, drafter, ids, params, seed + index, stop_ids)
        by_domain.setdefault(prompt.get("domain", "all"), []).extend(generation.rounds)
        if progress:
            progress()
    gamma = drafter.config.gamma
    every = [r for rounds in by_domain.values() for r in rounds]
    result = {"gamma": gamma, "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}
    result |= summarize(every, gamma)
    result["per_domain"] = {domain: summarize(rounds, gamma) for domain, rounds in by_domain.items()}
    result["tau_macro"] = float(np.mean([d["tau"] for d in result["per_domain"].values()]))
    return result


def plot_acceptance(results: list[dict], file) -> None:
    """Per-position conditional acceptance of several drafters side by side (one PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for result in results:
        curve = result["per_position_acceptance"]
        axis.plot(range(1, len(curve) + 1), curve, marker="o", label=f"{result['drafter']} (τ={result['tau']:.2f})")
    axis.set_xlabel("draft position k")
    axis.set_ylabel("P(accept k | accepted 1..k-1)")
    axis.set_ylim(0, 1)
    axis.set_title(f"conditional acceptance, T={results[0]['temperature']}")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(file)
    plt.close(figure)
