"""The `speculators` layout (0.9.0, the format vLLM loads): config.json has `speculators_model_type`
(`dspark`, `dflash`, `eagle3`), the drafter's Qwen3 `transformer_layer_config`, `block_size` with
`sample_from_anchor` (false: the 1+N block whose anchor row drafts nothing), `aux_hidden_state_layer_ids`
(counted from the embeddings: speculators' i is our i - 1), `draft_vocab_size` with `d2t` in the weights
(draft id d is target id d + d2t[d]), and DSpark's head fields. The target's embedding is never stored;
the LM head only for a draft vocabulary."""

from __future__ import annotations

from pathlib import Path

from dspark_export.checkpoint import TensorInfo
from dspark_common.errors import ConfigError
from dspark_export.interop.deepspec import HEAD_TYPES
from dspark_export.interop.source import DrafterSource, Target, check_geometry, imported
from dspark_export.interop.specforge import DEFAULT_GAMMA, eagle3_layers

DESCRIPTION = "speculators dspark/dflash/eagle3"
KINDS = ("dspark", "dflash", "eagle3")
EAGLE3_UNSUPPORTED = ("norm_before_fc", "fc_norm", "norm_output")


def matches(raw: dict) -> bool:
    return "speculators_model_type" in raw


def read(folder: Path, raw: dict, tensors: dict[str, TensorInfo], target: Target) -> DrafterSource:
    kind, file = raw["speculators_model_type"], folder / "config.json"
    if kind not in KINDS:
        raise ConfigError(
            f"{file}: speculators model type {kind!r} is not one DSpark runs (it runs {', '.join(KINDS)})"
        )
    if raw.get("target_hidden_size") not in (None, target.config.hidden_size):
        raise ConfigError(f"the drafter in {folder} expects target features of width {raw['target_hidden_size']}")
    if kind == "eagle3":
        return read_eagle3(folder, raw, tensors, target)
    layers, ids = raw.get("transformer_layer_config"), raw.get("aux_hidden_state_layer_ids")
    if not isinstance(layers, dict) or not ids or "block_size" not in raw or raw.get("mask_token_id") is None:
        raise ConfigError(
            f"{file} lacks transformer_layer_config, aux_hidden_state_layer_ids, block_size or mask_token_id"
        )
    anchor_first = bool(raw.get("sample_from_anchor", kind == "dspark"))
    rank = int(raw.get("markov_rank", 256)) if kind == "dspark" else 0
    head = "none" if rank == 0 else HEAD_TYPES.get(raw.get("markov_head_type", "vanilla"))
    if head is None:
        raise ConfigError(
            f"unknown markov_head_type {raw.get('markov_head_type')!r} in {file} (known: {', '.join(HEAD_TYPES)})"
        )
    confidence = kind == "dspark" and bool(raw.get("enable_confidence_head", True))
    fields = dict(
        drafter_type="dspark" if head != "none" or confidence else "dflash", mask_token_id=int(raw["mask_token_id"]),
        num_layers=int(layers.get("num_hidden_layers", 1)), gamma=int(raw["block_size"]) - (0 if anchor_first else 1),
        feature_layers=tuple(int(i) - 1 for i in ids), head=head, markov_rank=rank, confidence=confidence,
        confidence_with_markov=confidence and bool(raw.get("confidence_head_with_markov", True)),
        sample_from_anchor=anchor_first, intermediate_size=check_geometry(layers, target, folder))
    vocab = int(layers.get("vocab_size", target.config.vocab_size))
    return imported(folder, "speculators", fields, tensors, target, vocab)


def read_eagle3(folder: Path, raw: dict, tensors: dict[str, TensorInfo], target: Target) -> DrafterSource:
    """speculators' EAGLE-3: one Qwen3 or Llama layer over [embedding; hidden], `eagle_aux_hidden_state_layer_ids`
    counted from the embeddings (engines' default 2, L/2, L-3), a draft vocabulary with `d2t`."""
    layers = raw.get("transformer_layer_config")
    if not isinstance(layers, dict):
        raise ConfigError(f"{folder / 'config.json'} lacks transformer_layer_config")
    on = [key for key in EAGLE3_UNSUPPORTED if raw.get(key)]
    if on:
        raise ConfigError(f"{folder / 'config.json'} sets {', '.join(on)}; DSpark's EAGLE-3 graph has no such norm")
    if int(layers.get("num_hidden_layers", 1)) != 1:
        raise ConfigError(f"the EAGLE-3 drafter in {folder} has {layers['num_hidden_layers']} layers; DSpark runs one")
    proposals = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
    fields = dict(
        drafter_type="eagle3",
        mask_token_id=0,
        num_layers=1,
        gamma=int(proposals[0].get("speculative_tokens", DEFAULT_GAMMA)),
        feature_layers=eagle3_layers(raw.get("eagle_aux_hidden_state_layer_ids"), target.config.num_hidden_layers),
        head="none",
        markov_rank=0,
        confidence=False,
        qk_norm=layers.get("model_type") == "qwen3",
        norm_before_residual=bool(raw.get("norm_before_residual")),
        intermediate_size=check_geometry(layers, target, folder),
    )
    return imported(
        folder, "speculators", fields, tensors, target, int(layers.get("vocab_size", target.config.vocab_size))
    )
