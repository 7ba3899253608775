"""`DSparkVarlenAttention` as an ONNX model-local function with a standard-op body.

ONNX Runtime inlines the body; TensorRT >= 10.7 swaps in the registered plugin because the call node
carries `plugin_namespace`/`plugin_version`. The body takes the A slots that have tokens in the call
(Unique), pads each request's new tokens to [A, n_max] (a Gather at (slot, offset in request)), runs one
batched attention per request against its own cache rows (masked beyond `cache_len`), and unpads with
GatherND; idle slots cost nothing. Scores and softmax are float32 for
every input precision. (Measured on ONNX Runtime's CPU provider: the padded body is the best standard-op
form for batches; attending over the whole flattened cache or gathering per token is 5-20x slower.)
"""

from __future__ import annotations

import math

import numpy as np
from onnx import FunctionProto, NodeProto, TensorProto, helper

from dspark_plugins.builder import GraphBuilder
from dspark_plugins.contract import DOMAIN, INPUTS, OP_TYPE, OUTPUTS, PLUGIN_NAMESPACE, PLUGIN_VERSION

OPSET = 21
NEG = -1e30  # masked score; scores are float32, so half-precision graphs do not overflow


def varlen_attention_function() -> FunctionProto:
    """The FunctionProto (domain `dspark`), with attributes `bidirectional` (int 0/1) and `scale` (float)."""
    b = GraphBuilder("va_")
    zero, one = b.const(0), b.const(1)
    ax0, ax1, ax2, last = b.const([0]), b.const([1]), b.const([2]), b.const([-1])
    # the index bookkeeping below reads only slot, pos and cache_len, which every layer shares, so that
    # ONNX Runtime computes it once per step (common-subexpression elimination across the inlined calls)
    # only the slots that have tokens in this call take part: A active slots, each token's index among them
    active, _, local, counts = b.op("Unique", "slot", outputs=4, sorted=1)  # [A], -, [T], [A]
    slots_n = b.op("Shape", active)  # [1]
    active_len = b.op("Gather", "cache_len", active)  # [A]
    q_heads, dim = b.op("Shape", "q", start=1, end=2), b.op("Shape", "q", start=2, end=3)
    kv_heads = b.op("Shape", "k_new", start=1, end=2)
    group = b.op("Div", q_heads, kv_heads)

    # offset of each token inside its request = how many earlier tokens share its slot
    slot_ids = b.op("Range", zero, b.op("Squeeze", slots_n, ax0), one)  # [A]
    slot_col = b.op("Unsqueeze", local, last)  # [T, 1]
    member = b.op("Cast", b.op("Equal", slot_col, slot_ids), to=TensorProto.INT64)  # [T, A]
    earlier = b.op("CumSum", member, zero, exclusive=1)  # [T, A]
    offset = b.op("Squeeze", b.op("GatherElements", earlier, slot_col, axis=1), last)  # [T]
    n_max = b.op("ReduceMax", counts, ax0, keepdims=1)  # [1]
    pad_index = b.op("Concat", slot_col, b.op("Unsqueeze", offset, last), axis=1)  # [T, 2]

    # padded row (s, j) reads token index_map[s, j]; rows past a request's tokens read an appended zero row
    tokens_n = b.op("Shape", "slot")  # [1]
    fill = b.op("Expand", tokens_n, b.op("Concat", slots_n, n_max, axis=0))  # [A, n_max], all T
    index_map = b.op("ScatterND", fill, pad_index, b.op("Range", zero, b.op("Squeeze", tokens_n, ax0), one))
    zero_row = b.const([0, 0, 0, 1, 0, 0])

    def pad(values: str) -> str:
        """[T, H, D] -> [A, n_max, H, D], zeros where a request has fewer tokens."""
        return b.op("Gather", b.op("Pad", values, zero_row), index_map, axis=0)

    q_pad, k_pad, v_pad = pad("q"), pad("k_new"), pad("v_new")
    minus_one = helper.make_tensor("minus_one", TensorProto.INT64, [1], [-1])
    pos_pad = b.op("ScatterND", b.op("ConstantOfShape", b.op("Concat", slots_n, n_max, axis=0), value=minus_one),
                   pad_index, "pos")  # [A, n_max]; -1 marks padding

    # queries grouped by their KV head: [A, n, Hkv, g, D] -> [A, Hkv, g, n, D], float32
    q5 = b.op("Reshape", q_pad, b.op("Concat", slots_n, n_max, kv_heads, group, dim, axis=0))
    q32 = b.op("Cast", b.op("Transpose", q5, perm=[0, 2, 3, 1, 4]), to=TensorProto.FLOAT)
    scale = b.attribute_const("scale", "float")

    # scores against the request's own cache rows, read only up to the longest committed length: [A, Hkv, g, n, L].
    # GatherND by (slot, head, position) copies just those rows; a Gather of whole slots would copy Lmax rows each.
    live = b.op("ReduceMax", active_len, ax0, keepdims=1)  # [1]
    key_ids = b.op("Range", zero, b.op("Squeeze", live, ax0), one)  # [L]
    grid = b.op("Concat", slots_n, kv_heads, live, axis=0)
    rows = [
        b.op("Unsqueeze", b.op("Expand", b.op("Reshape", ids, b.const(shape)), grid), last)
        for ids, shape in (
            (active, [-1, 1, 1]),
            (b.op("Range", zero, b.op("Squeeze", kv_heads, ax0), one), [1, -1, 1]),
            (key_ids, [1, 1, -1]),
        )
    ]
    cache_rows = b.op("Concat", *rows, axis=-1)  # [A, Hkv, L, 3]
    k_live, v_live = (b.op("GatherND", cache, cache_rows) for cache in ("k_cache", "v_cache"))  # [A, Hkv, L, D]
    k_cache32 = b.op("Cast", b.op("Unsqueeze", k_live, ax2), to=TensorProto.FLOAT)  # [A, Hkv, 1, L, D]
    cache_scores = b.op("Mul", b.op("MatMul", q32, b.op("Transpose", k_cache32, perm=[0, 1, 2, 4, 3])), scale)
    cache_visible = b.op("Less", key_ids, b.op("Unsqueeze", active_len, last))  # [A, L]
    cache_mask = b.op("Unsqueeze", cache_visible, b.const([1, 2, 3]))  # [A, 1, 1, 1, Lmax]
    neg = b.const(NEG, np.float32)
    cache_scores = b.op("Where", cache_mask, cache_scores, neg)

    # scores against the request's new tokens: [A, Hkv, g, n, n]
    k_new5 = b.op("Unsqueeze", b.op("Transpose", k_pad, perm=[0, 2, 1, 3]), ax2)  # [A, Hkv, 1, n, D]
    k_new32 = b.op("Cast", k_new5, to=TensorProto.FLOAT)
    new_scores = b.op("Mul", b.op("MatMul", q32, b.op("Transpose", k_new32, perm=[0, 1, 2, 4, 3])), scale)
    pos_query, pos_key = b.op("Unsqueeze", pos_pad, last), b.op("Unsqueeze", pos_pad, ax1)  # [A, n, 1], [A, 1, n]
    bidirectional = b.op("Cast", b.attribute_const("bidirectional", "int"), to=TensorProto.BOOL)
    order_ok = b.op("Or", b.op("LessOrEqual", pos_key, pos_query), bidirectional)
    new_visible = b.op("And", order_ok, b.op("GreaterOrEqual", pos_key, zero))  # padding keys never seen
    new_mask = b.op("Unsqueeze", new_visible, b.const([1, 2]))  # [A, 1, 1, n, n]
    new_scores = b.op("Where", new_mask, new_scores, neg)

    weights = b.op("Softmax", b.op("Concat", cache_scores, new_scores, axis=-1), axis=-1)
    cache_weights, new_weights = b.op("Split", weights, b.op("Concat", live, n_max, axis=0), axis=-1, outputs=2)
    v_cache32 = b.op("Cast", b.op("Unsqueeze", v_live, ax2), to=TensorProto.FLOAT)
    v_new32 = b.op("Cast", b.op("Unsqueeze", b.op("Transpose", v_pad, perm=[0, 2, 1, 3]), ax2), to=TensorProto.FLOAT)
    attended = b.op("Add", b.op("MatMul", cache_weights, v_cache32), b.op("MatMul", new_weights, v_new32))

    # [A, Hkv, g, n, D] -> [A, n, Hkv, g, D] -> the T real tokens [T, Hkv, g, D] -> [T, Hq, D]
    per_token = b.op("Transpose", attended, perm=[0, 3, 1, 2, 4])
    out = b.op("Reshape", b.op("GatherND", per_token, pad_index), b.op("Shape", "q"))
    b.op("CastLike", out, "q", name="out")
    return helper.make_function(
        DOMAIN, OP_TYPE, list(INPUTS), list(OUTPUTS), b.nodes,
        opset_imports=[helper.make_opsetid("", OPSET)],
        attributes=["bidirectional", "scale", "plugin_namespace", "plugin_version"],
    )


def varlen_attention_node(inputs: list[str], output: str, head_dim: int, bidirectional: bool = False,
                          name: str | None = None) -> NodeProto:
    """A call of the op, carrying the TensorRT plugin attributes."""
    return helper.make_node(
        OP_TYPE,
        inputs,
        [output],
        name=name,
        domain=DOMAIN,
        bidirectional=int(bidirectional),
        scale=1.0 / math.sqrt(head_dim),
        plugin_namespace=PLUGIN_NAMESPACE,
        plugin_version=PLUGIN_VERSION,
    )


def opset_imports() -> list:
    return [helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)]
