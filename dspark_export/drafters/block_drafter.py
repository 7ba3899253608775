"""DSpark's semi-autoregressive drafter and the DFlash baseline (the same backbone with heads off).

Backbone: fused target features H_ctx = RMSNorm(fc([f_l1; ...; f_lm])) are injected as extra keys and
values into every drafter layer; queries come from the block [anchor, MASK x (γ-1)], which attends
bidirectionally to itself and to context positions strictly before its anchor. Slot k's hidden state
h_k gives base logits U_k = lm_head(norm(h_k)); the sequential head adds B_k from the previous token,
so the draft distribution is softmax(U_k + B_k). The confidence head predicts whether slot k survives
verification given that the slots before it did.

Module names follow DeepSpec's `Qwen3DSparkModel` (`markov_head.markov_w1`, `confidence_head.proj`, ...),
so that its checkpoints and ours share tensor names. Layout knobs (`DrafterConfig`): the 1+γ block of
DFlash checkpoints (row 0 only carries the anchor), a draft vocabulary subset mapped by `d2t`, and the
drafter's own embedding and LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark_export.drafters.config import DrafterConfig
from dspark_export.drafters.vocabulary import DraftVocabulary
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
    tokens: torch.Tensor  # [R, γ] sampled draft tokens (target vocabulary ids)
    probs: torch.Tensor  # [R, γ, V] the distributions they were sampled from, over the target's vocabulary
    confidence: torch.Tensor  # [R, γ] predicted conditional acceptance probabilities (ones without the head)


class SequentialHead(nn.Module):
    """B_k from the previous token x_{k-1} through the rank-r code W1[x_{k-1}], projected by W2:
    "markov" W2·W1[x]; "gated" W2·(σ(G[h_k; W1[x]]) ⊙ W1[x]); "rnn" W2·tanh(o_k) with a gated recurrent state
    s_k = g ⊙ s_{k-1} + (1 - g) ⊙ tanh(c), where [g; c; o] = J[s_{k-1}; W1[x]; h_k]."""

    def __init__(self, kind: str, vocab: int, drafted_vocab: int, rank: int, hidden: int):
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, drafted_vocab, bias=False)
        nn.init.zeros_(self.markov_w2.weight)  # start as the plain backbone
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        if kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def step(self, hidden_k: torch.Tensor, previous: torch.Tensor, state: torch.Tensor | None):
        """hidden [.., H], previous token [..] -> bias [.., V'], code W1[previous] [.., r], next state."""
        code = self.markov_w1(previous)
        if self.kind == "markov":
            return self.markov_w2(code), code, state
        if self.kind == "gated":
            return self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat([hidden_k, code], -1))) * code), code, state
        state = torch.zeros_like(code) if state is None else state
        gate, candidate, out = self.joint_proj(torch.cat([state, code, hidden_k], -1)).chunk(3, -1)
        gate = torch.sigmoid(gate)
        return self.markov_w2(torch.tanh(out)), code, gate * state + (1 - gate) * torch.tanh(candidate)


