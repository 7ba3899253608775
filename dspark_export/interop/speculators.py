"""The `speculators` layout (0.9.0, the format vLLM loads): config.json has `speculators_model_type`
(`dspark`, `dflash`), the drafter's Qwen3 `transformer_layer_config`, `block_size` with
`sample_from_anchor` (false: the 1+N block whose anchor row drafts nothing), `aux_hidden_state_layer_ids`
(counted from the embeddings: speculators' i is our i - 1), `draft_vocab_size` with `d2t` in the weights
(draft id d is target id d + d2t[d]), and DSpark's head fields. The target's embedding is never stored;
the LM head only for a draft vocabulary."""

from __future__ import annotations

from pathlib import Path

from dspark_export.checkpoint import TensorInfo
from dspark_export.errors import ConfigError
from dspark_export.interop.deepspec import HEAD_TYPES
from dspark_export.interop.source import DrafterSource, Target, check_geometry, imported

DESCRIPTION = "speculators dspark/dflash"
KINDS = ("dspark", "dflash")


def matches(raw: dict) -> bool:
    return "speculators_model_type" in raw


def read(folder: Path, raw: dict, tensors: dict[str, TensorInfo], target: Target) -> DrafterSource:
    kind, file = raw["speculators_model_type"], folder / "config.json"
    if kind not in KINDS:
        raise ConfigError(f"{file}: speculators model type {kind!r} is not one DSpark runs (it runs {', '.join(KINDS)})")
    layers, ids = raw.get("transformer_layer_config"), raw.get("aux_hidden_state_layer_ids")
    if not isinstance(layers, dict) or not ids or "block_size" not in raw or raw.get("mask_token_id") is None:
        raise ConfigError(f"{file} lacks transformer_layer_config, aux_hidden_state_layer_ids, block_size or mask_token_id")
    if raw.get("target_hidden_size") not in (None, target.config.hidden_size):
        raise ConfigError(f"the drafter in {folder} expects target features of width {raw['target_hidden_size']}")
    anchor_first = bool(raw.get("sample_from_anchor", kind == "dspark"))
    rank = int(raw.get("markov_rank", 256)) if kind == "dspark" else 0
    head = "none" if rank == 0 else HEAD_TYPES.get(raw.get("markov_head_type", "vanilla"))
    if head is None:
        raise ConfigError(f"unknown markov_head_type {raw.get('markov_head_type')!r} in {file} (known: {', '.join(HEAD_TYPES)})")
    confidence = kind == "dspark" and bool(raw.get("enable_confidence_head", True))
    fields = dict(
        drafter_type="dspark" if head != "none" or confidence else "dflash", mask_token_id=int(raw["mask_token_id"]),
        num_layers=int(layers.get("num_hidden_layers", 1)), gamma=int(raw["block_size"]) - (0 if anchor_first else 1),
        feature_layers=tuple(int(i) - 1 for i in ids), head=head, markov_rank=rank, confidence=confidence,
        confidence_with_markov=confidence and bool(raw.get("confidence_head_with_markov", True)),
        sample_from_anchor=anchor_first, intermediate_size=check_geometry(layers, target, folder))
    vocab = int(layers.get("vocab_size", target.config.vocab_size))
    return imported(folder, "speculators", fields, tensors, target, vocab)
