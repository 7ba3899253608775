"""The decoder architectures DSpark targets (Qwen3, Qwen2.5, Llama-3.x): one frozen dataclass, read from a Hugging
Face `config.json` or a named preset, and the one rotary-frequency table every model and graph uses.

The three differ only in a few fields: Qwen3 norms q and k per head, Qwen2.5 adds biases to the q, k and v
projections, Llama-3.x scales its rotary frequencies (`llama3`); tied embeddings and head size vary by size.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from dspark_common.errors import CheckpointError, ConfigError, read_json_file

DTYPES = ("float32", "float16", "bfloat16")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Architecture:
    """What a Hugging Face `model_type` means for the decoder layer."""

    hf_class: str  # `architectures[0]` in config.json
    qk_norm: bool  # RMSNorm over each head of q and k, before the rotation
    qkv_bias: bool  # q_proj, k_proj and v_proj have biases


ARCHITECTURES = {
    "qwen3": Architecture("Qwen3ForCausalLM", qk_norm=True, qkv_bias=False),
    "qwen2": Architecture("Qwen2ForCausalLM", qk_norm=False, qkv_bias=True),
    "llama": Architecture("LlamaForCausalLM", qk_norm=False, qkv_bias=False),
}


def architecture_of(model_type: str | None) -> Architecture:
    """The architecture a config.json's `model_type` names, or one line saying which DSpark supports."""
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"unsupported architecture: model_type {model_type!r} "
                          f"(DSpark supports {', '.join(map(repr, ARCHITECTURES))})")
    return ARCHITECTURES[model_type]


def llama3_scaled(inv_freq: np.ndarray, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """Llama 3's rotary scaling, as Meta's reference: long wavelengths divided by `factor`, short ones kept, a blend
    between the bands original/low and original/high."""
    wavelength = 2 * math.pi / inv_freq
    blend = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
    return (1 - blend) * inv_freq / factor + blend * inv_freq


@dataclass(frozen=True)
class DecoderConfig:
    """The numbers that define a decoder (names as in Hugging Face's configs)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_type: str = "default"  # one of ROPE_TYPES
    rope_factor: float = 1.0  # linear and llama3 scaling: how much longer the context is than trained for
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths past original/low are scaled fully
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original/high are kept
    rope_original_max_position: int = 8192  # llama3: the context the model was first trained for
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    dtype: str = "bfloat16"  # the checkpoint's storage dtype
    model_type: str = "qwen3"  # a key of ARCHITECTURES

    def __post_init__(self) -> None:
        architecture_of(self.model_type)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope scaling {self.rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        if self.rope_type == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ConfigError("llama3 rope scaling needs high_freq_factor > low_freq_factor")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported (supported: {', '.join(DTYPES)})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def architecture(self) -> Architecture:
        return architecture_of(self.model_type)

    @property
    def qk_norm(self) -> bool:
        return self.architecture.qk_norm

    @property
    def qkv_bias(self) -> bool:
        return self.architecture.qkv_bias

    def inverse_frequencies(self) -> np.ndarray:
        """The rotary frequencies [head_dim / 2] (float32), with the config's scaling applied: the one table the
        torch model, the drafters and every graph rotate by."""
        inv_freq = 1.0 / self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        if self.rope_type == "linear":
            inv_freq = inv_freq / self.rope_factor
        elif self.rope_type == "llama3":
            inv_freq = llama3_scaled(inv_freq, self.rope_factor, self.rope_low_freq_factor,
                                     self.rope_high_freq_factor, self.rope_original_max_position)
        return inv_freq.astype(np.float32)

    def parameter_counts(self) -> tuple[int, int]:
        """(weights in matrices, weights in vectors: norms and biases) of the checkpoint, a tied LM head once."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        layer = h * (2 * q + 2 * kv) + 3 * h * self.intermediate_size
        matrices = self.num_hidden_layers * layer + self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        vectors = 2 * h + (2 * d if self.qk_norm else 0) + (q + 2 * kv if self.qkv_bias else 0)
        return matrices, self.num_hidden_layers * vectors + h

    def input_widths(self) -> tuple[int, int, int]:
        """The widths the projections read (hidden size first): what a quantization block must divide."""
        return self.hidden_size, self.intermediate_size, self.num_attention_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count of the checkpoint (the tied LM head counted once)."""
        return sum(self.parameter_counts())

    def kv_cache_bytes(self, slots: int, context: int, dtype: str | None = None) -> int:
        """Bytes of a key/value cache holding `context` positions for each of `slots` requests."""
        per_token = 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim
        return per_token * context * slots * DTYPE_BYTES[dtype or self.dtype]

    def architecture_fields(self) -> dict[str, Any]:
        """The fields that must agree for two checkpoints to share a preset (dtype and context excluded)."""
        fields = asdict(self)
        del fields["dtype"], fields["max_position_embeddings"]
        return fields

    def rope_parameters(self) -> dict[str, Any]:
        """The rotary settings as config.json's `rope_parameters` (transformers 5) / `rope_scaling` (4.x)."""
        rope: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type != "default":
            rope["factor"] = self.rope_factor
        if self.rope_type == "llama3":
            rope |= {"low_freq_factor": self.rope_low_freq_factor, "high_freq_factor": self.rope_high_freq_factor,
                     "original_max_position_embeddings": self.rope_original_max_position}
        return rope

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` that both `transformers` and `from_hf_dict` read."""
        rope = self.rope_parameters()
        return {
            "architectures": [self.architecture.hf_class],
            "model_type": self.model_type,
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
            "mlp_bias": False,
            "use_sliding_window": False,
            "torch_dtype": self.dtype,
            "dtype": self.dtype,
        }

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "DecoderConfig":
        """Read a Hugging Face `config.json` (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
        model_type = raw.get("model_type")
        name = architecture_of(model_type).hf_class.removesuffix("ForCausalLM")
        if model_type != "qwen2" and raw.get("attention_bias"):  # Qwen2's biases are q/k/v only and always there
            raise ConfigError(f"unsupported {name} variant: attention_bias=true")
        for flag in ("mlp_bias", "use_sliding_window"):
            if raw.get(flag):
                raise ConfigError(f"unsupported {name} variant: {flag}=true")
        if any(kind != "full_attention" for kind in raw.get("layer_types") or ()):
            raise ConfigError(f"unsupported {name} variant: sliding-window layers (layer_types)")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported activation {raw['hidden_act']!r} ({name} uses 'silu')")
        if raw.get("pretraining_tp", 1) != 1:
            raise ConfigError(f"unsupported {name} variant: pretraining_tp={raw['pretraining_tp']}")
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
                num_key_value_heads=raw.get("num_key_value_heads") or heads,
                head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta),
                rope_type=rope_type,
                rope_factor=float(rope.get("factor", 1.0)),
                rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                rope_original_max_position=int(rope.get("original_max_position_embeddings", 8192)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                max_position_embeddings=raw.get("max_position_embeddings", 40960),
                dtype=raw.get("dtype") or raw.get("torch_dtype") or "bfloat16",
                model_type=model_type,
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks the field {exc.args[0]!r}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> "DecoderConfig":
        return cls.from_hf_dict(read_json_file(Path(path) / "config.json", CheckpointError))

    def with_dtype(self, dtype: str) -> "DecoderConfig":
        return replace(self, dtype=dtype)