class ConfidenceHead(nn.Module):
    """The logit of P(draft k accepted | drafts before it accepted) from [h_k] or [h_k; W1[x_{k-1}]]."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features)[..., 0]


class BlockDrafter(DraftVocabulary):
    """DSpark (a sequential head, a confidence head) or DFlash (neither), in every layout `DrafterConfig` names."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        target = config.target_config
        hidden, vocab = target.hidden_size, target.vocab_size
        self.config, self.target = config, target
        # frozen: the target's embedding and LM head (attached at load, never saved) or the drafter's own copies
        self.embed_tokens = nn.Embedding(vocab, hidden).requires_grad_(False)
        self.lm_head = nn.Linear(hidden, config.drafted_vocab, bias=False).requires_grad_(False)
        self.fc = nn.Linear(len(config.feature_layers) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, target.rms_norm_eps)
        self.layers = nn.ModuleList(InjectedLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(hidden, target.rms_norm_eps)
        self.init_vocabulary()
        if config.head != "none":
            self.markov_head = SequentialHead(config.head, vocab, config.drafted_vocab, config.markov_rank, hidden)
        if config.confidence:
            self.confidence_head = ConfidenceHead(config.confidence_width)

    def frozen_names(self) -> tuple[str, ...]:
        """Tensors that are the target's, not saved with the drafter."""
        return self.config.shared_names()

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

    def confidence_logits(self, hidden: torch.Tensor, code: torch.Tensor | None) -> torch.Tensor:
        features = torch.cat([hidden, code], -1) if self.config.confidence_with_markov else hidden
        return self.confidence_head(features)

    def teacher_forced(self, hidden: torch.Tensor, previous: torch.Tensor):
        """Training: hidden [.., N, H] of all block rows, previous tokens [.., N] -> draft-vocabulary logits
        [.., N, V'] and confidence logits [.., N] (None without the head). The sequential head runs over every
        row, so that a recurrent state passes through the idle anchor row of the 1+γ layout."""
        logits = self.lm_head(hidden)
        code = None
        if self.config.head != "none":
            state, biases, codes = None, [], []
            for k in range(hidden.shape[-2]):
                bias, step_code, state = self.markov_head.step(hidden[..., k, :], previous[..., k], state)
                biases.append(bias)
                codes.append(step_code)
            logits, code = logits + torch.stack(biases, -2), torch.stack(codes, -2)
        confidence = self.confidence_logits(hidden, code) if self.config.confidence else None
        return logits, confidence

    @torch.no_grad()
    def draft(
        self, hidden: torch.Tensor, anchors: torch.Tensor, temperature: float, noise: torch.Tensor | None
    ) -> Draft:
        """Sample γ drafts left to right from the block's hidden states [R, N, H] (N = `block_rows`).

        Inverse CDF: x_k is the first token whose cumulative probability exceeds u_k = noise[:, k], so x_k is
        distributed exactly as softmax(logits_k / T); T = 0 takes the argmax. q is returned as used, on the
        target's vocabulary.
        """
        config = self.config
        lead = config.block_rows - config.gamma
        ids = self.target_ids()
        head = self.markov_head if config.head != "none" else None
        previous, state = anchors, None
        if lead and config.head == "rnn":  # the idle anchor row still advances the recurrent state
            state = head.step(hidden[:, 0], anchors, None)[2]
        hidden = hidden[:, lead:]
        base = self.lm_head(hidden)
        tokens, probs, confidence = [], [], []
        for k in range(config.gamma):
            logits, code = base[:, k], None
            if head is not None:
                bias, code, state = head.step(hidden[:, k], previous, state)
                logits = logits + bias
            token, prob = pick(logits, temperature, None if noise is None else noise[:, k])
            if ids is not None:
                token = ids[token]
            if config.confidence:
                confidence.append(torch.sigmoid(self.confidence_logits(hidden[:, k], code)))
            else:
                confidence.append(torch.ones_like(token, dtype=hidden.dtype))
            tokens.append(token)
            probs.append(self.in_target_vocab(prob, 0.0))
            previous = token
        return Draft(torch.stack(tokens, 1), torch.stack(probs, 1), torch.stack(confidence, 1))


@torch.no_grad()
def block_draft(drafter: BlockDrafter, committed: torch.Tensor, features: torch.Tensor, temperature: float,
                noise: torch.Tensor | None) -> Draft:
    """Draft γ tokens after the committed tokens [1, a+1] (the last is the anchor at position a), given the
    target features [1, a, m·H] of positions 0..a-1."""
    length, rows = features.shape[1], drafter.config.block_rows
    ids = torch.full((1, rows), drafter.config.mask_token_id)
    ids[0, 0] = committed[0, -1]
    hidden = drafter.backbone(ids, torch.arange(length, length + rows)[None], drafter.fuse(features),
                              torch.arange(length)[None], torch.ones(1, 1, rows, length + rows, dtype=torch.bool))
    return drafter.draft(hidden, committed[:, -1], temperature, noise)
