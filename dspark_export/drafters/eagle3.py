"""EAGLE-3-style autoregressive baseline: one decoder layer over [norm(embedding); norm(hidden)].

Entry (t, step i) holds the token x_{t+i+1} and a hidden state: at step 0 the fused target features of
position t, at step i > 0 the layer's own output for (t, i-1). It predicts x_{t+i+2}. Training unrolls
`steps` (7) steps ("training-time test"): a step-i query attends to the step-0 entries t' <= t and to
the step-1..i entries of its own chain, exactly what it sees when drafting; losses weigh 0.8^i.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dspark_export.drafters.config import DrafterConfig
from dspark_export.drafters.losses import expected_tau
from dspark_export.model import MLP, RMSNorm, rope_tables, rotate


class Eagle3Drafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        target = config.target_config
        hidden, d = target.hidden_size, target.head_dim
        self.config, self.target = config, target
        self.heads, self.kv_heads, self.head_dim = target.num_attention_heads, target.num_key_value_heads, d
        self.embed_tokens = nn.Embedding(target.vocab_size, hidden).requires_grad_(False)
        self.lm_head = nn.Linear(hidden, target.vocab_size, bias=False).requires_grad_(False)
        self.fc = nn.Linear(len(config.feature_layers) * hidden, hidden, bias=False)
        self.embed_norm = RMSNorm(hidden, target.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, target.rms_norm_eps)
        self.q_proj = nn.Linear(2 * hidden, self.heads * d, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, hidden, bias=False)
        self.q_norm = RMSNorm(d, target.rms_norm_eps)
        self.k_norm = RMSNorm(d, target.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, target.rms_norm_eps)
        self.mlp = MLP(hidden, config.intermediate_size or target.intermediate_size)
        self.norm = RMSNorm(hidden, target.rms_norm_eps)

    def frozen_names(self) -> tuple[str, ...]:
        return ("embed_tokens.weight", "lm_head.weight")

    def project(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """tokens [B, T], hidden [B, T, H], positions [B, T] -> q [B, Hq, T, D], k, v [B, Hq, T, D] (GQA expanded)."""
        batch, length = token_ids.shape
        x = torch.cat([self.embed_norm(self.embed_tokens(token_ids)), self.hidden_norm(hidden)], -1)
        cos, sin = rope_tables(self.target, positions, x.dtype)
        shape = lambda t, heads: t.view(batch, length, heads, self.head_dim)  # noqa: E731
        q = rotate(self.q_norm(shape(self.q_proj(x), self.heads)).transpose(1, 2), cos, sin)
        k = rotate(self.k_norm(shape(self.k_proj(x), self.kv_heads)).transpose(1, 2), cos, sin)
        v = shape(self.v_proj(x), self.kv_heads).transpose(1, 2)
        group = self.heads // self.kv_heads
        return q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attended [B, Hq, T, D] + residual hidden [B, T, H] -> the layer's output hidden [B, T, H]."""
        x = residual + self.o_proj(attended.transpose(1, 2).flatten(2))
        return x + self.mlp(self.post_attention_layernorm(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def attend(self, q, k0, v0, visible, chain_k, chain_v) -> torch.Tensor:
        """q [B, Hq, S, D] over the step-0 keys k0/v0 [B, Hq, T, D] where `visible` [B, 1, S, T], plus each query's
        own chain entries chain_k/chain_v (lists of [B, Hq, S, D]) -> attended [B, Hq, S, D]."""
        scale = 1.0 / math.sqrt(self.head_dim)
        scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))]
        scores += [(q * k).sum(-1, keepdim=True) * scale for k in chain_k]
        weights = torch.softmax(torch.cat(scores, -1), -1)
        length = k0.shape[-2]
        attended = weights[..., :length] @ v0
        for j, v in enumerate(chain_v):
            attended = attended + weights[..., length + j : length + j + 1] * v
        return attended

    def unroll(self, tokens: torch.Tensor, features: torch.Tensor, steps: int,
               entries: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Training-time test: tokens [B, T], features [B, T, m·H], entries [B, S] (default: all T) -> per step
        logits [B, S, V]. Step i at entry t uses token x_{t+i+1} (zero-padded past the end) and predicts x_{t+i+2}.

        Every entry's step-0 keys are computed; the unrolled chain (and the LM head) only at `entries`.
        """
        batch, length = tokens.shape
        entries = torch.arange(length).expand(batch, length) if entries is None else entries
        padded = F.pad(tokens, (0, steps + 1))
        context = self.fc(features)
        _, k0, v0 = self.project(padded[:, 1 : length + 1], context, torch.arange(length).expand(batch, length))
        visible = (torch.arange(length)[None, :] <= entries[..., None])[:, None]  # [B, 1, S, T]
        hidden = torch.gather(context, 1, entries[..., None].expand(-1, -1, context.shape[-1]))
        chain_k, chain_v, outputs = [], [], []
        for step in range(steps):
            q, k, v = self.project(torch.gather(padded, 1, entries + step + 1), hidden, entries + step)
            if step:
                chain_k.append(k)
                chain_v.append(v)
            hidden = self.finish(self.attend(q, k0, v0, visible, chain_k, chain_v), hidden)
            outputs.append(self.logits(hidden))
        return outputs


def eagle3_loss(step_logits: list[torch.Tensor], target_logits: torch.Tensor, lengths: torch.Tensor,
                supervised_from: torch.Tensor, entries: torch.Tensor | None = None, decay: float = 0.8) -> dict[str, torch.Tensor]:
    """Soft cross-entropy against the target's distribution per unrolled step, weighted decay^i.

    Step i at entry t predicts x_{t+i+2}, whose target distribution is target_logits[:, t+i+1].
    """
    batch, length, vocab = target_logits.shape
    entries = torch.arange(length).expand(batch, length) if entries is None else entries
    total = target_logits.new_zeros(())
    tvs, valids = [], []
    for step, logits in enumerate(step_logits):
        label = entries + step + 2
        valid = (label < lengths[:, None]) & (label >= supervised_from[:, None])  # [B, S]
        source = (entries + step + 1).clamp(max=length - 1)
        target = torch.softmax(torch.gather(target_logits, 1, source[..., None].expand(-1, -1, vocab)).float(), -1)
        log_draft = torch.log_softmax(logits.float(), -1)
        soft_ce = -(target * log_draft).sum(-1)
        total = total + decay**step * (soft_ce * valid).sum() / valid.sum().clamp(min=1)
        tvs.append(0.5 * (log_draft.exp() - target).abs().sum(-1).detach())
        valids.append(valid)
    valid = torch.stack(valids, -1).cumprod(-1).bool()
    return {"total": total, "tau": expected_tau(torch.stack(tvs, -1), valid)}


@torch.no_grad()
def eagle3_draft(drafter: Eagle3Drafter, committed: torch.Tensor, features: torch.Tensor, temperature: float,
                 noise: torch.Tensor | None):
    """Draft γ tokens after the committed tokens [1, a+1] (the last one is the anchor), given target
    features [1, a, m·H] of positions 0..a-1; the same attention pattern as `unroll` in training."""
    from dspark_export.drafters.block_drafter import Draft, pick

    length = features.shape[1]
    hidden = drafter.fc(features)
    q, k0, v0 = drafter.project(committed[:, 1 : length + 1], hidden, torch.arange(length)[None])
    everything = torch.ones(1, 1, 1, length, dtype=torch.bool)
    # step 0 of the last entry sees every step-0 entry
    out = drafter.finish(drafter.attend(q[:, :, -1:], k0, v0, everything, [], []), hidden[:, -1:])
    chain_k, chain_v, tokens, probs = [], [], [], []
    for step in range(drafter.config.gamma):
        token, prob = pick(drafter.logits(out)[:, -1], temperature, None if noise is None else noise[:, step])
        tokens.append(token)
        probs.append(prob)
        if step == drafter.config.gamma - 1:
            break
        q, k, v = drafter.project(token[:, None], out, torch.tensor([[length + step]]))
        chain_k.append(k)
        chain_v.append(v)
        out = drafter.finish(drafter.attend(q, k0, v0, everything, chain_k, chain_v), out)
    tokens = torch.stack(tokens, 1)
    return Draft(tokens, torch.stack(probs, 1), torch.ones(tokens.shape, dtype=features.dtype))
