"""Drafter checkpoint folders: `config.json` + `model.safetensors` (trained weights only; the frozen
embedding and LM head are the target's and are filled in from it at load time)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dspark_export.drafters.config import DrafterConfig
from dspark_export.model import DecoderModel
from dspark_common.errors import CheckpointError


def build_drafter(config: DrafterConfig) -> torch.nn.Module:
    from dspark_export.drafters.block_drafter import BlockDrafter
    from dspark_export.drafters.eagle3 import Eagle3Drafter

    return Eagle3Drafter(config) if config.drafter_type == "eagle3" else BlockDrafter(config)


def attach_target(drafter: torch.nn.Module, target: DecoderModel) -> None:
    """Share the target's embedding and LM head with the drafter (frozen), unless the drafter has its own."""
    shared = drafter.config.shared_names()
    if "embed_tokens.weight" in shared:
        drafter.embed_tokens.weight = target.embed_tokens.weight
    if "lm_head.weight" in shared:
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


def load_drafter(source, target: DecoderModel) -> torch.nn.Module:
    """The torch drafter of a `DrafterSource` (any layout `dspark_export.interop` reads), attached to `target`."""
    from dspark_export.checkpoint import as_float32

    drafter = build_drafter(source.config)
    state = {}
    for name, tensor in drafter.state_dict().items():
        if name in drafter.frozen_names():
            continue
        array, dtype = source.read(name)
        value = torch.from_numpy(np.array(array) if tensor.dtype == torch.long else as_float32(array, dtype))
        if tuple(value.shape) != tuple(tensor.shape):
            raise CheckpointError(f"drafter tensor {name} in {source.folder} has shape {list(value.shape)}, "
                                  f"expected {list(tensor.shape)} from its config")
        state[name] = value.to(tensor.dtype)
    drafter.load_state_dict(state, strict=False)
    attach_target(drafter, target)
    return drafter.eval()
