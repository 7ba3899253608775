"""DeepSeek's DeepSpec layout (`deepspec/modeling/dspark/qwen3`): config.json is the target's Qwen3 config
with the drafter's depth and `architectures: ["Qwen3DSparkModel"]`, plus `block_size` (anchor-first: the
anchor row drafts too), `target_layer_ids` (our convention), `mask_token_id`, `markov_rank` with
`markov_head_type` (vanilla, gated, rnn; rank 0: DFlash), `enable_confidence_head`,
`confidence_head_with_markov`; the weights hold the drafter's own embedding and LM head (copies of the
target's, shared again on import)."""

from __future__ import annotations

from pathlib import Path

from dspark_export.checkpoint import TensorInfo
from dspark_common.errors import ConfigError
from dspark_export.interop.source import DrafterSource, Target, check_geometry, imported

DESCRIPTION = "DeepSpec Qwen3DSparkModel"
ARCHITECTURE = "Qwen3DSparkModel"
HEAD_TYPES = {"vanilla": "markov", "gated": "gated", "rnn": "rnn"}  # DeepSpec's name -> ours


def matches(raw: dict) -> bool:
    return ARCHITECTURE in (raw.get("architectures") or ())


def read(folder: Path, raw: dict, tensors: dict[str, TensorInfo], target: Target) -> DrafterSource:
    missing = [key for key in ("block_size", "mask_token_id", "target_layer_ids", "markov_rank", "num_hidden_layers",
                               "vocab_size") if key not in raw]
    if missing:
        raise ConfigError(f"{folder / 'config.json'} ({ARCHITECTURE}) lacks {', '.join(missing)}")
    trained_for = raw.get("num_target_layers", target.config.num_hidden_layers)
    if trained_for != target.config.num_hidden_layers:
        raise ConfigError(f"the drafter in {folder} was trained for a target of {trained_for} layers; this one has "
                          f"{target.config.num_hidden_layers}")
    rank = int(raw["markov_rank"])
    head = "none" if rank == 0 else HEAD_TYPES.get(raw.get("markov_head_type"))
    if head is None:
        raise ConfigError(f"unknown markov_head_type {raw.get('markov_head_type')!r} in {folder / 'config.json'} "
                          f"(known: {', '.join(HEAD_TYPES)})")
    confidence = bool(raw.get("enable_confidence_head", False))
    fields = dict(
        drafter_type="dspark" if head != "none" or confidence else "dflash", mask_token_id=int(raw["mask_token_id"]),
        num_layers=int(raw["num_hidden_layers"]), gamma=int(raw["block_size"]),
        feature_layers=tuple(int(i) for i in raw["target_layer_ids"]), head=head, markov_rank=rank,
        confidence=confidence, confidence_with_markov=confidence and bool(raw.get("confidence_head_with_markov")),
        sample_from_anchor=True, intermediate_size=check_geometry(raw, target, folder))
    return imported(folder, "deepspec", fields, tensors, target, int(raw["vocab_size"]))
