"""SpecForge's EAGLE-3 layout (`LlamaForCausalLMEagle3`): a Llama config with `draft_vocab_size`, one decoder
layer stored as `midlayer.*` (Llama attention: no per-head q/k norms), `fc`, `norm`, `lm_head` over the draft
vocabulary and `d2t`. Target layers are not stored: the engines' default, Hugging Face hidden_states
[2, L/2, L-3], unless `eagle_config.eagle_aux_hidden_state_layer_ids` names them (counted like speculators)."""

from __future__ import annotations

from pathlib import Path

from dspark_export.checkpoint import TensorInfo
from dspark_common.errors import ConfigError
from dspark_export.interop.source import DrafterSource, Target, check_geometry, imported

DESCRIPTION = "SpecForge LlamaForCausalLMEagle3"
ARCHITECTURE = "LlamaForCausalLMEagle3"
DEFAULT_GAMMA = 5  # chain length compiled into the drafter graph when the checkpoint does not say


def matches(raw: dict) -> bool:
    return ARCHITECTURE in (raw.get("architectures") or ())


def eagle3_layers(ids: list[int] | None, depth: int) -> tuple[int, ...]:
    """Aux hidden-state ids counted from the embeddings (engines' default 2, L/2, L-3) -> our target layers."""
    return tuple(int(i) - 1 for i in (ids or (2, depth // 2, depth - 3)))


def read(folder: Path, raw: dict, tensors: dict[str, TensorInfo], target: Target) -> DrafterSource:
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise ConfigError(f"the EAGLE-3 drafter in {folder} has {raw['num_hidden_layers']} layers; DSpark runs one")
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    fields = dict(drafter_type="eagle3", mask_token_id=0, num_layers=1, gamma=DEFAULT_GAMMA,
                  feature_layers=eagle3_layers(ids, target.config.num_hidden_layers), head="none", markov_rank=0,
                  confidence=False, qk_norm=False, intermediate_size=check_geometry(raw, target, folder))
    renamed = {name.replace("midlayer.", "layers.0."): name for name in tensors if name.startswith("midlayer.")}
    return imported(folder, "specforge", fields, tensors, target, int(raw["vocab_size"]), renamed)
