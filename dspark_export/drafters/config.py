"""Drafter configuration: one frozen dataclass, saved as `config.json` next to `model.safetensors`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dspark_export.config import DecoderConfig
from dspark_common.errors import CheckpointError, ConfigError, read_json_file
from dspark_common.graph_io import DRAFTER_TYPES

HEADS = ("markov", "gated", "rnn", "none")  # DeepSpec's markov_head_type names "markov" `vanilla`


def default_feature_layers(target_layers: int, drafter_layers: int) -> tuple[int, ...]:
    """One target layer per drafter layer, evenly spaced from 1 to L-3 (never the last); L//2 for one layer."""
    if drafter_layers == 1:
        return (target_layers // 2,)
    last = target_layers - 3
    return tuple(round(1 + i * (last - 1) / (drafter_layers - 1)) for i in range(drafter_layers))


def default_markov_rank(vocab_size: int) -> int:
    """r = 256 for Qwen3's 152k vocabulary (the paper), scaled down so 2·V·r stays small for small vocabularies."""
    return 256 if vocab_size > 65536 else 64


@dataclass(frozen=True)
class DrafterConfig:
    """A drafter's architecture. Knobs beyond our own defaults exist so that every published DSpark, DFlash
    and EAGLE-3 layout (`dspark_export.interop`) maps onto one model, one graph and one trainer."""

    drafter_type: str  # "dspark" | "dflash" | "eagle3"
    target: dict[str, Any]  # the target's DecoderConfig fields (architecture_fields())
    vocab_hash: str | None  # fingerprint of the target tokenizer's vocabulary (None: imported, size checked only)
    mask_token_id: int
    num_layers: int = 1
    gamma: int = 7  # γ: draft tokens per round
    feature_layers: tuple[int, ...] = ()  # layer l: Hugging Face's hidden_states[l + 1] of the target (-1: embeddings)
    head: str = "markov"  # sequential head: "markov" | "gated" | "rnn" | "none"
    markov_rank: int = 64
    confidence: bool = True
    confidence_with_markov: bool = True  # the confidence head also reads W1[previous token]
    sample_from_anchor: bool = True  # block [anchor, MASK x (γ-1)] drafts from every row; False: 1+γ rows, row 0 idle
    draft_vocab_size: int | None = None  # drafts over a vocabulary subset; `d2t` maps its ids to the target's
    own_embedding: bool = False  # the weights hold `embed_tokens.weight` (else the target's is shared)
    own_lm_head: bool = False  # the weights hold `lm_head.weight` (always with a draft vocabulary)
    qk_norm: bool = True  # EAGLE-3: per-head q/k norms (Qwen3-based; Llama-based drafters have none)
    norm_before_residual: bool = False  # EAGLE-3: the residual is the normed hidden state
    intermediate_size: int | None = None  # default: the target's
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes (training, the imported format)

    def __post_init__(self) -> None:
        if self.drafter_type not in DRAFTER_TYPES:
            raise ConfigError(f"unknown drafter type {self.drafter_type!r} (known: {', '.join(DRAFTER_TYPES)})")
        if self.head not in HEADS:
            raise ConfigError(f"unknown sequential head {self.head!r} (known: {', '.join(HEADS)})")
        if self.gamma < 1 or self.num_layers < 1:
            raise ConfigError("gamma and num_layers must be at least 1")
        if self.drafter_type == "eagle3" and self.num_layers != 1:
            raise ConfigError(f"EAGLE-3 drafters run here with exactly one decoder layer, not {self.num_layers}")
        if self.drafter_type != "eagle3" and (not self.qk_norm or self.norm_before_residual):
            raise ConfigError("qk_norm and norm_before_residual are EAGLE-3 knobs; a block drafter's layers are "
                              "the target's")
        depth = self.target["num_hidden_layers"]
        bad = [layer for layer in self.feature_layers if not -1 <= layer < depth]
        if bad or not self.feature_layers or list(self.feature_layers) != sorted(set(self.feature_layers)):
            raise ConfigError(
                f"target layers {list(self.feature_layers)} must increase and lie within -1..{depth - 1} (the target "
                f"has {depth} layers; layer i is the output of decoder layer i, Hugging Face's hidden_states[i + 1])"
            )
        if self.confidence and self.confidence_with_markov and self.head == "none":
            raise ConfigError("a confidence head with Markov features needs a sequential head (markov, gated or rnn)")
        vocab = self.target["vocab_size"]
        if self.draft_vocab_size is not None and not (0 < self.draft_vocab_size <= vocab and self.own_lm_head):
            raise ConfigError(f"a draft vocabulary needs its own LM head and at most the target's {vocab} tokens")
        if not 0 <= self.mask_token_id < vocab:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is outside the target's vocabulary of {vocab}")

    @property
    def block_rows(self) -> int:
        """Rows of one draft block: γ, or 1 + γ when the anchor row only carries the anchor."""
        return self.gamma + (0 if self.sample_from_anchor else 1)

    @property
    def drafted_vocab(self) -> int:
        """The vocabulary the LM head and the sequential head score."""
        return self.draft_vocab_size or self.target["vocab_size"]

    @property
    def confidence_width(self) -> int:
        """Input width of the confidence head: the hidden state, plus W1[previous token] with Markov features."""
        markov = self.markov_rank if self.confidence_with_markov else 0
        return self.target["hidden_size"] + markov

    def shared_names(self) -> tuple[str, ...]:
        """Tensors the drafter takes from the target (frozen) instead of storing them."""
        return tuple(name for name, own in (("embed_tokens.weight", self.own_embedding),
                                            ("lm_head.weight", self.own_lm_head)) if not own)

    @property
    def target_config(self) -> DecoderConfig:
        return DecoderConfig(**self.target)

    def check_target(self, target: DecoderConfig, vocab_hash: str | None) -> None:
        """Refuse a target this drafter was not trained for, naming what differs."""
        mine = self.target_config
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "head_dim"):
            if getattr(mine, name) != getattr(target, name):
                raise ConfigError(
                    f"drafter was trained for a target with {name}={getattr(mine, name)}, "
                    f"but this target has {name}={getattr(target, name)}"
                )
        if None not in (vocab_hash, self.vocab_hash) and vocab_hash != self.vocab_hash:
            raise ConfigError("drafter vocabulary does not match the target tokenizer's (vocabulary hash differs)")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], file: Path) -> "DrafterConfig":
        """Our `config.json` (read from `file`, named in errors)."""
        if "block" in raw:  # drafters trained before γ was named `gamma`
            raw = {k: v for k, v in raw.items() if k != "block"} | {"gamma": raw["block"]}
        try:
            return cls(**(raw | {"feature_layers": tuple(raw["feature_layers"])}))
        except (TypeError, KeyError) as exc:
            raise CheckpointError(f"{file} is not a DSpark drafter config: {exc}") from None

    @classmethod
    def from_dir(cls, folder: str | Path) -> "DrafterConfig":
        file = Path(folder) / "config.json"
        return cls.from_dict(read_json_file(file, CheckpointError), file)
