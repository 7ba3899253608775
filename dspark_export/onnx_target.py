"""Build `target.onnx` straight from a Qwen3 checkpoint (onnx + numpy only, no torch).

One step over a flattened token batch: prefill chunks and verification of several requests mixed.
Inputs: input_ids [T], pos [T], slot [T], cache_len [S], past_key_i / past_value_i [S, Hkv, Lmax, D]
per layer, logit_index [N]. Outputs: logits [N, V] (float32, only the rows asked for), new_key_i /
new_value_i [T, Hkv, D] (the runtime commits accepted rows at (slot, pos)), and features [T, F]
(the tapped layers' outputs, concatenated) when feature layers are given. Attention is the
`DSparkVarlenAttention` op; linear layers are Gemm with transB=1 on the checkpoint's own [out, in]
weights, so nothing is transposed or duplicated (a tied LM head reuses the embedding table).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from dspark_export.checkpoint import Checkpoint
from dspark_export.onnx_weights import ONNX_DTYPES, ExternalData, convert
from dspark_plugins.onnx_function import opset_imports, varlen_attention_function, varlen_attention_node
from dspark_plugins.builder import GraphBuilder

GRAPH_FORMAT = 2  # bumped when the exporter writes different graphs: cached demo engines are rebuilt


class DecoderOps:
    """The ops of a Qwen3 decoder on [T, H] activations, appending to one GraphBuilder."""

    def __init__(self, b: GraphBuilder, weights: Callable[[str], str], eps: float, dtype: int, head_dim: int):
        self.b, self.weight, self.eps, self.dtype, self.head_dim = b, weights, eps, dtype, head_dim

    def rms_norm(self, x: str, weight_name: str) -> str:
        """Normalise in float32 over the last axis, then scale in the graph dtype (as Hugging Face does)."""
        b = self.b
        wide = b.op("Cast", x, to=TensorProto.FLOAT)
        # Pow (not Mul) so that ONNX Runtime fuses the pattern into one SimplifiedLayerNormalization
        variance = b.op("ReduceMean", b.op("Pow", wide, b.const(2.0, np.float32)), b.const([-1]), keepdims=1)
        normed = b.op("Div", wide, b.op("Sqrt", b.op("Add", variance, b.const(self.eps, np.float32))))
        return b.op("Mul", b.op("Cast", normed, to=self.dtype), self.weight(weight_name))

    def linear(self, x: str, weight_name: str) -> str:
        return self.b.op("Gemm", x, self.weight(weight_name), transB=1)

    def projected_heads(self, x: str, weight_name: str, norm_name: str, shape: str, cos: str, sin: str) -> str:
        """A Qwen3 query or key: x·Wᵀ split into heads (`shape`), RMS-normed per head, rotated."""
        return self.rope(self.rms_norm(self.b.op("Reshape", self.linear(x, weight_name), shape), norm_name), cos, sin)

    def swiglu(self, x: str, prefix: str) -> str:
        """The MLP: down(silu(gate(x)) · up(x)) with weights `{prefix}gate_proj.weight` etc."""
        b = self.b
        gate = self.linear(x, prefix + "gate_proj.weight")
        return self.linear(b.op("Mul", b.op("Mul", gate, b.op("Sigmoid", gate)), self.linear(x, prefix + "up_proj.weight")),
                           prefix + "down_proj.weight")

    def rope(self, x: str, cos: str, sin: str) -> str:
        """x·cos + rotate_half(x)·sin, with `sin` from `rope_tables` (sign folded in): rotate_half is one Gather."""
        b, half = self.b, self.head_dim // 2
        swapped = b.const(np.r_[np.arange(half, 2 * half), np.arange(half)])
        return b.op("Add", b.op("Mul", x, cos), b.op("Mul", b.op("Gather", x, swapped, axis=-1), sin))


def rope_tables(b: GraphBuilder, pos: str, head_dim: int, theta: float, factor: float, dtype: int) -> tuple[str, str]:
    """cos [T, 1, D] and the signed sin [-sin, sin] [T, 1, D] for absolute positions (float32 angles, then the
    graph dtype), for `DecoderOps.rope`."""
    inv_freq = (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) / factor).astype(np.float32)
    angles = b.op("Mul", b.op("Unsqueeze", b.op("Cast", pos, to=TensorProto.FLOAT), b.const([1])), b.const(inv_freq, np.float32))
    angles = b.op("Unsqueeze", b.op("Concat", angles, angles, axis=-1), b.const([1]))
    sign = b.const(np.repeat([-1.0, 1.0], head_dim // 2), np.float32)
    return b.op("Cast", b.op("Cos", angles), to=dtype), b.op("Cast", b.op("Mul", b.op("Sin", angles), sign), to=dtype)


def build_target_onnx(checkpoint: Checkpoint, graph_file: str | Path, dtype: str = "float32",
                      feature_layers: Sequence[int] = (), progress: Callable[[int], None] | None = None) -> Path:
    """Write `graph_file` and its `.data` beside it; returns the graph path. `progress(n)` counts tensors."""
    config = checkpoint.config
    graph_file = Path(graph_file)
    graph_file.parent.mkdir(parents=True, exist_ok=True)
    onnx_dtype = ONNX_DTYPES[dtype]
    store = ExternalData(graph_file)
    initializers: dict[str, TensorProto] = {}

    def weight(name: str) -> str:
        if name not in initializers:
            initializers[name] = store.add(name, convert(*checkpoint.raw(name), dtype), dtype)
            if progress:
                progress(1)
        return name

    b = GraphBuilder()
    ops = DecoderOps(b, weight, config.rms_norm_eps, onnx_dtype, config.head_dim)
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    x = b.op("Gather", weight("model.embed_tokens.weight"), "input_ids")
    cos, sin = rope_tables(b, "pos", d, config.rope_theta, config.rope_factor, onnx_dtype)
    q_shape, kv_shape, flat_shape = b.const([-1, hq, d]), b.const([-1, hkv, d]), b.const([-1, hq * d])
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, [s]) for n, s in
              [("input_ids", "T"), ("pos", "T"), ("slot", "T"), ("cache_len", "S"), ("logit_index", "N")]]
    outputs, taps = [], []
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        h = ops.rms_norm(x, p + "input_layernorm.weight")
        q = ops.projected_heads(h, p + "self_attn.q_proj.weight", p + "self_attn.q_norm.weight", q_shape, cos, sin)
        k = ops.projected_heads(h, p + "self_attn.k_proj.weight", p + "self_attn.k_norm.weight", kv_shape, cos, sin)
        v = b.op("Reshape", ops.linear(h, p + "self_attn.v_proj.weight"), kv_shape)
        new_k, new_v = b.op("Identity", k, name=f"new_key_{layer}"), b.op("Identity", v, name=f"new_value_{layer}")
        past_k, past_v = f"past_key_{layer}", f"past_value_{layer}"
        inputs += [helper.make_tensor_value_info(n, onnx_dtype, ["S", hkv, "Lmax", d]) for n in (past_k, past_v)]
        outputs += [helper.make_tensor_value_info(n, onnx_dtype, ["T", hkv, d]) for n in (new_k, new_v)]
        attended = f"attention_{layer}"
        b.nodes.append(varlen_attention_node([q, new_k, new_v, past_k, past_v, "slot", "pos", "cache_len"], attended, d,
                                             name=f"attention_node_{layer}"))
        x = b.op("Add", x, ops.linear(b.op("Reshape", attended, flat_shape), p + "self_attn.o_proj.weight"))
        h = ops.rms_norm(x, p + "post_attention_layernorm.weight")
        x = b.op("Add", x, ops.swiglu(h, p + "mlp."))
        if layer in feature_layers:
            taps.append(x)
    last = ops.rms_norm(b.op("Gather", x, "logit_index", axis=0), "model.norm.weight")
    b.op("Cast", ops.linear(last, checkpoint.lm_head_name()), to=TensorProto.FLOAT, name="logits")
    outputs.insert(0, helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", config.vocab_size]))
    if taps:
        b.op("Cast", b.op("Concat", *taps, axis=-1) if len(taps) > 1 else taps[0], to=TensorProto.FLOAT, name="features")
        outputs.append(helper.make_tensor_value_info("features", TensorProto.FLOAT, ["T", config.hidden_size * len(taps)]))
    store.close()
    graph = helper.make_graph(b.nodes, "dspark_target", inputs, outputs, initializer=list(initializers.values()))
    model = helper.make_model(graph, opset_imports=opset_imports(), functions=[varlen_attention_function()],
                              producer_name="dspark-export")
    metadata = {"dspark_graph": "target", "dspark_graph_format": str(GRAPH_FORMAT), "dtype": dtype,
                "feature_layers": json.dumps(list(feature_layers)), "config": json.dumps(config.to_hf_dict())}
    helper.set_model_props(model, metadata)
    onnx.save_model(model, str(graph_file))
    return graph_file
