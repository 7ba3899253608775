"""Our own layout: `config.json` is a `DrafterConfig`, `model.safetensors` holds what is not the target's."""

from __future__ import annotations

from pathlib import Path

from dspark_export.checkpoint import TensorInfo
from dspark_export.drafters.config import DrafterConfig
from dspark_export.interop.source import DrafterSource, Target

DESCRIPTION = "DSpark's own (drafter_type)"


def matches(raw: dict) -> bool:
    return "drafter_type" in raw


def read(folder: Path, raw: dict, tensors: dict[str, TensorInfo], target: Target) -> DrafterSource:
    config = DrafterConfig.from_dict(raw, folder / "config.json")
    config.check_target(target.config, target.tokenizer.vocab_hash() if target.tokenizer else None)
    return DrafterSource(folder, "dspark", config, tensors)
