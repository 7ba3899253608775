"""The EAGLE-3 baseline's `drafter.onnx` body: its whole autoregressive draft loop, unrolled γ steps in one graph.

Inputs beyond the block drafters' (`dspark_common.graph_io`)
    context_ids [C]    the token after each context position t (entry t holds x_{t+1} and the features of t)
    context_last [R]   index in C of each request's newest entry, t = anchor_pos - 1 (every request brings at
                       least one new entry; the runtime's steps commit at least one token per request)
Entry t's step-0 key/value (position t) is what the drafter caches. Step 0 of the newest entry attends to its
slot's cache and new entries; chain step i (position anchor_pos - 1 + i) attends to the same plus the
request's own chain, exactly as `Eagle3Drafter.unroll` trains and `eagle3_draft` drafts: each step is one
causal `DSparkVarlenAttention` call over [context entries; chain entries so far].
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from dspark_export.drafters.config import DrafterConfig
from dspark_export.graphs.decoder import DecoderOps, rope_tables
from dspark_export.graphs.sampler import Sampler
from dspark_plugins.builder import GraphBuilder
from dspark_plugins.onnx_function import varlen_attention_node
from dspark_common.graph_io import GraphIO


def eagle3_body(b: GraphBuilder, ops: DecoderOps, config: DrafterConfig, sampler: Sampler, io: GraphIO) -> None:
    """Build the graph into `b`: step 0 of every new context entry, then γ chained draft steps."""
    t = config.target_config
    hq, hkv, d = t.num_attention_heads, t.num_key_value_heads, t.head_dim
    flat_shape = b.const([-1, hq * d])

    layer, attn = "layers.0.", "layers.0.self_attn."

    def project(token_ids: str, hidden: str, pos: str) -> tuple[str, str, str]:
        embedded = ops.weights.embedding(b, token_ids, "embed_tokens.weight")
        x = b.op("Concat", ops.rms_norm(embedded, layer + "input_layernorm.weight"),
                 ops.rms_norm(hidden, layer + "hidden_norm.weight"), axis=-1)
        cos, sin = rope_tables(b, pos, t.inverse_frequencies(), TensorProto.FLOAT)
        q, k, v = ops.attention_inputs(x, attn, (hq, hkv), config.qk_norm)
        return ops.rope(q, cos, sin), ops.rope(k, cos, sin), v

    def finish(attended: str, hidden: str) -> str:
        residual = ops.rms_norm(hidden, layer + "hidden_norm.weight") if config.norm_before_residual else hidden
        h, x = ops.add_norm(residual, ops.linear(b.op("Reshape", attended, flat_shape), attn + "o_proj.weight"),
                            layer + "post_attention_layernorm.weight")
        return b.op("Add", x, ops.swiglu(h, layer + "mlp."))

    def attend(query: str, keys: list[str], values: list[str], slots: list[str], positions: list[str]) -> str:
        """Causal varlen attention of `query` (the newest rows) over [context entries; chain so far]."""
        cat = lambda parts: parts[0] if len(parts) == 1 else b.op("Concat", *parts, axis=0)  # noqa: E731
        earlier = b.op("Sub", b.op("Shape", cat(keys), start=0, end=1), b.op("Shape", query, start=0, end=1))
        pad = b.op("ConstantOfShape", b.op("Concat", earlier, b.const([hq, d]), axis=0),
                   value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))
        out = b.name("attention")
        b.nodes.append(varlen_attention_node([b.op("Concat", pad, query, axis=0), cat(keys), cat(values), past_key,
                                              past_value, cat(slots), cat(positions), "cache_len"], out, d))
        return b.op("Slice", out, earlier, b.const([np.iinfo(np.int64).max]), b.const([0]))

    (past_key,), (past_value,) = io.cache_names("past_key"), io.cache_names("past_value")
    context = ops.linear("context_features", "fc.weight")  # [C, H]
    q0, k0, v0 = project("context_ids", context, "context_pos")
    b.op("Identity", k0, name=io.cache_names("new_key")[0])
    b.op("Identity", v0, name=io.cache_names("new_value")[0])
    keys, values, slots, positions = [k0], [v0], ["context_slot"], ["context_pos"]
    entries = finish(attend(q0, keys, values, slots, positions), context)  # step 0 of every new entry
    hidden = b.op("Gather", entries, "context_last", axis=0)  # [R, H]: the newest entry of each request
    tokens, probs = [], []
    for step in range(config.gamma):
        token, prob = sampler.pick(ops.linear(ops.rms_norm(hidden, "norm.weight"), "lm_head.weight"), step)
        tokens.append(b.op("Unsqueeze", token, b.const([1])))
        probs.append(prob)
        if step == config.gamma - 1:
            break
        pos = b.op("Add", "anchor_pos", b.const(step))  # entry a-1, chain step `step + 1`
        q, k, v = project(token, hidden, pos)
        keys, values, slots, positions = keys + [k], values + [v], slots + ["request_slot"], positions + [pos]
        hidden = finish(attend(q, keys, values, slots, positions), hidden)
    b.op("Concat", *tokens, axis=1, name="draft_tokens")
    b.op("Concat", *probs, axis=1, name="draft_probs")
