"""z-lab's DFlash layout (`z-lab/Qwen3-8B-DFlash-b16`): config.json is a Qwen3 config with the drafter's depth,
`architectures: ["DFlashDraftModel"]`, `block_size` (the 1+N block: the anchor row drafts nothing) and
`dflash_config` {`target_layer_ids` (our convention; default evenly spaced), `mask_token_id`}. The weights
hold the backbone only: the target's embedding and LM head serve the drafter."""

from __future__ import annotations

from pathlib import Path

from dspark_export.checkpoint import TensorInfo
from dspark_export.drafters.config import default_feature_layers
from dspark_common.errors import ConfigError
from dspark_export.interop.source import DrafterSource, Target, check_geometry, imported

DESCRIPTION = "z-lab DFlashDraftModel"
ARCHITECTURE = "DFlashDraftModel"
UNSUPPORTED = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}


def matches(raw: dict) -> bool:
    return ARCHITECTURE in (raw.get("architectures") or ())


def read(folder: Path, raw: dict, tensors: dict[str, TensorInfo], target: Target) -> DrafterSource:
    dflash = raw.get("dflash_config") or {}
    value = lambda key, default=None: dflash.get(key, raw.get(key, default))  # noqa: E731
    for key, default in UNSUPPORTED.items():
        if value(key, default) not in (default, 0):
            raise ConfigError(f"{folder / 'config.json'} sets {key}; DSpark runs DFlash drafters without it")
    block, mask, depth = value("block_size"), value("mask_token_id"), target.config.num_hidden_layers
    if block is None or mask is None:
        raise ConfigError(f"{folder / 'config.json'} ({ARCHITECTURE}) lacks block_size or dflash_config.mask_token_id")
    if raw.get("num_target_layers", depth) != depth:
        raise ConfigError(f"the drafter in {folder} was trained for a target of {raw['num_target_layers']} layers; "
                          f"this one has {depth}")
    layers = int(raw.get("num_hidden_layers", 1))
    fields = dict(
        drafter_type="dflash", mask_token_id=int(mask), num_layers=layers, gamma=int(block) - 1,
        feature_layers=tuple(int(i) for i in value("target_layer_ids") or default_feature_layers(depth, layers)),
        head="none", markov_rank=0, confidence=False, sample_from_anchor=False,
        intermediate_size=check_geometry(raw, target, folder))
    return imported(folder, "z-lab", fields, tensors, target, int(raw["vocab_size"]))
