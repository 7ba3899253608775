"""EAGLE-3: one decoder layer over [norm(embedding); norm(hidden)], in speculators' layout.

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
from dspark_export.drafters.vocabulary import DraftVocabulary
from dspark_export.model import MLP, RMSNorm, rope_tables, rotate


class Eagle3Attention(nn.Module):
    """Attention over [norm(embedding); norm(hidden)] (2H wide); Qwen3-based drafters norm q and k per head."""

    def __init__(self, target, qk_norm: bool):
        super().__init__()
        hidden, d = target.hidden_size, target.head_dim
        self.q_proj = nn.Linear(2 * hidden, target.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * hidden, target.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * hidden, target.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(target.num_attention_heads * d, hidden, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(d, target.rms_norm_eps)
            self.k_norm = RMSNorm(d, target.rms_norm_eps)


class Eagle3Layer(nn.Module):
    """The first (and here only) EAGLE-3 decoder layer: `input_layernorm` norms the token embedding,
    `hidden_norm` the hidden state; the residual is the hidden state (normed with `norm_before_residual`)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        target = config.target_config
        self.input_layernorm = RMSNorm(target.hidden_size, target.rms_norm_eps)
        self.hidden_norm = RMSNorm(target.hidden_size, target.rms_norm_eps)
        self.self_attn = Eagle3Attention(target, config.qk_norm)
        self.post_attention_layernorm = RMSNorm(target.hidden_size, target.rms_norm_eps)
        self.mlp = MLP(target.hidden_size, config.intermediate_size or target.intermediate_size)


class Eagle3Drafter(DraftVocabulary):
    """Module names are speculators' `Eagle3DraftModel`'s (`layers.0.self_attn.q_proj`, ...)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        target = config.target_config
        hidden, d = target.hidden_size, target.head_dim
        self.config, self.target = config, target
        self.heads, self.kv_heads, self.head_dim = target.num_attention_heads, target.num_key_value_heads, d
        self.embed_tokens = nn.Embedding(target.vocab_size, hidden).requires_grad_(False)
        self.lm_head = nn.Linear(hidden, config.drafted_vocab, bias=False).requires_grad_(False)
        self.fc = nn.Linear(len(config.feature_layers) * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config)])
        self.norm = RMSNorm(hidden, target.rms_norm_eps)
        self.init_vocabulary()

    def frozen_names(self) -> tuple[str, ...]:
        return self.config.shared_names()

    def project(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """tokens [B, T], hidden [B, T, H], positions [B, T] -> q [B, Hq, T, D], k, v [B, Hq, T, D] (GQA expanded)."""
        layer, attn = self.layers[0], self.layers[0].self_attn
        batch, length = token_ids.shape
        x = torch.cat([layer.input_layernorm(self.embed_tokens(token_ids)), layer.hidden_norm(hidden)], -1)
        cos, sin = rope_tables(self.target, positions, x.dtype)
        shape = lambda t, heads: t.view(batch, length, heads, self.head_dim)  # noqa: E731
        q, k = shape(attn.q_proj(x), self.heads), shape(attn.k_proj(x), self.kv_heads)
        if self.config.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)
        v = shape(attn.v_proj(x), self.kv_heads).transpose(1, 2)
        group = self.heads // self.kv_heads
        return q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

    def finish(self, attended: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """attended [B, Hq, T, D] + the residual of hidden [B, T, H] -> the layer's output hidden [B, T, H]."""
        layer = self.layers[0]
        residual = layer.hidden_norm(hidden) if self.config.norm_before_residual else hidden
        x = residual + layer.self_attn.o_proj(attended.transpose(1, 2).flatten(2))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., V'] of hidden states [.., H]."""
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
                supervised_from: torch.Tensor, entries: torch.Tensor | None = None, decay: float = 0.8,
                target_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Soft cross-entropy against the target's distribution per unrolled step, weighted decay^i.

    Step i at entry t predicts x_{t+i+2}, whose target distribution is target_logits[:, t+i+1]; with a draft
    vocabulary (`target_ids`), the target's distribution restricted to it.
    """
    if target_ids is not None:
        target_logits = target_logits[..., target_ids]
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
    ids = drafter.target_ids()
    for step in range(drafter.config.gamma):
        token, prob = pick(drafter.logits(out)[:, -1], temperature, None if noise is None else noise[:, step])
        token = token if ids is None else ids[token]
        tokens.append(token)
        probs.append(drafter.in_target_vocab(prob, 0.0))
        if step == drafter.config.gamma - 1:
            break
        q, k, v = drafter.project(token[:, None], out, torch.tensor([[length + step]]))
        chain_k.append(k)
        chain_v.append(v)
        out = drafter.finish(drafter.attend(q, k0, v0, everything, chain_k, chain_v), out)
    tokens = torch.stack(tokens, 1)
    return Draft(tokens, torch.stack(probs, 1), torch.ones(tokens.shape, dtype=features.dtype))
