"""Drafter losses and the running acceptance estimate.

DSpark (paper Eq. 9-12): 0.1·CE + 0.9·L1(p_draft - p_target) + 1.0·BCE(c, 1 - TV), each term weighted
per position by exp(-j/4) (j = 0..γ-1) over valid positions and normalised by the weights. DFlash:
CE alone with the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    l1: float = 0.9
    bce: float = 1.0
    decay: float = 4.0  # position weight exp(-j / decay)


DSPARK_WEIGHTS = LossWeights()
DFLASH_WEIGHTS = LossWeights(ce=1.0, l1=0.0, bce=0.0, decay=4.0)


def position_weights(valid: torch.Tensor, decay: float) -> torch.Tensor:
    """valid [.., γ] -> exp(-j / decay) where valid, else 0."""
    j = torch.arange(valid.shape[-1], dtype=torch.float32)
    return torch.exp(-j / decay) * valid.float()


def total_variation(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """TV(p_draft, p_target) = ½‖p_draft - p_target‖₁ over the vocabulary, [.., γ]."""
    return 0.5 * (torch.softmax(draft_logits.float(), -1) - torch.softmax(target_logits.float(), -1)).abs().sum(-1)


def drafter_loss(
    draft_logits, target_logits, labels, valid, confidence_logits, weights: LossWeights
) -> dict[str, torch.Tensor]:
    """All terms of the drafter loss. Shapes: logits [.., γ, V], labels/valid/confidence [.., γ]."""
    w = position_weights(valid, weights.decay)
    norm = w.sum().clamp(min=1e-8)
    ce = F.cross_entropy(draft_logits.float().flatten(0, -2), labels.flatten(), reduction="none").view_as(w)
    tv = total_variation(draft_logits, target_logits)
    terms = {"ce": (ce * w).sum() / norm, "l1": (2 * tv * w).sum() / norm}
    total = weights.ce * terms["ce"] + weights.l1 * terms["l1"]
    if confidence_logits is not None and weights.bce:
        soft_target = (1 - tv).detach().clamp(0, 1)
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), soft_target, reduction="none")
        terms["bce"] = (bce * w).sum() / norm
        total = total + weights.bce * terms["bce"]
    terms["total"] = total
    terms["tau"] = expected_tau(tv.detach(), valid)
    return terms


def expected_tau(tv: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """1 + Σ_j Π_{i≤j}(1 - TV_i), averaged over blocks whose positions are all valid."""
    full = valid.all(-1)
    survival = torch.cumprod(1 - tv, -1).sum(-1) + 1
    return survival[full].mean() if full.any() else survival.new_tensor(float("nan"))
