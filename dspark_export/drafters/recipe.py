"""From a target and self-distillation data to a written drafter: the library side of `dspark-export train` (the
drafter's shape or the drafter to start from, the draft vocabulary, whether the target streams from its
checkpoint, the weight formats it is distilled at)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

STREAMED_TARGET_BYTES = 1 << 30  # a larger target runs layer by layer from its checkpoint while training


@dataclass(frozen=True)
class DrafterShape:
    """A new drafter's architecture (ignored when training starts from another drafter)."""

    drafter_type: str = "dspark"
    head: str = "markov"
    layers: int = 1
    gamma: int = 7
    markov_rank: int | None = None
    feature_layers: tuple[int, ...] | None = None


def train_for_target(spec, shape: DrafterShape, data: tuple[Path, ...], out: Path, cfg, *, init_from: str | None = None,
                     target_weights: tuple[str, ...] = ("fp32",), draft_vocab=None, save_dtype: str = "float32",
                     threads: int | None = None, until: int | None = None) -> bool:
    """Train a drafter for the target `spec` (resumable from `out`.run) and write it to `out` once all `cfg.steps`
    ran; whether it was written. `draft_vocab` (a `DraftVocab`) drafts over the most frequent tokens of its counts,
    by default those of `data`; `target_weights` are the formats the target is distilled at, in turn."""
    import torch

    from dspark_export.drafters.checkpoint import attach_target, build_drafter, save_drafter
    from dspark_export.drafters.data import Sequences
    from dspark_export.drafters.draft_vocab import SOURCE_KEY, token_counts, write_counts
    from dspark_export.drafters.train import new_drafter_config, train_drafter
    from dspark_export.loading import lm_head_weight, load_drafters, load_target

    # a target past STREAMED_TARGET_BYTES runs layer by layer from its checkpoint: the same features without its
    # layers in memory (7 GB at Qwen3-1.7B shapes); a new drafter over a draft vocabulary has its own LM head, so
    # the target's is read only when its logits are (2.5 GB at Qwen3-8B's)
    streamed = sum(f.stat().st_size for f in spec.require_path().glob("*.safetensors")) > STREAMED_TARGET_BYTES
    stream_head = streamed and draft_vocab is not None and init_from is None
    streaming = {"streamed": streamed, "stream_head": stream_head}
    model, tokenizer = load_target(spec, **streaming)
    start = init_from and load_drafters(spec, model, tokenizer, [init_from])[init_from]
    config = start.config if start else new_drafter_config(spec, tokenizer, shape.drafter_type, shape.head,
                                                           shape.layers, shape.gamma, shape.markov_rank,
                                                           shape.feature_layers)
    config = dataclasses.replace(config, extra=config.extra | {"distilled_from": ",".join(target_weights)})
    if draft_vocab is not None:
        draft_vocab = dataclasses.replace(draft_vocab, counts=draft_vocab.counts or data)
        ids, origin = draft_vocab.choose(spec.config.vocab_size, tokenizer.vocab_size)
        config = dataclasses.replace(config, draft_vocab_size=len(ids), own_lm_head=True,
                                     extra=config.extra | {SOURCE_KEY: origin})
    drafter = build_drafter(config)
    if start:
        drafter.load_state_dict(start.state_dict())
    attach_target(drafter, model)
    if draft_vocab is not None:
        drafter.draft_from(torch.from_numpy(ids),  # (a streamed head is read for this and let go: 2.3 GiB at 8B)
                           lm_head_weight(spec) if stream_head else model.lm_head.weight.detach())
    targets = [model if name == "fp32" else load_target(spec, weights=name, **streaming)[0] for name in target_weights]
    train_drafter(drafter, targets, Sequences.load(*data), Path(str(out) + ".run"), cfg, threads=threads, until=until)
    if until is not None and until < cfg.steps:
        return False
    save_drafter(drafter, out, save_dtype)
    write_counts(Path(out), *token_counts(data, spec.config.vocab_size, tokenizer.vocab_size))
    return True
