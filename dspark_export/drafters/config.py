"""Drafter configuration: one frozen dataclass, saved as `config.json` next to `model.safetensors`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dspark_export.config import Qwen3Config
from dspark_export.errors import CheckpointError, ConfigError
from dspark_runtime.errors import read_json_file
from dspark_runtime.graph_io import DRAFTER_TYPES

HEADS = ("markov", "rnn", "none")


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
    drafter_type: str  # "dspark" | "dflash" | "eagle3"
    target: dict[str, Any]  # the target's Qwen3Config fields (architecture_fields())
    vocab_hash: str  # fingerprint of the target tokenizer's vocabulary
    mask_token_id: int
    num_layers: int = 1
    gamma: int = 7  # γ: draft tokens per round
    feature_layers: tuple[int, ...] = ()
    head: str = "markov"  # sequential head: "markov" | "rnn" | "none"
    markov_rank: int = 64
    confidence: bool = True
    intermediate_size: int | None = None  # default: the target's
    extra: dict[str, Any] = field(default_factory=dict)  # free-form training notes

    def __post_init__(self) -> None:
        if self.drafter_type not in DRAFTER_TYPES:
            raise ConfigError(f"unknown drafter type {self.drafter_type!r} (known: {', '.join(DRAFTER_TYPES)})")
        if self.head not in HEADS:
            raise ConfigError(f"unknown sequential head {self.head!r} (known: {', '.join(HEADS)})")
        if self.gamma < 1 or self.num_layers < 1:
            raise ConfigError("gamma and num_layers must be at least 1")
        if self.drafter_type == "eagle3" and self.num_layers != 1:
            raise ConfigError("the EAGLE-3 baseline has exactly one decoder layer (num_layers 1)")
        depth = self.target["num_hidden_layers"]
        bad = [layer for layer in self.feature_layers if not 0 <= layer < depth - 1]
        if bad or not self.feature_layers:
            raise ConfigError(
                f"feature layers {list(self.feature_layers)} must be non-empty and within 0..{depth - 2} "
                f"(the target has {depth} layers; its last layer is never a feature layer)"
            )
        if self.confidence and self.head == "none":
            raise ConfigError("the confidence head reads the sequential head's token embedding: it needs head markov or rnn")

    @property
    def target_config(self) -> Qwen3Config:
        return Qwen3Config(**self.target)

    def check_target(self, target: Qwen3Config, vocab_hash: str | None) -> None:
        """Refuse a target this drafter was not trained for, naming what differs."""
        mine = self.target_config
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "head_dim"):
            if getattr(mine, name) != getattr(target, name):
                raise ConfigError(
                    f"drafter was trained for a target with {name}={getattr(mine, name)}, "
                    f"but this target has {name}={getattr(target, name)}"
                )
        if vocab_hash is not None and vocab_hash != self.vocab_hash:
            raise ConfigError("drafter vocabulary does not match the target tokenizer's (vocabulary hash differs)")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_dir(cls, folder: str | Path) -> "DrafterConfig":
        file = Path(folder) / "config.json"
        raw = read_json_file(file, CheckpointError)
        if "block" in raw:  # drafters trained before γ was named `gamma`
            raw["gamma"] = raw.pop("block")
        try:
            return cls(**(raw | {"feature_layers": tuple(raw["feature_layers"])}))
        except (TypeError, KeyError) as exc:
            raise CheckpointError(f"{file} is not a DSpark drafter config: {exc}") from None
