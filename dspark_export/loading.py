"""Load a resolved target (weights + tokenizer), and drafters for it, into torch."""

from __future__ import annotations

from typing import Callable

import torch

from dspark_export.graphs.weights import WeightFormat
from dspark_export.model import DecoderModel, to_torch
from dspark_export.presets import TargetSpec
from dspark_common.errors import CheckpointError
from dspark_common.tokenizer import ChatTokenizer


def load_target(spec: TargetSpec, dtype: str = "float32", weights: str = "fp32", streamed: bool = False,
                stream_head: bool = False) -> tuple[DecoderModel, ChatTokenizer]:
    """The target model in `dtype` and its tokenizer, from the spec's checkpoint folder; with int8 or int4
    `weights`, every projection and the embedding hold the values an engine of that format computes with.
    `streamed`, `stream_head`: decoder layers (and an untied LM head) read from the checkpoint as they run
    (`DecoderModel.from_checkpoint`)."""
    folder = spec.require_path()
    tokenizer = ChatTokenizer.from_dir(folder)
    if tokenizer.vocab_size > spec.config.vocab_size:
        raise CheckpointError(
            f"the tokenizer in {folder} has {tokenizer.vocab_size} tokens but the model only {spec.config.vocab_size}"
        )
    fmt = WeightFormat(weights)
    return DecoderModel.from_checkpoint(spec.checkpoint(), dtype, streamed,
                                      quantizer(fmt) if fmt.bits else None, stream_head), tokenizer


def lm_head_weight(spec: TargetSpec) -> torch.Tensor:
    """The target's LM head [V, H] in float32, read from its checkpoint (for a model that streams it)."""
    checkpoint = spec.checkpoint()
    return to_torch(*checkpoint.raw(checkpoint.lm_head_name())).float()


def quantizer(weights: WeightFormat) -> Callable:
    """A tensor -> its block-quantized values (as `dspark_export.graphs` stores them) for every matrix whose rows
    split into blocks: features and logits as an int8/int4 engine's, up to its int8 activations."""
    from dspark_export.graphs.weights import quantized_values

    def quantize(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.ndim != 2 or tensor.shape[1] % weights.block_size:
            return tensor
        rows = tensor.float().numpy()
        return torch.from_numpy(quantized_values(rows, weights.bits, weights.block_size)).to(tensor.dtype)

    return quantize


def load_drafters(spec: TargetSpec, model: DecoderModel, tokenizer: ChatTokenizer, names: list[str],
                  draft_vocab=None) -> dict:
    """Torch drafters for the target, by folder, bundled name or cached repo id, in any layout DSpark reads;
    with a `DraftVocab`, each pruned to it."""
    from dspark_export.drafters.bundled import resolve_drafter
    from dspark_export.drafters.checkpoint import load_drafter
    from dspark_export.drafters.draft_vocab import with_draft_vocab
    from dspark_export.interop import open_drafter

    checkpoint = spec.checkpoint()
    chosen = draft_vocab and draft_vocab.choose(spec.config.vocab_size, tokenizer.vocab_size)
    drafters = {}
    for name in names:
        source = open_drafter(resolve_drafter(name), spec.config, checkpoint, tokenizer)
        drafters[name] = load_drafter(with_draft_vocab(source, checkpoint, *chosen) if chosen else source, model)
    return drafters
