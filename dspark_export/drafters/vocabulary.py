"""A drafter's draft vocabulary: by default the target's; or a subset of it (EAGLE-3 and speculators drafters
draft over their most frequent tokens), with `d2t` mapping draft id d to target id d + d2t[d]."""

from __future__ import annotations

import torch
from torch import nn

from dspark_export.drafters.config import DrafterConfig


class DraftVocabulary(nn.Module):
    """Mixin of both drafter kinds: the `d2t` buffer and the maps between the two vocabularies."""

    config: DrafterConfig

    def init_vocabulary(self) -> None:
        if self.config.draft_vocab_size is not None:
            self.register_buffer("d2t", torch.zeros(self.config.draft_vocab_size, dtype=torch.long))

    def draft_from(self, target_ids: torch.Tensor, target_lm_head: torch.Tensor) -> None:
        """Draft over `target_ids` (ascending): `d2t` maps them, the LM head is the target's rows for them."""
        self.d2t.copy_(target_ids - torch.arange(len(target_ids)))
        self.lm_head.weight.data.copy_(target_lm_head[target_ids])

    def target_ids(self) -> torch.Tensor | None:
        """The target id of every draft-vocabulary id (None: the draft vocabulary is the target's)."""
        if self.config.draft_vocab_size is None:
            return None
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def in_target_vocab(self, scores: torch.Tensor, fill: float) -> torch.Tensor:
        """Draft-vocabulary scores [.., V'] on the target's vocabulary [.., V], `fill` where the draft has none."""
        ids = self.target_ids()
        if ids is None:
            return scores
        full = scores.new_full((*scores.shape[:-1], self.config.target["vocab_size"]), fill)
        return full.index_copy(-1, ids, scores)
