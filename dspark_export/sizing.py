"""How big an engine is: the context a KV-cache memory budget allows, and the memory of its weights and caches.
`dspark-export build` and `dspark-export inspect` both size engines here, so they print the same numbers."""

from __future__ import annotations

from dataclasses import dataclass

from dspark_export.checkpoint import expected_shapes
from dspark_export.config import DTYPE_BYTES, DecoderConfig
from dspark_common import int4_rows, k_quant_rows
from dspark_common.errors import ConfigError
from dspark_export.graphs.weights import Carrier, Layout, WeightFormat

DEFAULT_KV_MEMORY = 512 << 20  # bytes of KV cache an engine gets unless told otherwise: one desktop chat's
DESKTOP_SLOTS = 1  # the command line's default: one chat at a time, as llama.cpp's
CONTEXT_STEP = 256  # a budget-sized context is rounded down to a multiple of this


def bytes_per_weight(layout: Layout | None, dtype: str) -> float:
    """A matrix weight's bytes: in `dtype` (float formats), else its code and its share of its block's float scale
    (and zero point, 4-bit ones two to a byte, and float32 offset)."""
    if layout is None:
        return DTYPE_BYTES[dtype]
    zero_point = layout.zero_points * (0.5 if layout.bits == 4 else 1)
    return layout.bits / 8 + (DTYPE_BYTES[dtype] + zero_point + 4 * layout.offsets) / layout.block_size


def weight_bytes(config: DecoderConfig, weights: WeightFormat, dtype: str, carrier: Carrier | None = None) -> int:
    """Bytes of an engine's target weights: projections (and embeddings) in the weight format, or in their own layout
    where a quantized engine carries a checkpoint's quantized matrices (`carrier`: a GGUF's), norms and biases in
    `dtype`."""
    matrices, vectors = config.parameter_counts()
    if weights.per_channel:  # a byte a weight (a tied embedding twice: rows to gather, columns for the head's
        # products) and a float32 scale per output channel
        tied = config.tie_word_embeddings * config.vocab_size * config.hidden_size
        return matrices + tied + 4 * output_channels(config) + vectors * DTYPE_BYTES[dtype]
    if weights.int4_rows:  # half a byte a weight and a float16 scale per 32; a tied embedding is its head's tiles
        return int(matrices * (0.5 + 2 / int4_rows.BLOCK)) + vectors * DTYPE_BYTES[dtype]
    layout = weights.bits and Layout(weights.bits, weights.block_size)
    total = int(matrices * bytes_per_weight(layout, dtype)) + vectors * DTYPE_BYTES[dtype]
    if carrier is not None and layout:
        for name, shape in expected_shapes(config).items():
            if len(shape) != 2:
                continue
            k_quant, carried = carrier.ggml_blocks(name), carrier.carried_layout(name)
            own = k_quant_rows.bytes_per_weight(k_quant[0]) if k_quant else carried and bytes_per_weight(carried, dtype)
            if own:
                total += int(shape[0] * shape[1] * (own - bytes_per_weight(layout, dtype)))
    return total


def output_channels(config: DecoderConfig) -> int:
    """Output channels of the checkpoint's matrices: q/k/v, o, gate/up, down in each layer, the embedding's rows (and
    an untied LM head's)."""
    q, kv = (heads * config.head_dim for heads in (config.num_attention_heads, config.num_key_value_heads))
    layer = q + 2 * kv + 2 * config.hidden_size + 2 * config.intermediate_size
    return config.num_hidden_layers * layer + config.vocab_size * (1 if config.tie_word_embeddings else 2)


@dataclass(frozen=True)
class EngineSize:
    slots: int
    max_context: int  # tokens of context per request
    cache_rows: int  # positions per cache slot (the context and one step's drafts)
    weight_bytes: int
    kv_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def line(self) -> str:
        return (f"weights {human_bytes(self.weight_bytes)} + KV cache {self.slots} slot(s) x {self.max_context} tokens "
                f"{human_bytes(self.kv_bytes)} = {human_bytes(self.total_bytes)}")


def size_engine(config: DecoderConfig, slots: int, dtype: str, weights: WeightFormat, gamma: int = 0,
                max_context: int | None = None, kv_memory: int | None = None,
                carrier: Carrier | None = None) -> EngineSize:
    """The engine's context (`max_context`, else the most the KV budget holds, at most the model's positions)
    and its memory (`carrier`: see `weight_bytes`). The KV cache of a drafter, a few layers, is not counted."""
    per_row = config.kv_cache_bytes(slots, 1, dtype)
    if max_context is None:
        budget = kv_memory or DEFAULT_KV_MEMORY
        fits = budget // per_row - gamma - 1
        max_context = min(
            config.max_position_embeddings, fits // CONTEXT_STEP * CONTEXT_STEP if fits >= CONTEXT_STEP else fits
        )
        if max_context < 2:
            raise ConfigError(f"a KV cache of {human_bytes(budget)} holds no context for {slots} slot(s); "
                              "raise --kv-memory or lower --cache-slots")
    elif max_context > config.max_position_embeddings:
        raise ConfigError(f"--max-context {max_context} exceeds the model's {config.max_position_embeddings} positions")
    rows = max_context + gamma + 1
    return EngineSize(slots, max_context, rows, weight_bytes(config, weights, dtype, carrier), per_row * rows)


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")
