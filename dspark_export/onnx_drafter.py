"""Build `drafter.onnx` for a DSpark or DFlash drafter (backbone + unrolled sequential head + confidence
head, drafts sampled by inverse CDF from a noise input), from the drafter's and the target's safetensors.

Inputs
    context_features [C, F], context_slot [C], context_pos [C]   target features of newly committed positions
    anchor_ids [R], anchor_pos [R], request_slot [R]              each request's anchor (newest token)
    cache_len [S]; past_key_i / past_value_i [S, Hkv, Lmax, D]    the drafter's own context cache
    noise [R, γ] uniforms in [0, 1), one per draft; temperature [R] per request (0 = argmax)
Outputs
    draft_tokens [R, γ] int64; draft_probs [R, γ, V] (what the drafts were drawn from; one-hot at T = 0)
    confidence_logits [R, γ] (DSpark only; σ of it is the conditional acceptance probability)
    new_key_i / new_value_i [C, Hkv, D]                           context K/V to commit at (slot, pos)
The block attends to its slot's cache, the new context of its slot, and itself (bidirectionally): one
`DSparkVarlenAttention` call in block mode over [context tokens; block tokens]. The EAGLE-3 baseline's
graph (`onnx_eagle3`) shares the weight streaming, the sampler and this interface.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from dspark_export.checkpoint import Checkpoint, read_header, tensor_view
from dspark_export.drafters.config import DrafterConfig
from dspark_export.onnx_target import DecoderOps, GRAPH_FORMAT, rope_tables
from dspark_export.onnx_weights import ExternalData, convert
from dspark_plugins.onnx_function import opset_imports, varlen_attention_function, varlen_attention_node
from dspark_plugins.builder import GraphBuilder
from dspark_export.errors import CheckpointError


def build_drafter_onnx(drafter_dir: str | Path, target: Checkpoint, graph_file: str | Path, cpu: bool = False) -> Path:
    """Write the drafter graph (float32) and its external data; returns the graph path.

    `cpu` (ONNX Runtime builds) stores every projection (the layers', the LM head, the Markov output) as
    int8 with a float32 scale per output and runs it as `MatMulInteger` on dynamically quantized
    activations: 4x less weight traffic per draft (drafter call at one request 1.98 -> 1.55 ms, medians of
    14 alternating rounds; τ unchanged). Drafts change slightly, losslessness does not (the distribution a
    draft was drawn from is what the graph returns). It also lets all-greedy calls skip the distributions
    (see `Sampler`), which TensorRT's conditionals do not allow. TensorRT builds keep float32.
    """
    config = DrafterConfig.from_dir(drafter_dir)
    config.check_target(target.config, None)
    graph_file = Path(graph_file)
    graph_file.parent.mkdir(parents=True, exist_ok=True)
    store = ExternalData(graph_file)
    weights = DrafterWeights(drafter_dir, target, store, int8=cpu)
    b = GraphBuilder()
    ops = DrafterOps(b, weights, target.config.rms_norm_eps, TensorProto.FLOAT, target.config.head_dim)
    if config.drafter_type == "eagle3":
        from dspark_export.onnx_eagle3 import eagle3_body

        inputs, outputs = eagle3_body(b, ops, config, Sampler(b, config.target_config.vocab_size, cpu))
    else:
        inputs, outputs = block_body(b, ops, config, Sampler(b, config.target_config.vocab_size, cpu))
    store.close()
    graph = helper.make_graph(b.nodes, "dspark_drafter", inputs, outputs, initializer=list(weights.initializers.values()))
    model = helper.make_model(graph, opset_imports=opset_imports(), functions=[varlen_attention_function()],
                              producer_name="dspark-export")
    helper.set_model_props(model, {"dspark_graph": "drafter", "dspark_graph_format": str(GRAPH_FORMAT),
                                   "drafter_config": config.to_json(), "cpu_graph": str(int(cpu))})
    onnx.save_model(model, str(graph_file))
    return graph_file


class DrafterWeights:
    """`weights(name)` streams a drafter tensor (or the frozen embedding / LM head from the target) into the
    external data on first use, as float32; `linear` projects with one (int8 when asked)."""

    def __init__(self, drafter_dir: str | Path, target: Checkpoint, store: ExternalData, int8: bool):
        self.drafter_dir, self.target, self.store, self.int8 = drafter_dir, target, store, int8
        self.tensors = read_header(Path(drafter_dir) / "model.safetensors")
        self.initializers: dict[str, TensorProto] = {}

    def _float32(self, name: str) -> np.ndarray:
        if name in self.tensors:
            return convert(tensor_view(self.tensors[name]), self.tensors[name].dtype, "float32")
        if name in ("embed_tokens.weight", "lm_head.weight"):  # frozen: the target's own
            target = self.target
            return convert(*target.raw("model.embed_tokens.weight" if name == "embed_tokens.weight" else target.lm_head_name()), "float32")
        raise CheckpointError(f"drafter weights in {self.drafter_dir} lack {name}")

    def __call__(self, name: str) -> str:
        if name not in self.initializers:
            self.initializers[name] = self.store.add(name, self._float32(name), "float32")
        return name

    def linear(self, b: GraphBuilder, x: str, name: str) -> str:
        """x [N, in] @ W[out, in]^T -> [N, out]."""
        if not self.int8:
            return b.op("Gemm", x, self(name), transB=1)
        quantized, scale, zero = name + ".int8", name + ".scale", name + ".zero_point"
        if quantized not in self.initializers:
            columns = self._float32(name).T  # [in, V]
            step = np.maximum(np.abs(columns).max(0), 1e-12) / 127.0
            for key, array, dtype in ((quantized, np.round(columns / step).astype(np.int8), "int8"),
                                      (scale, step.astype(np.float32), "float32"),
                                      (zero, np.zeros(columns.shape[1], np.int8), "int8")):
                self.initializers[key] = self.store.add(key, np.ascontiguousarray(array), dtype)
        x_q, x_scale, x_zero = b.op("DynamicQuantizeLinear", x, outputs=3)
        product = b.op("Cast", b.op("MatMulInteger", x_q, quantized, x_zero, zero), to=TensorProto.FLOAT)
        return b.op("Mul", b.op("Mul", product, x_scale), scale)


class DrafterOps(DecoderOps):
    """The decoder ops with the drafter's projections (`DrafterWeights.linear`: int8 in CPU graphs)."""

    def linear(self, x: str, weight_name: str) -> str:
        return self.weight.linear(self.b, x, weight_name)


def block_body(b: GraphBuilder, ops: DecoderOps, config: DrafterConfig, sampler: "Sampler") -> tuple[list, list]:
    """The DSpark / DFlash graph body; returns (inputs, outputs) value infos."""
    t = config.target_config
    weight = ops.weight
    hq, hkv, d, block, vocab = t.num_attention_heads, t.num_key_value_heads, t.head_dim, config.gamma, t.vocab_size
    q_shape, kv_shape, flat_shape = b.const([-1, hq, d]), b.const([-1, hkv, d]), b.const([-1, hq * d])

    # block inputs: [anchor, MASK x (γ-1)] per request at positions anchor_pos + j
    requests = b.op("Shape", "anchor_ids")
    offsets = b.const(np.arange(block), np.int64)
    block_pos = b.op("Reshape", b.op("Add", b.op("Unsqueeze", "anchor_pos", b.const([1])), offsets), b.const([-1]))
    block_slot = b.op("Reshape", b.op("Expand", b.op("Unsqueeze", "request_slot", b.const([1])),
                                      b.op("Concat", requests, b.const([block]), axis=0)), b.const([-1]))
    is_anchor = b.const((np.arange(block) == 0)[None, :], np.bool_)
    block_ids = b.op("Reshape", b.op("Where", is_anchor, b.op("Unsqueeze", "anchor_ids", b.const([1])),
                                     b.const(config.mask_token_id)), b.const([-1]))
    x = b.op("Gather", weight("embed_tokens.weight"), block_ids)  # [R·γ, H]
    context = ops.rms_norm(ops.linear("context_features", "fc.weight"), "hidden_norm.weight")  # [C, H]
    all_pos, all_slot = b.op("Concat", "context_pos", block_pos, axis=0), b.op("Concat", "context_slot", block_slot, axis=0)
    cos, sin = rope_tables(b, all_pos, d, t.rope_theta, t.rope_factor, TensorProto.FLOAT)
    context_count = b.op("Shape", "context_pos")
    split = b.op("Concat", context_count, b.op("Shape", block_pos), axis=0)
    (cos_ctx, cos_blk), (sin_ctx, sin_blk) = (b.op("Split", c, split, axis=0, outputs=2) for c in (cos, sin))
    query_pad = b.op("ConstantOfShape", b.op("Concat", context_count, b.const([hq, d]), axis=0),
                     value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))

    inputs = [helper.make_tensor_value_info("context_features", TensorProto.FLOAT, ["C", t.hidden_size * len(config.feature_layers)])]
    inputs += [helper.make_tensor_value_info(n, TensorProto.INT64, [s]) for n, s in [
        ("context_slot", "C"), ("context_pos", "C"), ("anchor_ids", "R"), ("anchor_pos", "R"), ("request_slot", "R"),
        ("cache_len", "S")]]
    outputs = []
    for layer in range(config.num_layers):
        p = f"layers.{layer}."
        attn = p + "self_attn."
        k_ctx = ops.projected_heads(context, attn + "k_proj.weight", attn + "k_norm.weight", kv_shape, cos_ctx, sin_ctx)
        v_ctx = b.op("Reshape", ops.linear(context, attn + "v_proj.weight"), kv_shape)
        new_k, new_v = b.op("Identity", k_ctx, name=f"new_key_{layer}"), b.op("Identity", v_ctx, name=f"new_value_{layer}")
        h = ops.rms_norm(x, p + "input_layernorm.weight")
        q = ops.projected_heads(h, attn + "q_proj.weight", attn + "q_norm.weight", q_shape, cos_blk, sin_blk)
        k = ops.projected_heads(h, attn + "k_proj.weight", attn + "k_norm.weight", kv_shape, cos_blk, sin_blk)
        v = b.op("Reshape", ops.linear(h, attn + "v_proj.weight"), kv_shape)
        past_k, past_v = f"past_key_{layer}", f"past_value_{layer}"
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["S", hkv, "Lmax", d]) for n in (past_k, past_v)]
        outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["C", hkv, d]) for n in (new_k, new_v)]
        attended_all = f"attention_{layer}"
        b.nodes.append(varlen_attention_node(
            [b.op("Concat", query_pad, q, axis=0), b.op("Concat", new_k, k, axis=0), b.op("Concat", new_v, v, axis=0),
             past_k, past_v, all_slot, all_pos, "cache_len"], attended_all, d, bidirectional=True, name=f"attention_node_{layer}"))
        attended = b.op("Slice", attended_all, context_count, b.const([np.iinfo(np.int64).max]), b.const([0]))
        x = b.op("Add", x, ops.linear(b.op("Reshape", attended, flat_shape), attn + "o_proj.weight"))
        h = ops.rms_norm(x, p + "post_attention_layernorm.weight")
        x = b.op("Add", x, ops.swiglu(h, p + "mlp."))
    normed = ops.rms_norm(x, "norm.weight")  # [R·γ, H]
    hidden = b.op("Reshape", normed, b.op("Concat", requests, b.const([block, t.hidden_size]), axis=0))
    base = b.op("Reshape", ops.weight.linear(b, normed, "lm_head.weight"), b.op("Concat", requests, b.const([block, vocab]), axis=0))
    _sequential_head(b, ops, config, hidden, base, sampler)
    inputs += [helper.make_tensor_value_info("noise", TensorProto.FLOAT, ["R", block]),
               helper.make_tensor_value_info("temperature", TensorProto.FLOAT, ["R"])]
    outputs = [helper.make_tensor_value_info("draft_tokens", TensorProto.INT64, ["R", block]),
               helper.make_tensor_value_info("draft_probs", TensorProto.FLOAT, ["R", block, "P"])] + (
        [helper.make_tensor_value_info("confidence_logits", TensorProto.FLOAT, ["R", block])] if config.confidence else []) + outputs
    return inputs, outputs


