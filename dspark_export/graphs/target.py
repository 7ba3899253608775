"""Build `target.onnx` straight from a Qwen3 checkpoint (onnx + numpy only, no torch).

One step over a flattened token batch: prefill chunks and verification of several requests mixed. Its
inputs and outputs are the contract's (`dspark_runtime.graph_io.TARGET_IO`): the new K/V of every token
come out for the runtime to commit at (slot, pos), the logits only for the rows asked for, and the tapped
layers' outputs (`features`) when feature layers are given. Attention is the `DSparkVarlenAttention` op;
projections go through `Weights.linear` on the checkpoint's own [out, in] weights (a tied LM head reuses
the embedding table).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

from onnx import TensorProto

from dspark_export.checkpoint import Checkpoint
from dspark_export.graphs.decoder import DecoderOps, rope_tables
from dspark_export.graphs.model_file import write_model
from dspark_export.graphs.weights import ONNX_DTYPES, ExternalData, Weights
from dspark_plugins.builder import GraphBuilder
from dspark_plugins.onnx_function import varlen_attention_node
from dspark_runtime.graph_io import target_io


def build_target_onnx(checkpoint: Checkpoint, graph_file: str | Path, dtype: str = "float32",
                      feature_layers: Sequence[int] = (), progress: Callable[[int], None] | None = None) -> Path:
    """Write `graph_file` and its `.data` beside it; returns the graph path. `progress(n)` counts tensors."""
    config = checkpoint.config
    graph_file = Path(graph_file)
    graph_file.parent.mkdir(parents=True, exist_ok=True)
    io = target_io(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, config.vocab_size,
                   config.hidden_size * len(feature_layers), dtype)
    onnx_dtype = ONNX_DTYPES[dtype]
    store = ExternalData(graph_file)
    weights = Weights(checkpoint.raw, store, dtype, progress=progress)
    b = GraphBuilder()
    ops = DecoderOps(b, weights, config.rms_norm_eps, onnx_dtype, config.head_dim)
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    x = b.op("Gather", weights("model.embed_tokens.weight"), "input_ids")
    cos, sin = rope_tables(b, "pos", d, config.rope_theta, config.rope_factor, onnx_dtype)
    q_shape, kv_shape, flat_shape = b.const([-1, hq, d]), b.const([-1, hkv, d]), b.const([-1, hq * d])
    past_keys, past_values = io.cache_names("past_key"), io.cache_names("past_value")
    new_keys, new_values = io.cache_names("new_key"), io.cache_names("new_value")
    taps = []
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        h = ops.rms_norm(x, p + "input_layernorm.weight")
        q = ops.projected_heads(h, p + "self_attn.q_proj.weight", p + "self_attn.q_norm.weight", q_shape, cos, sin)
        k = ops.projected_heads(h, p + "self_attn.k_proj.weight", p + "self_attn.k_norm.weight", kv_shape, cos, sin)
        v = b.op("Reshape", ops.linear(h, p + "self_attn.v_proj.weight"), kv_shape)
        new_k, new_v = b.op("Identity", k, name=new_keys[layer]), b.op("Identity", v, name=new_values[layer])
        attended = f"attention_{layer}"
        b.nodes.append(varlen_attention_node([q, new_k, new_v, past_keys[layer], past_values[layer], "slot", "pos",
                                              "cache_len"], attended, d, name=f"attention_node_{layer}"))
        x = b.op("Add", x, ops.linear(b.op("Reshape", attended, flat_shape), p + "self_attn.o_proj.weight"))
        h = ops.rms_norm(x, p + "post_attention_layernorm.weight")
        x = b.op("Add", x, ops.swiglu(h, p + "mlp."))
        if layer in feature_layers:
            taps.append(x)
    last = ops.rms_norm(b.op("Gather", x, "logit_index", axis=0), "model.norm.weight")
    b.op("Cast", ops.linear(last, checkpoint.lm_head_name()), to=TensorProto.FLOAT, name="logits")
    if taps:
        b.op("Cast", b.op("Concat", *taps, axis=-1) if len(taps) > 1 else taps[0], to=TensorProto.FLOAT, name="features")
    store.close()
    metadata = {"dtype": dtype, "feature_layers": json.dumps(list(feature_layers)), "config": json.dumps(config.to_hf_dict())}
    return write_model(graph_file, b, io, list(weights.initializers.values()), "target", metadata)
