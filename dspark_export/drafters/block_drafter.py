"""DSpark's semi-autoregressive drafter and the DFlash baseline (the same backbone with heads off).

Backbone: fused target features H_ctx = RMSNorm(fc([f_l1; ...; f_lm])) are injected as extra keys and
values into every drafter layer; queries come from the block [anchor, MASK x (γ-1)], which attends
bidirectionally to itself and to context positions strictly before its anchor. Slot k's hidden state
h_k gives base logits U_k = lm_head(norm(h_k)); the sequential head adds B_k from the previous token,
so the draft distribution is softmax(U_k + B_k). The confidence head predicts whether slot k survives
verification given that the slots before it did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark_export.drafters.config import DrafterConfig
from dspark_export.model import MLP, RMSNorm, rope_tables


class InjectedLayer(nn.Module):
    """A Qwen3 decoder layer whose attention also reads keys/values projected from the context."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        from dspark_export.model import Attention

        target = config.target_config
        self.input_layernorm = RMSNorm(target.hidden_size, target.rms_norm_eps)
        self.self_attn = Attention(target)
        self.post_attention_layernorm = RMSNorm(target.hidden_size, target.rms_norm_eps)
        self.mlp = MLP(target.hidden_size, config.intermediate_size or target.intermediate_size)

    def forward(self, x, block_rope, context, context_rope, mask) -> torch.Tensor:
        """x [B, N, H] block states; context [B, S, H] fused features; mask [B, 1, N, S + N] (True = may attend)."""
        attn = self.self_attn
        q, k, v = attn.project(self.input_layernorm(x), *block_rope)
        k_ctx, v_ctx = attn.keys_values(context, *context_rope)
        out = attn.attend(q, torch.cat([k_ctx, k], 2), torch.cat([v_ctx, v], 2), mask)
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x))


