"""Pieces every training loop here shares: the learning-rate schedule, the CPU precision, a compact optimizer, a
resumable run folder.

A run folder holds `state.pt` (model, optimiser, step; replaced atomically) and `log.jsonl`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch


def bf16_autocast() -> torch.autocast:
    """bf16 autocast where the CPU has AVX-512 (bf16/AMX) kernels; on AVX2 it is several times slower, so fp32."""
    fast = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=fast)


def learning_rate(step: int, steps: int, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to `min_ratio` of the peak at `steps`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class CompactAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) that stores both moments in bfloat16: 4 bytes of state a
    parameter instead of 8, which is what lets a drafter of a billion parameters train beside its target. Each
    update is computed in float32, one parameter at a time."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.bfloat16)
                state["step"] += 1
                grad = param.grad.float()
                mean = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                square = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"].copy_(mean)
                state["exp_avg_sq"].copy_(square)
                param.mul_(1 - group["lr"] * group["weight_decay"])
                denominator = square.div_(1 - beta2 ** state["step"]).sqrt_().add_(group["eps"])
                param.addcdiv_(mean, denominator, value=-group["lr"] / (1 - beta1 ** state["step"]))


class RunFolder:
    """Checkpoint and log of one training run, so that the same command resumes after an interruption."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.state_file = self.folder / "state.pt"
        self.log_file = self.folder / "log.jsonl"

    def resume(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Load the last checkpoint into `model` and `optimizer`; returns its step (0 when starting fresh)."""
        if not self.state_file.is_file():
            return 0
        state = torch.load(self.state_file, weights_only=False)
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        return int(state["step"])

    def save(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, skip: tuple[str, ...] = ()
    ) -> None:
        weights = {name: t for name, t in model.state_dict().items() if name not in skip}
        tmp = self.state_file.with_suffix(".tmp")
        torch.save({"model": weights, "optimizer": optimizer.state_dict(), "step": step}, tmp)
        tmp.replace(self.state_file)

    def log(self, record: dict[str, Any]) -> None:
        with self.log_file.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def records(self) -> list[dict[str, Any]]:
        """Logged records, the last one per step (a resumed run re-logs the steps after its checkpoint)."""
        if not self.log_file.is_file():
            return []
        by_step = {}
        for line in self.log_file.read_text().splitlines():
            record = json.loads(line)
            by_step[record["step"]] = by_step.get(record["step"], {}) | record
        return [by_step[step] for step in sorted(by_step)]
