"""Training layout of many anchor blocks per sequence: anchors, block inputs, labels and the block mask.

Block b of a sequence starts at anchor position a_b: inputs [x_a, MASK x (γ-1)] at positions a..a+γ-1,
labels x_{a+1}..x_{a+γ}, teacher-forced previous tokens x_a..x_{a+γ-1}. A block query sees context
positions strictly before its anchor (the anchor's own target features do not exist yet at inference),
every slot of its own block, and nothing of other blocks. In the 1+γ layout (`lead` = 1) the block has
one more row, [x_a, MASK x γ] at a..a+γ: row 0 drafts nothing (its previous token is x_a too) and row j
drafts x_{a+j}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AnchorBlocks:
    anchors: torch.Tensor  # [B, n]
    input_ids: torch.Tensor  # [B, n, N]   anchor then MASK (N = lead + γ rows)
    positions: torch.Tensor  # [B, n, N]   a + j
    previous: torch.Tensor  # [B, n, N]   x_{a + max(j - lead, 0)} (teacher forcing)
    labels: torch.Tensor  # [B, n, γ]   x_{a+k+1} for draft k
    valid: torch.Tensor  # [B, n, γ]   label exists and is supervised, and so are all before it


def sample_anchors(
    lengths: torch.Tensor, supervised_from: torch.Tensor, count: int, generator: torch.Generator
) -> torch.Tensor:
    """`count` sorted anchors per sequence with a supervised first label: max(1, s-1) <= a <= len-2."""
    anchors = []
    for length, first in zip(lengths.tolist(), supervised_from.tolist()):
        low, high = max(1, first - 1), length - 2
        if high < low:
            raise ValueError(f"a sequence of {length} tokens supervised from {first} has no anchor")
        span = high - low + 1
        if span >= count:
            picks = torch.randperm(span, generator=generator)[:count]
        else:
            picks = torch.randint(0, span, (count,), generator=generator)
        anchors.append((picks + low).sort().values)
    return torch.stack(anchors)


def build_blocks(tokens: torch.Tensor, lengths: torch.Tensor, supervised_from: torch.Tensor, anchors: torch.Tensor,
                 gamma: int, mask_token_id: int, lead: int = 0) -> AnchorBlocks:
    """tokens [B, T] (padded), anchors [B, n] -> the block tensors of `AnchorBlocks`."""
    batch, length = tokens.shape
    rows = torch.arange(gamma + lead)
    positions = anchors[..., None] + rows  # [B, n, N]
    label_positions = anchors[..., None] + torch.arange(1, gamma + 1)  # [B, n, γ]
    gather = lambda index: torch.gather(tokens, 1, index.clamp(max=length - 1).flatten(1)).view_as(index)  # noqa: E731
    supervised = (label_positions < lengths[:, None, None]) & (label_positions >= supervised_from[:, None, None])
    input_ids = torch.full_like(positions, mask_token_id)
    input_ids[..., 0] = gather(anchors)
    return AnchorBlocks(
        anchors=anchors,
        input_ids=input_ids,
        positions=positions,
        previous=gather(anchors[..., None] + (rows - lead).clamp(min=0)),
        labels=gather(label_positions),
        valid=supervised.cumprod(-1).bool(),
    )


def block_mask(anchors: torch.Tensor, context_length: int, rows: int) -> torch.Tensor:
    """[B, 1, n·N, S + n·N] attention mask (N rows per block): context keys before the query's anchor, then its
    own block."""
    batch, count = anchors.shape
    query_anchor = anchors.repeat_interleave(rows, dim=1)  # [B, n·N]
    context = torch.arange(context_length)[None, None, :] < query_anchor[:, :, None]
    block_id = torch.arange(count).repeat_interleave(rows)
    own_block = (block_id[:, None] == block_id[None, :]).expand(batch, -1, -1)
    return torch.cat([context, own_block], dim=-1)[:, None]
