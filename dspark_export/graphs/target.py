"""Build `target.onnx` straight from a checkpoint (onnx + numpy only, no torch).

One step over a flattened token batch: prefill chunks and verification of several requests mixed. Its
inputs and outputs are the contract's (`dspark_common.graph_io`). Two lowerings of the same model:

- `portable` (TensorRT): attention is the `DSparkVarlenAttention` op, which TensorRT maps to its plugin; the
  new K/V of every token come out for the runtime to commit at (slot, pos);
- `ort` (ONNX Runtime, CPU or CUDA): ONNX Runtime's fused kernels. Attention is `GroupQueryAttention` over
  the requests padded per cache slot (right-padded chunks, `query_seqlens`; the runtime lays the step out),
  with the rotary embedding in the kernel and the KV cache as a past/present buffer the kernel appends to in
  place; every norm after the first is `SkipSimplifiedLayerNormalization` (the residual add fused in); q, k
  and v are one projection (the MLP's gate and up are two: see `DecoderOps.swiglu`). Where `GroupQueryAttention`
  cannot serve a shape, the attention falls back to the portable op (`attention_for`) with the rest unchanged.
  A float32 target whose products are DSpark's own operators (w4a8, GGUF K-quants: `own_products`) takes DSpark's
  `CachedAttention` in its place (runtime/dspark_common/native/attention.c: the same inputs and in-place caches),
  which computes a token the same alone and in a batch, so its greedy output needs no paired steps.

Projections go through `Weights.linear` (float, or block-quantized `MatMulNBits`), the embedding through
`Weights.embedding`; a tied LM head shares the embedding's tensor (and its codes when quantized).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from onnx import TensorProto

from dspark_export.checkpoint import Checkpoint
from dspark_export.config import DecoderConfig
from dspark_export.graphs.decoder import DecoderOps, rope_tables
from dspark_export.graphs.model_file import write_model
from dspark_export.graphs.weights import ONNX_DTYPES, ExternalData, WeightFormat, Weights
from dspark_plugins.builder import GraphBuilder
from dspark_plugins.onnx_function import varlen_attention_node
from dspark_common.graph_io import IN_PLACE_ATTENTION, target_io
from dspark_common.native import DOMAIN as DSPARK_DOMAIN

LOWERINGS = ("portable", "ort")


def attention_for(config: DecoderConfig, lowering: str, own_products: bool = False) -> str:
    """"gqa" (ONNX Runtime's GroupQueryAttention) where the `ort` lowering can use it, "cached" (DSpark's, in its
    place) where the products are DSpark's operators too, else "varlen"."""
    if lowering != "ort" or config.head_dim % 8 or config.head_dim > 256:
        return "varlen"
    return "cached" if own_products else "gqa"


def own_products(weights: WeightFormat, dtype: str, checkpoint: Checkpoint) -> bool:
    """Whether a float32 target's products run on DSpark's operators (w4a8, a GGUF's K-quant blocks)."""
    return dtype == "float32" and (weights.int4_rows or (weights.blocked and checkpoint.k_quants()))


def build_target_onnx(checkpoint: Checkpoint, graph_file: str | Path, dtype: str = "float32",
                      feature_layers: Sequence[int] = (), weights: WeightFormat = WeightFormat(),
                      lowering: str = "portable", cache_rows: int | None = None, one_slot: bool = False,
                      progress: Callable[[int], None] | None = None) -> Path:
    """Write `graph_file` and its `.data` beside it; returns the graph path. `cache_rows` (positions per cache
    slot, `ort` lowering) sizes the rotary tables; `one_slot`: the engine has one cache slot, so every step's rows
    are that slot's and need no slot layout (`slot_rows` and `token_rows` go unread; 3% of a one-token step at
    Qwen3-1.7B's shape); `progress(n)` counts tensors."""
    config = checkpoint.config
    graph_file = Path(graph_file)
    graph_file.parent.mkdir(parents=True, exist_ok=True)
    attention = attention_for(config, lowering, own_products(weights, dtype, checkpoint))
    io = target_io(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, config.vocab_size,
                   config.hidden_size * len(feature_layers), dtype, in_place=attention in IN_PLACE_ATTENTION)
    store = ExternalData(graph_file)
    stream = Weights(checkpoint.raw, store, dtype, weights, progress, carrier=checkpoint)
    b = GraphBuilder()
    ops = DecoderOps(b, stream, config.rms_norm_eps, ONNX_DTYPES[dtype], config.head_dim, lowering == "ort")
    layers = TargetLayers(b, ops, config, io, attention, cache_rows or config.max_position_embeddings, one_slot)
    x = stream.embedding(b, "input_ids", "model.embed_tokens.weight")
    h = ops.rms_norm(x, "model.layers.0.input_layernorm.weight")
    taps = [x] if -1 in feature_layers else []
    for layer in range(config.num_hidden_layers):
        h, x = layers.layer(layer, h, x)
        if layer in feature_layers:  # Hugging Face's hidden_states[layer + 1]: the last one after model.norm
            taps.append(h if layer == config.num_hidden_layers - 1 else x)
    last = b.op("Gather", h, "logit_index", axis=0)  # h is normed by model.norm after the last layer
    float32 = lambda x, name: b.op("Cast", x, to=TensorProto.FLOAT, name=name) if dtype != "float32" else \
        b.op("Identity", x, name=name)  # noqa: E731
    float32(ops.linear(last, checkpoint.lm_head_name()), "logits")
    if taps:
        float32(b.op("Concat", *taps, axis=-1) if len(taps) > 1 else taps[0], "features")
    store.close()
    metadata = {"dtype": dtype, "weights": weights.name, "lowering": lowering, "attention": attention,
                "feature_layers": json.dumps(list(feature_layers)), "config": json.dumps(config.to_hf_dict())}
    return write_model(graph_file, b, io, list(stream.initializers.values()), "target", metadata)


