"""Drafters in and out of DSpark: the published layouts a drafter folder may use, read into our view
(`DrafterSource`), and ours written out in the layouts vLLM and other engines load (`export`).

Read: ours (`drafter_type` in config.json), DeepSpec's `Qwen3DSparkModel`, speculators' `dspark`, `dflash`
and `eagle3` (0.9.0), z-lab's `DFlashDraftModel`, SpecForge's EAGLE-3 (`LlamaForCausalLMEagle3`).

Target layers follow one convention inside DSpark: layer i is the output of decoder layer i (Hugging Face
`hidden_states[i + 1]`), -1 the embeddings; speculators counts from the embeddings (its i is our i - 1), and
the readers translate.
"""

from __future__ import annotations

from pathlib import Path

from dspark_export.checkpoint import Checkpoint, index_tensors
from dspark_export.config import DecoderConfig
from dspark_common.errors import CheckpointError, ConfigError, read_json_file
from dspark_export.interop import deepspec, native, specforge, speculators, zlab
from dspark_export.interop.source import DrafterSource, Target

LAYOUTS = (native, deepspec, speculators, zlab, specforge)


def open_drafter(folder: str | Path, config: DecoderConfig, checkpoint: Checkpoint | None = None,
                 tokenizer=None) -> DrafterSource:
    """Read the drafter in `folder` for the target of `config`; a layout DSpark cannot run is refused with one
    line. The target's `checkpoint` lets stored copies of its embedding and LM head be shared; its `ChatTokenizer`
    tells padding rows from tokens and checks our drafters' vocabulary fingerprint."""
    folder = Path(folder)
    raw = read_json_file(folder / "config.json", CheckpointError)
    layout = next((layout for layout in LAYOUTS if layout.matches(raw)), None)
    if layout is None:
        kinds = raw.get("architectures") or raw.get("model_type") or "none"
        known = "; ".join(layout.DESCRIPTION for layout in LAYOUTS)
        raise ConfigError(
            f"{folder / 'config.json'} names an unknown drafter architecture {kinds} (DSpark reads: {known})"
        )
    return layout.read(folder, raw, index_tensors(folder), Target(config, checkpoint, tokenizer))


__all__ = ["DrafterSource", "LAYOUTS", "Target", "open_drafter"]
