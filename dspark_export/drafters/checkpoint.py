"""Drafter checkpoint folders: `config.json` + `model.safetensors` (trained weights only; the frozen
embedding and LM head are the target's and are filled in from it at load time)."""

from __future__ import annotations

from pathlib import Path

import torch

from dspark_export.drafters.config import DrafterConfig
from dspark_export.model import Qwen3Model
from dspark_export.errors import CheckpointError


def build_drafter(config: DrafterConfig) -> torch.nn.Module:
    from dspark_export.drafters.block_drafter import BlockDrafter
    from dspark_export.drafters.eagle3 import Eagle3Drafter

    return Eagle3Drafter(config) if config.drafter_type == "eagle3" else BlockDrafter(config)


def attach_target(drafter: torch.nn.Module, target: Qwen3Model) -> None:
    """Share the target's embedding and LM head with the drafter (frozen)."""
    drafter.embed_tokens.weight = target.embed_tokens.weight
    drafter.lm_head.weight = target.lm_head.weight
    drafter.embed_tokens.weight.requires_grad_(False)


def save_drafter(drafter: torch.nn.Module, folder: str | Path, dtype: str = "float32") -> None:
    """Write the trained weights (bundled drafters use bfloat16 to keep the package small)."""
    from safetensors.torch import save_file

    from dspark_export.model import TORCH_DTYPES

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    frozen = set(drafter.frozen_names())
    state = {name: t.detach().to(TORCH_DTYPES[dtype]).contiguous() for name, t in drafter.state_dict().items()
             if name not in frozen}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(drafter.config.to_json())


def load_drafter(folder: str | Path, target: Qwen3Model, vocab_hash: str | None = None) -> torch.nn.Module:
    """Load a drafter folder for `target`, refusing one trained for another target."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    config = DrafterConfig.from_dir(folder)
    config.check_target(target.config, vocab_hash)
    drafter = build_drafter(config)
    try:
        state = load_file(str(folder / "model.safetensors"))
    except (FileNotFoundError, SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read the drafter weights in {folder}: {exc}") from None
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    missing = [name for name in missing if name not in drafter.frozen_names()]
    if missing or unexpected:
        raise CheckpointError(f"drafter weights in {folder} do not fit its config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    attach_target(drafter, target)
    return drafter.eval()
