"""Pretrain the demo target on the token streams: resumable and logged (bf16 autocast only where the CPU has fast bf16).

The run folder holds `state.pt` (model, optimiser, step; rewritten atomically every
`checkpoint_every` steps) and `log.jsonl` (one line per log interval and evaluation). Restarting
the same command resumes where the last checkpoint left off, with the same data order.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from dspark_export.config import DecoderConfig
from dspark_export.demo.corpus import DOMAINS
from dspark_export.demo.tokens import load_stream
from dspark_export.model import DecoderModel
from dspark_export.training import RunFolder, bf16_autocast, learning_rate


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 3000
    batch: int = 8
    seq_len: int = 512
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    domain_weights: dict = field(default_factory=lambda: {"code": 0.4, "math": 0.25, "chat": 0.35})
    eval_every: int = 250
    eval_batches: int = 8
    checkpoint_every: int = 50
    seed: int = 0


def init_weights(model: DecoderModel, std: float = 0.02) -> None:
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=std)


def sample_batch(streams: dict[str, np.ndarray], weights: dict[str, float], batch: int, seq_len: int,
                 rng: np.random.Generator) -> torch.Tensor:
    """`batch` random windows of `seq_len + 1` tokens, each from a domain drawn by `weights`."""
    names = list(weights)
    probs = np.array([weights[n] for n in names], dtype=np.float64)
    rows = []
    for domain in rng.choice(names, size=batch, p=probs / probs.sum()):
        stream = streams[domain]
        start = int(rng.integers(0, len(stream) - seq_len - 1))
        rows.append(stream[start : start + seq_len + 1].astype(np.int64))
    return torch.from_numpy(np.stack(rows))


def lm_loss(model: DecoderModel, window: torch.Tensor) -> torch.Tensor:
    with bf16_autocast():
        logits = model(window[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: DecoderModel, streams: dict[str, np.ndarray], cfg: TrainConfig) -> dict[str, float]:
    """Held-out loss per domain on fixed windows (the same windows at every evaluation)."""
    model.eval()
    rng = np.random.default_rng(cfg.seed + 1)
    losses = {}
    for domain, stream in streams.items():
        values = [lm_loss(model, sample_batch({domain: stream}, {domain: 1.0}, cfg.batch, cfg.seq_len, rng)).item()
                  for _ in range(cfg.eval_batches)]
        losses[domain] = float(np.mean(values))
    model.train()
    return losses


def train(model_config: DecoderConfig, tokens: Path, run: Path, cfg: TrainConfig, threads: int | None = None,
          until: int | None = None) -> DecoderModel:
    """Train (or resume) and return the model; progress goes to a tqdm bar and `run/log.jsonl`.

    `until` stops early at that step (checkpointed), for runs split across sessions.
    """
    torch.set_num_threads(threads or os.cpu_count() or 1)
    run.mkdir(parents=True, exist_ok=True)
    train_streams = {d: load_stream(tokens, d, "train") for d in DOMAINS}
    val_streams = {d: load_stream(tokens, d, "val") for d in DOMAINS}
    torch.manual_seed(cfg.seed)
    model = DecoderModel(model_config)
    init_weights(model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), fused=False,
    )
    folder = RunFolder(run)
    step = folder.resume(model, optimizer)
    (run / "config.json").write_text(json.dumps({"model": asdict(model_config), "train": asdict(cfg)}, indent=2))
    model.train()
    smoothed, started, tokens_per_step = None, time.time(), cfg.batch * cfg.seq_len
    bar = tqdm(total=cfg.steps, initial=step, desc="train", unit="step", dynamic_ncols=True)
    while step < min(cfg.steps, until or cfg.steps):
        rng = np.random.default_rng([cfg.seed, step])  # data order depends on the step only: resumable
        window = sample_batch(train_streams, cfg.domain_weights, cfg.batch, cfg.seq_len, rng)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr_ratio)
        loss = lm_loss(model, window)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        step += 1
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        rate = (step - bar.initial) * tokens_per_step / (time.time() - started)
        bar.set_postfix(loss=f"{smoothed:.3f}", tok_s=f"{rate:.0f}")
        bar.update()
        record = {
            "step": step,
            "tokens": step * tokens_per_step,
            "loss": round(smoothed, 4),
            "time": round(time.time(), 1),
        }
        if step % cfg.eval_every == 0 or step == cfg.steps:
            record["val"] = evaluate(model, val_streams, cfg)
        if step % 10 == 0 or "val" in record:
            folder.log(record)
        if step % cfg.checkpoint_every == 0 or step in (cfg.steps, until):
            folder.save(model, optimizer, step)
    bar.close()
    return model.eval()
