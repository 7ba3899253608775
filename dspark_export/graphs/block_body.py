"""The DSpark and DFlash drafter graph: a parallel backbone over [new context; block], then DSpark's
sequential head (Markov, gated or RNN) and confidence head, and the draws.

The block [anchor, MASK x (N-1)] of each request (N = γ rows, or 1 + γ in the layout whose anchor row drafts
nothing) attends to its slot's cache, the new context of its slot, and itself (bidirectionally): one
`DSparkVarlenAttention` call in bidirectional mode over [context tokens; block tokens] (DSpark's own
`BlockAttention` where the products are DSpark's operators, w4a8: the rotary embedding inside, the block rows'
queries only). The new context rows' K/V are the outputs the runtime commits. Tensor names are `BlockDrafter`'s
(DeepSpec's).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import numpy as np
from onnx import TensorProto, helper

from dspark_export.drafters.config import DrafterConfig
from dspark_export.graphs.decoder import DecoderOps, rope_angles, rope_tables
from dspark_export.graphs.sampler import Sampler
from dspark_plugins.builder import GraphBuilder
from dspark_plugins.onnx_function import varlen_attention_node
from dspark_common.graph_io import GraphIO
from dspark_common.native import DOMAIN as DSPARK_DOMAIN


def block_body(b: GraphBuilder, ops: DecoderOps, config: DrafterConfig, sampler: Sampler, io: GraphIO) -> None:
    """The DSpark / DFlash graph: backbone over [context; block], then the sequential and confidence heads."""
    rows = config.block_rows

    # block inputs: [anchor, MASK x (N-1)] per request at positions anchor_pos + j
    requests = b.op("Shape", "anchor_ids")
    offsets = b.const(np.arange(rows), np.int64)
    block_pos = b.op("Reshape", b.op("Add", b.op("Unsqueeze", "anchor_pos", b.const([1])), offsets), b.const([-1]))
    block_slot = b.op("Reshape", b.op("Expand", b.op("Unsqueeze", "request_slot", b.const([1])),
                                      b.op("Concat", requests, b.const([rows]), axis=0)), b.const([-1]))
    is_anchor = b.const((np.arange(rows) == 0)[None, :], np.bool_)
    block_ids = b.op("Reshape", b.op("Where", is_anchor, b.op("Unsqueeze", "anchor_ids", b.const([1])),
                                     b.const(config.mask_token_id)), b.const([-1]))
    x = ops.weights.embedding(b, block_ids, "embed_tokens.weight")  # [R·N, H]
    context = ops.rms_norm(ops.linear("context_features", "fc.weight"), "hidden_norm.weight")  # [C, H]
    all_pos, all_slot = (
        b.op("Concat", "context_pos", block_pos, axis=0),
        b.op("Concat", "context_slot", block_slot, axis=0),
    )
    attention = _own_attention if ops.weights.format.int4_rows else _contract_attention
    attend = attention(b, ops, config, context, all_pos, all_slot, io)

    h = ops.rms_norm(x, "layers.0.input_layernorm.weight")
    for layer in range(config.num_layers):
        next_norm = "norm.weight" if layer == config.num_layers - 1 else f"layers.{layer + 1}.input_layernorm.weight"
        h, x = ops.layer(h, x, f"layers.{layer}.", next_norm, partial(attend, layer))
    hidden = b.op("Reshape", h, b.op("Concat", requests, b.const([rows, -1]), axis=0))  # h: normed by norm.weight
    _sequential_head(b, ops, config, hidden, sampler)  # [R, N, H]


def _own_attention(b: GraphBuilder, ops: DecoderOps, config: DrafterConfig, context: str, all_pos: str,
                   all_slot: str, io: GraphIO) -> Callable[[int, str], str]:
    """Attention on DSpark's operators (with w4a8 products): `BlockAttention` rotates q and k itself, takes the block
    rows' queries only and returns the new context rows' rotated keys for the cache."""
    t = config.target_config
    angles = rope_angles(b, all_pos, t.inverse_frequencies())
    half_cos, half_sin = b.op("Cos", angles), b.op("Sin", angles)  # [T, D/2]
    context_count, flat_shape = b.op("Shape", "context_pos"), b.const([-1, t.num_attention_heads * t.head_dim])

    def attend(layer: int, h: str) -> str:
        """The block rows' attention over [cache; new context; block]; writes the new context rows' K/V."""
        q, k, v = ops.attention_inputs(b.op("Concat", context, h, axis=0), f"layers.{layer}.self_attn.",
                                       (t.num_attention_heads, t.num_key_value_heads), t.qk_norm, t.qkv_bias,
                                       queries=h)
        b.op("Slice", v, b.const([0]), context_count, b.const([0]), name=io.cache_names("new_value")[layer])
        attended = b.op("BlockAttention", q, k, v, io.cache_names("past_key")[layer],
                        io.cache_names("past_value")[layer], all_slot, "cache_len", half_cos, half_sin,
                        names=[f"attention_{layer}", io.cache_names("new_key")[layer]], domain=DSPARK_DOMAIN)[0]
        return b.op("Reshape", attended, flat_shape)

    return attend


def _contract_attention(b: GraphBuilder, ops: DecoderOps, config: DrafterConfig, context: str, all_pos: str,
                        all_slot: str, io: GraphIO) -> Callable[[int, str], str]:
    """Attention by the varlen contract's bidirectional op (`DSparkVarlenAttention`: a plugin on TensorRT, its
    function body on ONNX Runtime) over [context; block] rows, the rotary embedding applied in the graph and the
    queries padded over the context rows."""
    t = config.target_config
    hq, hkv, d = t.num_attention_heads, t.num_key_value_heads, t.head_dim
    cos, sin = rope_tables(b, all_pos, t.inverse_frequencies(), TensorProto.FLOAT)
    context_count, end = b.op("Shape", "context_pos"), b.const([np.iinfo(np.int64).max])
    cos_blk, sin_blk = (b.op("Slice", c, context_count, end, b.const([0])) for c in (cos, sin))
    query_pad = b.op("ConstantOfShape", b.op("Concat", context_count, b.const([hq, d]), axis=0),
                     value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))

    def attend(layer: int, h: str) -> str:
        """The block rows' attention over [cache; new context; block]; writes the new context rows' K/V."""
        q, k, v = ops.attention_inputs(b.op("Concat", context, h, axis=0), f"layers.{layer}.self_attn.", (hq, hkv),
                                       t.qk_norm, t.qkv_bias, queries=h)
        k = ops.rope(k, cos, sin)
        for name, projected in ((io.cache_names("new_key")[layer], k), (io.cache_names("new_value")[layer], v)):
            b.op("Slice", projected, b.const([0]), context_count, b.const([0]), name=name)
        inputs = [b.op("Concat", query_pad, ops.rope(q, cos_blk, sin_blk), axis=0), k, v,
                  io.cache_names("past_key")[layer], io.cache_names("past_value")[layer], all_slot, all_pos,
                  "cache_len"]
        attended_all = f"attention_{layer}"
        b.nodes.append(varlen_attention_node(inputs, attended_all, d, bidirectional=True,
                                             name=f"attention_node_{layer}"))
        return b.op("Reshape", b.op("Slice", attended_all, context_count, end, b.const([0])), b.const([-1, hq * d]))

    return attend


GREEDY_CANDIDATES = 128  # CPU graphs: tokens per position an all-greedy call scores with the sequential head
CANDIDATE_ROUTE_MIN = 1 << 22  # drafted vocabulary x Markov rank from which that pays for its TopK (measured)


def _sequential_head(
    b: GraphBuilder, ops: DecoderOps, config: DrafterConfig, block_hidden: str, sampler: Sampler
) -> None:
    """Unrolled γ steps under one `If` (bias from the previous token, a draw from one uniform each), then
    the confidence logits of all steps in one product: they need only the hidden state and the previous token.
    `block_hidden` [R, N, H] are the backbone's normed states of all block rows; rows N-γ.. draft.

    CPU graphs draw all-greedy calls from the top `GREEDY_CANDIDATES` base logits of each position where the
    bias over the whole drafted vocabulary is large (`CANDIDATE_ROUTE_MIN`): the sequential bias is computed for
    those tokens only. A greedy draft is only a guess (greedy verification checks it against the target's
    argmax), so this changes speed, not output.
    """
    weights, gamma, vocab = ops.weights, config.gamma, config.drafted_vocab
    lead = config.block_rows - gamma
    per_step = b.op("Slice", block_hidden, b.const([lead]), b.const([config.block_rows]), b.const([1]))  # [R, γ, H]
    hidden_size = config.target_config.hidden_size
    base = b.op("Reshape", ops.linear(b.op("Reshape", per_step, b.const([-1, hidden_size])), "lm_head.weight"),
                b.op("Concat", b.op("Shape", "anchor_ids"), b.const([gamma, vocab]), axis=0))  # [R, γ, V']
    head = "markov_head."

    def head_input(sub: GraphBuilder, previous: str, state: str | None, h_k: str) -> tuple[str, str | None]:
        """The [R, r] vector the Markov output matrix multiplies at a step, and the RNN state after it."""
        code = weights.embedding(sub, previous, head + "markov_w1.weight")  # [R, r]
        if config.head == "markov":
            return code, state
        if config.head == "gated":
            gate = weights.linear(
                sub, sub.op("Concat", h_k, code, axis=-1), head + "gate_proj.weight", head + "gate_proj.bias"
            )
            return sub.op("Mul", sub.op("Sigmoid", gate), code), state
        if state is None:
            state = sub.op("Mul", code, sub.const(0.0, np.float32))
        z = weights.linear(
            sub, sub.op("Concat", state, code, h_k, axis=-1), head + "joint_proj.weight", head + "joint_proj.bias"
        )
        gate, candidate, out = sub.op("Split", z, axis=-1, num_outputs=3, outputs=3)
        gate = sub.op("Sigmoid", gate)
        state = sub.op("Add", sub.op("Mul", gate, state),
                       sub.op("Mul", sub.op("Sub", sub.const(1.0, np.float32), gate), sub.op("Tanh", candidate)))
        return sub.op("Tanh", out), state

    def start(sub: GraphBuilder) -> str | None:
        """The RNN state entering draft 0: the idle anchor row of the 1+γ layout advances it once."""
        if lead and config.head == "rnn":
            return head_input(sub, "anchor_ids", None, sub.op("Gather", block_hidden, sub.const(0), axis=1))[1]
        return None

    def chain(sub: GraphBuilder, sample: bool) -> list[str]:
        if not sample and sampler.greedy_shortcut and config.head != "none" and \
                vocab * config.markov_rank >= CANDIDATE_ROUTE_MIN:
            return greedy_candidates(sub)
        previous, state = "anchor_ids", start(sub)
        tokens, probs = [], []
        for k in range(gamma):
            logits = sub.op("Gather", base, sub.const(k), axis=1)  # [R, V']
            if config.head != "none":
                vector, state = head_input(sub, previous, state, sub.op("Gather", per_step, sub.const(k), axis=1))
                logits = sub.op("Add", logits, weights.linear(sub, vector, head + "markov_w2.weight"))
            token, prob = sampler.draw(sub, logits, k, sample)
            tokens.append(sub.op("Unsqueeze", token, sub.const([1])))
            probs.append(prob)
            previous = token
        return [sub.op("Concat", *tokens, axis=1), sub.op("Concat", *probs, axis=1)]

    def greedy_candidates(sub: GraphBuilder) -> list[str]:
        top_logits, top_ids = sub.op(
            "TopK", base, sub.const([min(GREEDY_CANDIDATES, vocab)]), axis=-1, outputs=2
        )  # [R, γ, M]
        flat = weights.embedding(sub, sub.op("Reshape", top_ids, sub.const([-1])), head + "markov_w2.weight")  # W2 rows
        rows = sub.op(
            "Transpose",
            sub.op(
                "Reshape", flat, sub.op("Concat", sub.op("Shape", top_ids), sub.const([config.markov_rank]), axis=0)
            ),
            perm=[0, 1, 3, 2],
        )  # [R, γ, r, M]
        previous, state, tokens = "anchor_ids", start(sub), []
        for k in range(gamma):
            index = sub.const(k)
            vector, state = head_input(sub, previous, state, sub.op("Gather", per_step, index, axis=1))
            bias = sub.op(
                "MatMul", sub.op("Unsqueeze", vector, sub.const([1])), sub.op("Gather", rows, index, axis=1)
            )  # [R, 1, M]
            scores = sub.op("Add", sub.op("Squeeze", bias, sub.const([1])), sub.op("Gather", top_logits, index, axis=1))
            best = sub.op("ArgMax", scores, axis=-1, keepdims=1)  # [R, 1]
            chosen = sub.op("GatherElements", sub.op("Gather", top_ids, index, axis=1), best, axis=1)
            tokens.append(sampler.to_target(sub, chosen))
            previous = sub.op("Squeeze", tokens[-1], sub.const([1]))
        no_distribution = sub.op("Slice", base, sub.const([0]), sub.const([0]), sub.const([-1]))  # [R, γ, 0]
        return [sub.op("Concat", *tokens, axis=1), no_distribution]

    tokens, _ = sampler.chain(chain, [("draft_tokens", TensorProto.INT64), ("draft_probs", TensorProto.FLOAT)])
    if config.confidence:  # σ(w · [h_k; W1[previous_k]] + b), previous = [anchor, drafts 0..γ-2]; or σ(w · h_k + b)
        hidden = b.op("Reshape", per_step, b.const([-1, hidden_size]))  # [R·γ, H]
        if config.confidence_with_markov:
            previous = b.op("Concat", b.op("Unsqueeze", "anchor_ids", b.const([1])),
                            b.op("Slice", tokens, b.const([0]), b.const([gamma - 1]), b.const([1])), axis=1)
            codes = weights.embedding(
                b, b.op("Reshape", previous, b.const([-1])), head + "markov_w1.weight"
            )  # [R·γ, r]
            hidden = b.op("Concat", hidden, codes, axis=-1)
        logits = weights.linear(b, hidden, "confidence_head.proj.weight", "confidence_head.proj.bias")
        b.op("Reshape", logits, b.const([-1, gamma]), name="confidence_logits")
