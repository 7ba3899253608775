"""`dspark-export convert`: a drafter DSpark reads, written in the layout another engine loads.

`speculators` (0.9.0) is the layout vLLM serves DSpark and DFlash drafters from; `deepspec` is DeepSeek's,
which DeepSpec's evaluator and trainer load. Both get `config.json` and `model.safetensors` only, the tensors
in their stored precision. A layout that cannot express the drafter is refused, naming what it lacks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dspark_export.checkpoint import Checkpoint, write_safetensors
from dspark_common.errors import ConfigError
from dspark_export.interop.deepspec import HEAD_TYPES
from dspark_export.interop.source import DrafterSource
from dspark_export.staging import staged

SPECULATORS_VERSION = "0.9.0"
HEAD_NAMES = {ours: theirs for theirs, ours in HEAD_TYPES.items()}  # our head -> markov_head_type


def drafter_layers_config(source: DrafterSource) -> dict[str, Any]:
    """The drafter's decoder layers as a Hugging Face Qwen3 config: the target's, at the drafter's depth."""
    config, target = source.config, source.config.target_config
    layers = config.num_layers
    fields = target.to_hf_dict() | {"num_hidden_layers": layers, "layer_types": ["full_attention"] * layers,
                                    "intermediate_size": config.intermediate_size or target.intermediate_size,
                                    "tie_word_embeddings": False, "max_window_layers": layers}
    return {key: value for key, value in fields.items() if key not in ("architectures", "torch_dtype")}


def head_fields(source: DrafterSource) -> dict[str, Any]:
    """DeepSpec's and speculators' shared names for the sequential and confidence heads."""
    config = source.config
    fields: dict[str, Any] = {"markov_rank": config.markov_rank if config.head != "none" else 0,
                              "enable_confidence_head": config.confidence,
                              "confidence_head_with_markov": config.confidence and config.confidence_with_markov}
    if config.head != "none":
        fields["markov_head_type"] = HEAD_NAMES[config.head]
    return fields


def own_tensors(source: DrafterSource) -> dict[str, tuple[np.ndarray, str]]:
    """Every tensor the drafter stores (the ones it shares with the target excluded), by our names."""
    return {name: source.read(name) for name in source.names() if name not in source.config.shared_names()
            and name not in ("t2d", "d2t")}


def speculators_config(kind: str, gamma: int, verifier: str) -> dict[str, Any]:
    return {"algorithm": kind, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": gamma, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": ["Qwen3ForCausalLM"]}}


def with_vocabulary_map(source: DrafterSource, tensors: dict) -> dict:
    """speculators stores a draft vocabulary as `d2t` (offsets) and `t2d` (a mask over the target's)."""
    if source.config.draft_vocab_size is None:
        return tensors
    t2d = np.zeros(source.config.target["vocab_size"], np.bool_)
    t2d[source.target_ids()] = True
    return tensors | {"d2t": source.read("d2t"), "t2d": (t2d, "bool")}


def eagle3_to_speculators(source: DrafterSource, target: Checkpoint, verifier: str) -> tuple[dict, dict]:
    """speculators' EAGLE-3: a Qwen3 layer config (a Llama one without per-head q/k norms); the LM head always
    stored, the embedding never."""
    config = source.config
    layers = drafter_layers_config(source)
    if not config.qk_norm:
        layers = layers | {"model_type": "llama"}
    raw = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layers,
        "draft_vocab_size": config.drafted_vocab,
        "norm_before_residual": config.norm_before_residual,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [layer + 1 for layer in config.feature_layers],
        "tie_word_embeddings": False,
        "speculators_config": speculators_config("eagle3", config.gamma, verifier),
    }
    head = source.read("lm_head.weight") if config.own_lm_head else target.raw(target.lm_head_name())
    return raw, with_vocabulary_map(source, own_tensors(source) | {"lm_head.weight": head})


def to_speculators(source: DrafterSource, target: Checkpoint, verifier: str) -> tuple[dict, dict]:
    config = source.config
    if config.drafter_type == "eagle3":
        return eagle3_to_speculators(source, target, verifier)
    if config.own_embedding:
        raise ConfigError("speculators drafters read the verifier's embedding; this drafter has its own")
    if config.own_lm_head and config.draft_vocab_size is None:
        raise ConfigError(
            "speculators stores an LM head only with a draft vocabulary; this drafter has its own full one"
        )
    kind = "dspark" if config.head != "none" or config.confidence else "dflash"
    raw = {
        "architectures": ["DSparkDraftModel" if kind == "dspark" else "DFlashDraftModel"],
        "speculators_model_type": kind, "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": drafter_layers_config(source), "draft_vocab_size": config.drafted_vocab,
        "block_size": config.block_rows, "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [layer + 1 for layer in config.feature_layers],  # counted from the embeddings
        "mask_token_id": config.mask_token_id, "sliding_window_non_causal": False,
        "sample_from_anchor": config.sample_from_anchor, "tie_word_embeddings": False,
        "speculators_config": speculators_config(kind, config.gamma, verifier),
    } | (head_fields(source) if kind == "dspark" else {})
    return raw, with_vocabulary_map(source, own_tensors(source))


def to_deepspec(source: DrafterSource, target: Checkpoint, verifier: str) -> tuple[dict, dict]:
    config = source.config
    if config.drafter_type == "eagle3":
        raise ConfigError("convert --to deepspec writes DSpark and DFlash drafters")
    if not config.sample_from_anchor or config.draft_vocab_size is not None:
        raise ConfigError("DeepSpec drafters draft from the anchor row over the whole vocabulary; this drafter "
                          + ("uses the 1+N block" if not config.sample_from_anchor else "has a draft vocabulary"))
    raw = drafter_layers_config(source) | {
        "architectures": ["Qwen3DSparkModel"], "num_target_layers": config.target["num_hidden_layers"],
        "block_size": config.gamma, "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.feature_layers), "num_anchors": 512,
    } | head_fields(source)
    # DeepSpec keeps the embedding and LM head in the drafter (frozen copies of the target's)
    tensors = own_tensors(source) | {"embed_tokens.weight": source.read("embed_tokens.weight") if config.own_embedding
                                     else target.raw("model.embed_tokens.weight"),
                                     "lm_head.weight": source.read("lm_head.weight") if config.own_lm_head
                                     else target.raw(target.lm_head_name())}
    return raw, tensors


LAYOUT_WRITERS: dict[str, Callable[[DrafterSource, Checkpoint, str], tuple[dict, dict]]] = {
    "speculators": to_speculators, "deepspec": to_deepspec}


def convert_drafter(source: DrafterSource, target: Checkpoint, layout: str, out: Path, verifier: str,
                    force: bool = False) -> Path:
    """Write `source` to `out` in `layout` (`LAYOUT_WRITERS`); `verifier` names the target in the config. The
    folder appears only when complete."""
    if layout not in LAYOUT_WRITERS:
        raise ConfigError(f"unknown layout {layout!r} (choose from {', '.join(LAYOUT_WRITERS)})")
    out = Path(out)
    if out.exists() and not force:
        raise ConfigError(f"{out} already exists; pass --force to replace it")
    raw, tensors = LAYOUT_WRITERS[layout](source, target, verifier)
    floats = {dtype for _, dtype in tensors.values() if dtype in ("float32", "float16", "bfloat16")}
    if len(floats) == 1:
        raw["dtype"] = floats.pop()
    with staged(out) as folder:
        (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        write_safetensors(folder / "model.safetensors", tensors)
    return out