class TargetLayers:
    """The decoder layers in one lowering; `layer(i, h, x)` takes the layer's normed input and the residual
    stream and returns the next layer's normed input (model.norm's after the last) and the new residual."""

    def __init__(self, b: GraphBuilder, ops: DecoderOps, config: DecoderConfig, io, attention: str, cache_rows: int,
                 one_slot: bool = False):
        self.b, self.ops, self.config, self.attention, self.one_slot = b, ops, config, attention, one_slot
        self.past = (io.cache_names("past_key"), io.cache_names("past_value"))
        written = ("present_key", "present_value") if attention in IN_PLACE_ATTENTION else ("new_key", "new_value")
        self.out = tuple(io.cache_names(name) for name in written)
        d, inv_freq = config.head_dim, config.inverse_frequencies()
        self.heads = (config.num_attention_heads, config.num_key_value_heads)
        if attention in IN_PLACE_ATTENTION:
            angles = np.arange(cache_rows, dtype=np.float64)[:, None] * inv_freq[None]
            np_dtype = np.float16 if ops.dtype == TensorProto.FLOAT16 else np.float32
            self.cos, self.sin = b.const(np.cos(angles), np_dtype), b.const(np.sin(angles), np_dtype)
        else:
            self.cos, self.sin = rope_tables(b, "pos", inv_freq, ops.dtype)
            self.flat_shape = b.const([-1, config.num_attention_heads * d])

    def _to_slots(self, rows: str) -> str:
        """[T, N] -> [S, M, N], the slot-padded layout (with one slot, every row is its: the rows themselves)."""
        if self.one_slot:
            return self.b.op("Unsqueeze", rows, self.b.const([0]))
        return self.b.op("Gather", rows, "slot_rows")

    def _from_slots(self, padded: str) -> str:
        """[S, M, N] -> the batch's [T, N] rows."""
        if self.one_slot:
            return self.b.op("Squeeze", padded, self.b.const([0]))
        return self.b.op("GatherND", padded, "token_rows")

    def layer(self, layer: int, h: str, x: str) -> tuple[str, str]:
        p = f"model.layers.{layer}."
        last = layer == self.config.num_hidden_layers - 1
        next_norm = "model.norm.weight" if last else f"model.layers.{layer + 1}.input_layernorm.weight"
        return self.ops.layer(h, x, p, next_norm, lambda h: self._attention(layer, h, p + "self_attn."))

    def _attention(self, layer: int, h: str, prefix: str) -> str:
        """Attention output [T, Hq·D] of the layer's normed input; writes the layer's K/V outputs."""
        b, ops, c = self.b, self.ops, self.config
        keys, values = self.out[0][layer], self.out[1][layer]
        if self.attention == "cached":  # GroupQueryAttention's inputs and in-place caches, rows independent
            q, k, v = ops.attention_inputs(h, prefix, self.heads, c.qk_norm, c.qkv_bias, self._to_slots)
            out = b.op("CachedAttention", q, k, v, self.past[0][layer], self.past[1][layer], "seqlens_k",
                       "query_seqlens", self.cos, self.sin, names=[b.name("attention"), keys, values],
                       domain=DSPARK_DOMAIN)[0]
            return self._from_slots(out)
        if self.attention == "gqa":  # in the slot-padded layout [S, M, ...]: the runtime's slot_rows, token_rows
            q, k, v = ops.attention_inputs(h, prefix, self.heads, c.qk_norm, c.qkv_bias, self._to_slots)
            out = b.op("GroupQueryAttention", q, k, v, self.past[0][layer], self.past[1][layer], "seqlens_k",
                       "total_length", self.cos, self.sin, *[""] * 7, "query_seqlens",
                       names=[b.name("attention"), keys, values], domain="com.microsoft",
                       num_heads=c.num_attention_heads, kv_num_heads=c.num_key_value_heads, do_rotary=1,
                       scale=float(c.head_dim**-0.5))[0]
            return self._from_slots(out)  # the T real rows
        q, k, v = ops.attention_inputs(h, prefix, self.heads, c.qk_norm, c.qkv_bias)
        q, k = ops.rope(q, self.cos, self.sin), ops.rope(k, self.cos, self.sin)
        new_k, new_v = b.op("Identity", k, name=keys), b.op("Identity", v, name=values)
        attended = b.name("attention")
        b.nodes.append(varlen_attention_node([q, new_k, new_v, self.past[0][layer], self.past[1][layer], "slot", "pos",
                                              "cache_len"], attended, c.head_dim, name=f"attention_node_{layer}"))
        return b.op("Reshape", attended, self.flat_shape)