GREEDY_CANDIDATES = 128  # CPU graphs: tokens per position an all-greedy call scores with the sequential head


class Sampler:
    """Per-request draft sampling in the graph: inverse CDF of softmax(logits / T) from one uniform of
    `noise` per draft, the argmax where T = 0; the distribution drawn from is returned with the token.

    An `If` on "any request samples" keeps all-greedy calls to an argmax: the softmax, cumulative sums and
    comparisons over the vocabulary run only when some request has T > 0. In a call that samples, a greedy
    row's distribution is softmax(logits / 1e-6), the point mass on its argmax up to ties. Greedy
    verification needs no distribution, so with `empty_greedy` an all-greedy call returns `draft_probs`
    with an empty vocabulary axis (ONNX Runtime); without it, one-hot rows (TensorRT's conditionals need
    both branches to give the same shape). `pick` puts one draft under its own `If`; `chain` puts a
    whole sequential chain under one, so that each branch can take its own route through the chain.
    """

    def __init__(self, b: GraphBuilder, vocab: int, empty_greedy: bool):
        self.b, self.vocab, self.empty_greedy = b, vocab, empty_greedy
        self.sampling_row = b.op("Greater", "temperature", b.const(0.0, np.float32))  # [R]
        self.any_sampling = b.op("Greater", b.op("ReduceMax", "temperature", keepdims=0), b.const(0.0, np.float32))
        self.safe_t = b.op("Max", b.op("Unsqueeze", "temperature", b.const([1])), b.const(1e-6, np.float32))  # [R, 1]

    def pick(self, logits: str, k: int) -> tuple[str, str]:
        """logits [R, V] of draft k -> (token [R], distribution [R, 1, V], or [R, 1, 0] when all are greedy)."""
        draw = lambda sub, sample: self.draw(sub, logits, k, sample)  # noqa: E731
        return self.chain(draw, [(self.b.name(f"draft_token_{k}"), TensorProto.INT64),
                                 (self.b.name(f"draft_prob_{k}"), TensorProto.FLOAT)])

    def chain(self, body: Callable[[GraphBuilder, bool], list[str]], outputs: list[tuple[str, int]]) -> list[str]:
        """`body(sub, sample)` builds into `sub` a chain that draws with `draw(sub, .., sample)` and returns
        its results; it runs under one `If`, whose outputs get the names and element types of `outputs`."""
        names = [name for name, _ in outputs]
        self.b.nodes.append(helper.make_node("If", [self.any_sampling], names,
                                             then_branch=self._branch(body, outputs, sample=True),
                                             else_branch=self._branch(body, outputs, sample=False)))
        return names

    def _branch(self, body: Callable[[GraphBuilder, bool], list[str]], outputs: list[tuple[str, int]], sample: bool) -> onnx.GraphProto:
        sub = GraphBuilder(f"{self.b.prefix}{outputs[0][0]}_{'sample' if sample else 'argmax'}_")
        results = body(sub, sample)
        infos = [helper.make_tensor_value_info(value, elem_type, None) for value, (_, elem_type) in zip(results, outputs)]
        return helper.make_graph(sub.nodes, sub.prefix + "branch", [], infos)

    def draw(self, sub: GraphBuilder, logits: str, k: int, sample: bool) -> tuple[str, str]:
        """Draft k inside a branch: (token [R], distribution [R, 1, V] or [R, 1, 0] / one-hot when greedy)."""
        vocab = self.vocab
        token = sub.op("ArgMax", logits, axis=-1, keepdims=0)
        if sample:
            prob = sub.op("Softmax", sub.op("Div", logits, self.safe_t), axis=-1)  # [R, V]
            cdf = sub.op("CumSum", prob, sub.const(-1))
            threshold = sub.op("Mul", sub.op("Gather", "noise", sub.const([k]), axis=1),
                               sub.op("Gather", cdf, sub.const([vocab - 1]), axis=1))
            below = sub.op("ReduceSum", sub.op("Cast", sub.op("Less", cdf, threshold), to=TensorProto.INT64),
                           sub.const([-1]), keepdims=0)
            sampled = sub.op("Min", below, sub.const(vocab - 1))  # inverse CDF: first token whose mass passes u
            token = sub.op("Where", self.sampling_row, sampled, token)
        elif self.empty_greedy:
            prob = sub.op("Slice", logits, sub.const([0]), sub.const([0]), sub.const([-1]))  # [R, 0]
        else:
            prob = sub.op("OneHot", token, sub.const([vocab]), sub.const([0.0, 1.0], np.float32), axis=-1)
        return token, sub.op("Unsqueeze", prob, sub.const([1]))


