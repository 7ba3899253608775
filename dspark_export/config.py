"""Qwen3 architecture: one frozen dataclass, read from a Hugging Face `config.json` or a named preset."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from dspark_runtime.errors import CheckpointError, ConfigError, read_json_file

SUPPORTED_ROPE = ("default", "linear")
DTYPES = ("float32", "float16", "bfloat16")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Qwen3Config:
    """The numbers that define a Qwen3 decoder (names as in Hugging Face's `Qwen3Config`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_type: str = "default"  # "default" or "linear"
    rope_factor: float = 1.0  # linear scaling divides positions by this
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    dtype: str = "bfloat16"  # the checkpoint's storage dtype

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_type not in SUPPORTED_ROPE:
            raise ConfigError(
                f"rope scaling {self.rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE)})"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported (supported: {', '.join(DTYPES)})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    def num_parameters(self) -> int:
        """Parameter count of the checkpoint (the tied LM head counted once)."""
        h, d = self.hidden_size, self.head_dim
        attention = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads) + 2 * d
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_hidden_layers * layer + h

    def kv_cache_bytes(self, slots: int, context: int, dtype: str | None = None) -> int:
        """Bytes of a key/value cache holding `context` positions for each of `slots` requests."""
        per_token = 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim
        return per_token * context * slots * DTYPE_BYTES[dtype or self.dtype]

    def architecture_fields(self) -> dict[str, Any]:
        """The fields that must agree for two checkpoints to share a preset (dtype and context excluded)."""
        fields = asdict(self)
        del fields["dtype"], fields["max_position_embeddings"]
        return fields

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` that both `transformers` and `from_hf_dict` read."""
        rope: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "linear":
            rope["factor"] = self.rope_factor
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "rope_scaling": None if self.rope_type == "default" else rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "use_sliding_window": False,
            "torch_dtype": self.dtype,
            "dtype": self.dtype,
        }

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "Qwen3Config":
        """Read a Hugging Face `config.json` (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
        model_type = raw.get("model_type")
        if model_type != "qwen3":
            raise ConfigError(f"unsupported architecture: model_type {model_type!r} (DSpark supports 'qwen3')")
        if raw.get("attention_bias"):
            raise ConfigError("unsupported Qwen3 variant: attention_bias=true")
        if raw.get("use_sliding_window"):
            raise ConfigError("unsupported Qwen3 variant: use_sliding_window=true")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported activation {raw['hidden_act']!r} (Qwen3 uses 'silu')")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0))
        try:
            heads = raw["num_attention_heads"]
            return cls(
                vocab_size=raw["vocab_size"],
                hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                num_hidden_layers=raw["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=raw.get("num_key_value_heads", heads),
                head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta),
                rope_type=rope_type,
                rope_factor=float(rope.get("factor", 1.0)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                max_position_embeddings=raw.get("max_position_embeddings", 40960),
                dtype=raw.get("dtype") or raw.get("torch_dtype") or "bfloat16",
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks the field {exc.args[0]!r}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> "Qwen3Config":
        return cls.from_hf_dict(read_json_file(Path(path) / "config.json", CheckpointError))

    def with_dtype(self, dtype: str) -> "Qwen3Config":
        return replace(self, dtype=dtype)
