"""Training layout of many anchor blocks per sequence: anchors, block inputs, labels and the block mask.

Block b of a sequence starts at anchor position a_b: inputs [x_a, MASK x (γ-1)] at positions a..a+γ-1,
labels x_{a+1}..x_{a+γ}, teacher-forced previous tokens x_a..x_{a+γ-1}. A block query sees context
positions strictly before its anchor (the anchor's own target features do not exist yet at inference),
every slot of its own block, and nothing of other blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AnchorBlocks:
    anchors: torch.Tensor  # [B, n]
    input_ids: torch.Tensor  # [B, n, γ]   anchor then MASK
    positions: torch.Tensor  # [B, n, γ]   a + j
    previous: torch.Tensor  # [B, n, γ]   x_{a+j} (teacher forcing)
    labels: torch.Tensor  # [B, n, γ]   x_{a+j+1}
    valid: torch.Tensor  # [B, n, γ]   label exists and is supervised, and so are all before it


def sample_anchors(lengths: torch.Tensor, supervised_from: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
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
                 gamma: int, mask_token_id: int) -> AnchorBlocks:
    """tokens [B, T] (padded), anchors [B, n] -> the block tensors of `AnchorBlocks`."""
    batch, length = tokens.shape
    offsets = torch.arange(gamma)
    positions = anchors[..., None] + offsets  # [B, n, γ]
    label_positions = positions + 1
    gather = lambda index: torch.gather(tokens, 1, index.clamp(max=length - 1).flatten(1)).view_as(index)  # noqa: E731
    supervised = (label_positions < lengths[:, None, None]) & (label_positions >= supervised_from[:, None, None])
    input_ids = torch.full_like(positions, mask_token_id)
    input_ids[..., 0] = gather(anchors)
    return AnchorBlocks(
        anchors=anchors,
        input_ids=input_ids,
        positions=positions,
        previous=gather(positions),
        labels=gather(label_positions),
        valid=supervised.cumprod(-1).bool(),
    )


def block_mask(anchors: torch.Tensor, context_length: int, gamma: int) -> torch.Tensor:
    """[B, 1, n·γ, S + n·γ] attention mask: context keys before the query's anchor, then its own block."""
    batch, count = anchors.shape
    query_anchor = anchors.repeat_interleave(gamma, dim=1)  # [B, n·γ]
    context = torch.arange(context_length)[None, None, :] < query_anchor[:, :, None]
    block_id = torch.arange(count).repeat_interleave(gamma)
    own_block = (block_id[:, None] == block_id[None, :]).expand(batch, -1, -1)
    return torch.cat([context, own_block], dim=-1)[:, None]
