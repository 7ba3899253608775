"""Train a drafter against a frozen target with target features computed online.

Each step: a batch of self-distillation sequences -> one target forward (features of the chosen layers
and the target's logits) -> the drafter's loss over many anchor blocks per sequence (DSpark, DFlash)
or over the unrolled steps at the same anchors (EAGLE-3) -> AdamW (its moments in bf16 for drafters past
100M trainable parameters); bf16 autocast where the CPU has fast bf16
kernels (as the published drafters train in bf16). Resumable from the run folder.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dspark_export.drafters.anchors import block_mask, build_blocks, sample_anchors
from dspark_export.drafters.data import Sequences
from dspark_export.drafters.eagle3 import eagle3_loss
from dspark_export.drafters.losses import DFLASH_WEIGHTS, DSPARK_WEIGHTS, drafter_loss
from dspark_export.model import DecoderModel
from dspark_export.training import CompactAdamW, RunFolder, bf16_autocast, learning_rate


COMPACT_OPTIMIZER_PARAMS = 100_000_000  # a drafter with more trainable parameters keeps its moments in bfloat16


@dataclass(frozen=True)
class DrafterTrainConfig:
    steps: int = 1000
    batch: int = 8  # sequences per step
    anchors: int = 32  # anchor blocks per sequence (DSpark / DFlash)
    max_length: int = 512
    lr: float = 6e-4
    warmup_fraction: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    checkpoint_every: int = 50
    seed: int = 0


@torch.no_grad()
def target_pass(target: DecoderModel, tokens: torch.Tensor, feature_layers,
                at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenated features [B, T, m·H] of `feature_layers` and the target's logits: [B, T, V], or [B, N, V] at
    the positions `at` [B, N] only (at Qwen3's vocabulary, a full [8, 512, V] would take 2.5 GB)."""
    last = target.config.num_hidden_layers - 1  # its feature is the final norm's output: the LM head's input
    out = target(tokens, feature_layers=(*feature_layers, last), logits=False)
    hidden = out.features[last]
    if at is not None:
        hidden = torch.gather(hidden, 1, at[..., None].expand(-1, -1, hidden.shape[-1]))
    return torch.cat([out.features[layer] for layer in feature_layers], -1), target.lm_head(hidden)


def block_drafter_loss(drafter, target, tokens, lengths, supervised_from, generator) -> dict:
    """DSpark / DFlash loss over `anchors` blocks per sequence, all in one drafter forward."""
    config = drafter.config
    batch, length = tokens.shape
    lead = config.block_rows - config.gamma
    anchors = sample_anchors(lengths, supervised_from, drafter.train_anchors, generator)
    # draft k's label x_{a+k+1} is predicted by the target at a+k
    predicted_at = (anchors[..., None] + torch.arange(config.gamma)).clamp(max=length - 1).flatten(1)
    features, target_at_slots = target_pass(target, tokens, config.feature_layers, predicted_at)
    blocks = build_blocks(tokens, lengths, supervised_from, anchors, config.gamma, config.mask_token_id, lead)
    context = drafter.fuse(features)
    hidden = drafter.backbone(
        blocks.input_ids.flatten(1), blocks.positions.flatten(1), context,
        torch.arange(length).expand(batch, length), block_mask(anchors, length, config.block_rows),
    ).view(*blocks.positions.shape, -1)
    logits, confidence = drafter.teacher_forced(hidden, blocks.previous)
    logits = drafter.in_target_vocab(logits[..., lead:, :], -1e4)  # a draft vocabulary scores no other token
    confidence = None if confidence is None else confidence[..., lead:]
    labels = blocks.labels
    if drafter.target_ids() is not None:  # a label outside the draft vocabulary adds no cross-entropy
        drafted = torch.zeros(config.target["vocab_size"], dtype=torch.bool).index_fill(0, drafter.target_ids(), True)
        labels = torch.where(drafted[labels], labels, -100)
    weights = DSPARK_WEIGHTS if config.drafter_type == "dspark" else DFLASH_WEIGHTS
    return drafter_loss(logits, target_at_slots.view_as(logits), labels, blocks.valid, confidence, weights)