def _sequential_head(b: GraphBuilder, ops: DecoderOps, config: DrafterConfig, hidden: str, base: str, sampler: Sampler) -> None:
    """Unrolled γ steps under one `If` (bias from the previous token, a draw from one uniform each), then
    the confidence logits of all steps in one product: they need only the hidden state and the previous token.

    CPU graphs draw all-greedy calls from the top `GREEDY_CANDIDATES` base logits of each position: the
    sequential bias is computed for those tokens only, not the whole vocabulary. A greedy draft is only a
    guess (greedy verification checks it against the target's argmax), so this changes speed, not output.
    """
    weights, vocab = ops.weight, config.target_config.vocab_size

    def head_input(sub: GraphBuilder, previous: str, state: str | None, k: int) -> tuple[str, str | None]:
        """The [R, r] vector the Markov output matrix multiplies at step k, and the RNN state."""
        code = sub.op("Gather", weights("markov_w1.weight"), previous)  # [R, r]
        if config.head == "markov":
            return code, state
        if state is None:
            state = sub.op("Mul", code, sub.const(0.0, np.float32))
        h_k = sub.op("Gather", hidden, sub.const(k), axis=1)  # [R, H]
        z = sub.op("Gemm", sub.op("Concat", state, code, h_k, axis=-1), weights("rnn.weight"), weights("rnn.bias"), transB=1)
        gate, candidate, out = sub.op("Split", z, axis=-1, num_outputs=3, outputs=3)
        gate = sub.op("Sigmoid", gate)
        state = sub.op("Add", sub.op("Mul", gate, state),
                       sub.op("Mul", sub.op("Sub", sub.const(1.0, np.float32), gate), sub.op("Tanh", candidate)))
        return sub.op("Tanh", out), state

    def chain(sub: GraphBuilder, sample: bool) -> list[str]:
        if not sample and sampler.empty_greedy and config.head != "none":
            return greedy_candidates(sub)
        previous, state = "anchor_ids", None
        tokens, probs = [], []
        for k in range(config.gamma):
            logits = sub.op("Gather", base, sub.const(k), axis=1)  # [R, V]
            if config.head != "none":
                vector, state = head_input(sub, previous, state, k)
                logits = sub.op("Add", logits, weights.linear(sub, vector, "markov_w2.weight"))
            token, prob = sampler.draw(sub, logits, k, sample)
            tokens.append(sub.op("Unsqueeze", token, sub.const([1])))
            probs.append(prob)
            previous = token
        return [sub.op("Concat", *tokens, axis=1), sub.op("Concat", *probs, axis=1)]

    def greedy_candidates(sub: GraphBuilder) -> list[str]:
        top_logits, top_ids = sub.op("TopK", base, sub.const([min(GREEDY_CANDIDATES, vocab)]), axis=-1, outputs=2)  # [R, γ, M]
        rows = sub.op("Transpose", sub.op("Gather", weights("markov_w2.weight"), top_ids), perm=[0, 1, 3, 2])  # [R, γ, r, M]
        previous, state, tokens = "anchor_ids", None, []
        for k in range(config.gamma):
            index = sub.const(k)
            vector, state = head_input(sub, previous, state, k)
            bias = sub.op("MatMul", sub.op("Unsqueeze", vector, sub.const([1])), sub.op("Gather", rows, index, axis=1))  # [R, 1, M]
            scores = sub.op("Add", sub.op("Squeeze", bias, sub.const([1])), sub.op("Gather", top_logits, index, axis=1))
            best = sub.op("ArgMax", scores, axis=-1, keepdims=1)  # [R, 1]
            tokens.append(sub.op("GatherElements", sub.op("Gather", top_ids, index, axis=1), best, axis=1))
            previous = sub.op("Squeeze", tokens[-1], sub.const([1]))
        no_distribution = sub.op("Slice", base, sub.const([0]), sub.const([0]), sub.const([-1]))  # [R, γ, 0]
        return [sub.op("Concat", *tokens, axis=1), no_distribution]

    tokens, _ = sampler.chain(chain, [("draft_tokens", TensorProto.INT64), ("draft_probs", TensorProto.FLOAT)])
    if config.confidence:  # σ(w · [h_k, W1[previous_k]] + b): previous = [anchor, drafts 0..γ-2]
        previous = b.op("Concat", b.op("Unsqueeze", "anchor_ids", b.const([1])),
                        b.op("Slice", tokens, b.const([0]), b.const([config.gamma - 1]), b.const([1])), axis=1)
        features = b.op("Concat", hidden, b.op("Gather", weights("markov_w1.weight"), previous), axis=-1)  # [R, γ, H + r]
        logits = b.op("MatMul", features, b.op("Transpose", weights("confidence_head.weight")))  # [R, γ, 1]
        b.op("Squeeze", b.op("Add", logits, weights("confidence_head.bias")), b.const([2]), name="confidence_logits")