def pick(logits: torch.Tensor, temperature: float, uniform: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample from softmax(logits / T) by inverse CDF with one uniform in [0, 1) per row; T = 0 takes the argmax.

    Returns the tokens [R] and the distribution they were drawn from [R, V] (one-hot for T = 0). One uniform
    per draft position keeps drafting deterministic given the noise input (Gumbel-max would need V of them).
    """
    if temperature == 0:
        token = logits.argmax(-1)
        return token, F.one_hot(token, logits.shape[-1]).to(logits.dtype)
    probs = torch.softmax(logits / temperature, -1)
    cdf = probs.cumsum(-1)
    token = (cdf < uniform[:, None] * cdf[:, -1:]).sum(-1).clamp(max=logits.shape[-1] - 1)
    return token, probs


@dataclass
class Draft:
    tokens: torch.Tensor  # [R, γ] sampled draft tokens
    probs: torch.Tensor  # [R, γ, V] the distributions they were sampled from
    confidence: torch.Tensor  # [R, γ] predicted conditional acceptance probabilities (ones without the head)


class BlockDrafter(nn.Module):
    """DSpark (head "markov" or "rnn", confidence head) or DFlash (head "none", no confidence)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        target = config.target_config
        hidden, vocab, rank = target.hidden_size, target.vocab_size, config.markov_rank
        self.config, self.target = config, target
        # frozen copies of the target's embedding and LM head (loaded from the target, never saved)
        self.embed_tokens = nn.Embedding(vocab, hidden).requires_grad_(False)
        self.lm_head = nn.Linear(hidden, vocab, bias=False).requires_grad_(False)
        self.fc = nn.Linear(len(config.feature_layers) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, target.rms_norm_eps)
        self.layers = nn.ModuleList(InjectedLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(hidden, target.rms_norm_eps)
        if config.head != "none":
            self.markov_w1 = nn.Embedding(vocab, rank)
            self.markov_w2 = nn.Linear(rank, vocab, bias=False)
            nn.init.zeros_(self.markov_w2.weight)  # start as the plain backbone
        if config.head == "rnn":
            self.rnn = nn.Linear(2 * rank + hidden, 3 * rank)
        if config.confidence:
            self.confidence_head = nn.Linear(hidden + rank, 1)

    def frozen_names(self) -> tuple[str, ...]:
        return ("embed_tokens.weight", "lm_head.weight")

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target features [B, S, m·H] -> context states [B, S, H]."""
        return self.hidden_norm(self.fc(features))

    def backbone(self, block_ids, block_positions, context, context_positions, mask) -> torch.Tensor:
        """Block tokens [B, N] at positions [B, N] over context [B, S, H] at [B, S] -> hidden states [B, N, H]."""
        x = self.embed_tokens(block_ids)
        block_rope = rope_tables(self.target, block_positions, x.dtype)
        context_rope = rope_tables(self.target, context_positions, x.dtype)
        for layer in self.layers:
            x = layer(x, block_rope, context, context_rope, mask)
        return self.norm(x)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def head_step(self, hidden_k: torch.Tensor, previous: torch.Tensor, state: torch.Tensor | None):
        """One sequential-head step: hidden [.., H], previous token [..] -> bias [.., V], token code [.., r], state."""
        code = self.markov_w1(previous)
        if self.config.head == "markov":
            return self.markov_w2(code), code, state
        if state is None:
            state = torch.zeros_like(code)
        gate, candidate, out = self.rnn(torch.cat([state, code, hidden_k], -1)).chunk(3, -1)
        bias = self.markov_w2(torch.tanh(out))
        state = torch.sigmoid(gate) * state + (1 - torch.sigmoid(gate)) * torch.tanh(candidate)
        return bias, code, state

    def teacher_forced(self, hidden: torch.Tensor, previous: torch.Tensor):
        """Training: hidden [.., γ, H], previous tokens [.., γ] (anchor then ground truth) -> logits, confidence logits."""
        logits = self.base_logits(hidden)
        if self.config.head == "none":
            return logits, None
        if self.config.head == "markov":
            code = self.markov_w1(previous)
            logits = logits + self.markov_w2(code)
        else:
            state, biases, codes = None, [], []
            for k in range(hidden.shape[-2]):
                bias, code, state = self.head_step(hidden[..., k, :], previous[..., k], state)
                biases.append(bias)
                codes.append(code)
            logits, code = logits + torch.stack(biases, -2), torch.stack(codes, -2)
        confidence = self.confidence_head(torch.cat([hidden, code], -1))[..., 0] if self.config.confidence else None
        return logits, confidence

    @torch.no_grad()
    def draft(self, hidden: torch.Tensor, anchors: torch.Tensor, temperature: float, noise: torch.Tensor | None) -> Draft:
        """Sample γ drafts left to right from the block's hidden states [R, γ, H].

        Inverse CDF: x_k is the first token whose cumulative probability exceeds u_k = noise[:, k], so x_k is
        distributed exactly as softmax(logits_k / T); T = 0 takes the argmax. q is returned as used.
        """
        base = self.base_logits(hidden)
        previous, state = anchors, None
        tokens, probs, confidence = [], [], []
        for k in range(hidden.shape[1]):
            logits, code = base[:, k], None
            if self.config.head != "none":
                bias, code, state = self.head_step(hidden[:, k], previous, state)
                logits = logits + bias
            token, prob = pick(logits, temperature, None if noise is None else noise[:, k])
            if self.config.confidence:
                confidence.append(torch.sigmoid(self.confidence_head(torch.cat([hidden[:, k], code], -1))[:, 0]))
            else:
                confidence.append(torch.ones_like(token, dtype=hidden.dtype))
            tokens.append(token)
            probs.append(prob)
            previous = token
        return Draft(torch.stack(tokens, 1), torch.stack(probs, 1), torch.stack(confidence, 1))


@torch.no_grad()
def block_draft(drafter: BlockDrafter, committed: torch.Tensor, features: torch.Tensor, temperature: float,
                noise: torch.Tensor | None) -> Draft:
    """Draft γ tokens after the committed tokens [1, a+1] (the last is the anchor at position a), given the
    target features [1, a, m·H] of positions 0..a-1."""
    length, gamma = features.shape[1], drafter.config.gamma
    ids = torch.full((1, gamma), drafter.config.mask_token_id)
    ids[0, 0] = committed[0, -1]
    hidden = drafter.backbone(ids, torch.arange(length, length + gamma)[None], drafter.fuse(features),
                              torch.arange(length)[None], torch.ones(1, 1, gamma, length + gamma, dtype=torch.bool))
    return drafter.draft(hidden, committed[:, -1], temperature, noise)