def drafter_step_loss(drafter, target, tokens, lengths, supervised_from, generator) -> dict:
    if drafter.config.drafter_type != "eagle3":
        return block_drafter_loss(drafter, target, tokens, lengths, supervised_from, generator)
    features, target_logits = target_pass(target, tokens, drafter.config.feature_layers)
    # the same anchors as the block drafters: entry t = a - 1 holds x_a and predicts x_{a+1}, ...
    entries = sample_anchors(lengths, supervised_from, drafter.train_anchors, generator) - 1
    step_logits = drafter.unroll(tokens, features, drafter.config.gamma, entries)
    return eagle3_loss(step_logits, target_logits, lengths, supervised_from, entries, target_ids=drafter.target_ids())


def train_drafter(drafter, targets: list[DecoderModel], data: Sequences, run: Path, cfg: DrafterTrainConfig,
                  threads: int | None = None, until: int | None = None):
    """Train (or resume) `drafter` in place; progress on a tqdm bar (loss, running τ) and in `run/log.jsonl`.
    Step s distils from `targets[s % len(targets)]` (one target, or the same one at several weight formats, so
    that the drafter reads the features of every engine it will run beside)."""
    torch.set_num_threads(threads or os.cpu_count() or 1)
    for target in targets:
        target.eval().requires_grad_(False)
    drafter.train_anchors = cfg.anchors
    folder = RunFolder(run)
    params = [p for p in drafter.parameters() if p.requires_grad]
    adamw = CompactAdamW if sum(p.numel() for p in params) > COMPACT_OPTIMIZER_PARAMS else torch.optim.AdamW
    optimizer = adamw(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step = folder.resume(drafter, optimizer)
    usable = data.usable()
    warmup = max(1, int(cfg.warmup_fraction * cfg.steps))
    drafter.train()
    bar = tqdm(
        total=cfg.steps, initial=step, desc=f"train {drafter.config.drafter_type}", unit="step", dynamic_ncols=True
    )
    smoothed: dict[str, float] = {}
    while step < min(cfg.steps, until or cfg.steps):
        rng = np.random.default_rng([cfg.seed, step])
        generator = torch.Generator().manual_seed(int(rng.integers(1 << 62)))
        tokens, lengths, supervised_from = data.batch(rng.choice(usable, cfg.batch, replace=False), cfg.max_length)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg.steps, cfg.lr, warmup, 0.0)
        with bf16_autocast():
            terms = drafter_step_loss(drafter, targets[step % len(targets)], tokens, lengths, supervised_from,
                                      generator)
        optimizer.zero_grad(set_to_none=True)
        terms["total"].backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        step += 1
        for name, value in terms.items():
            value = float(value.detach())
            if np.isfinite(value):
                smoothed[name] = value if name not in smoothed else 0.95 * smoothed[name] + 0.05 * value
        bar.set_postfix(loss=f"{smoothed['total']:.3f}", tau=f"{smoothed.get('tau', float('nan')):.2f}")
        bar.update()
        if step % 10 == 0 or step == cfg.steps:
            folder.log({"step": step, **{k: round(v, 4) for k, v in smoothed.items()}, "time": round(time.time(), 1)})
        if step % cfg.checkpoint_every == 0 or step in (cfg.steps, until):
            folder.save(drafter, optimizer, step, skip=drafter.frozen_names())
    bar.close()
    return drafter.eval()


def new_drafter_config(spec, tokenizer, drafter_type: str, head: str, layers: int, gamma: int,
                       markov_rank: int | None, feature_layers: tuple[int, ...] | None):
    """A drafter config for a target: DFlash and EAGLE-3 have no sequential or confidence head; an EAGLE-3 layer
    norms q and k per head where the target's layers do (SpecForge's Llama drafters do not)."""
    from dspark_export.drafters.config import DrafterConfig, default_feature_layers, default_markov_rank

    target = spec.config
    mask = tokenizer.special.get("<|mask|>", tokenizer.special.get("<|MASK|>"))
    if mask is None:
        mask = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    is_dspark = drafter_type == "dspark"
    return DrafterConfig(
        drafter_type=drafter_type,
        target=target.architecture_fields() | {"dtype": target.dtype},
        vocab_hash=tokenizer.vocab_hash(),
        mask_token_id=int(mask),
        num_layers=layers,
        gamma=gamma,
        feature_layers=tuple(feature_layers or default_feature_layers(target.num_hidden_layers, layers)),
        head=head if is_dspark else "none",
        markov_rank=markov_rank or default_markov_rank(target.vocab_size),
        confidence=is_dspark,
        qk_norm=target.qk_norm or drafter_type != "eagle3",
    )
