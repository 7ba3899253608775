"""Drawing drafts inside a drafter graph: inverse CDF from one uniform per draft, argmax at temperature 0."""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

from dspark_plugins.builder import GraphBuilder


class Sampler:
    """Per-request draft sampling in the graph: inverse CDF of softmax(logits / T) from one uniform of
    `noise` per draft, the argmax where T = 0; the distribution drawn from is returned with the token.

    An `If` on "any request samples" keeps all-greedy calls to an argmax: the softmax, cumulative sums and
    comparisons over the vocabulary run only when some request has T > 0. In a call that samples, a greedy
    row's distribution is softmax(logits / 1e-6), the point mass on its argmax up to ties. Greedy
    verification needs no distribution, so with `greedy_shortcut` an all-greedy call returns `draft_probs`
    with an empty vocabulary axis (ONNX Runtime); without it, one-hot rows (TensorRT's conditionals need
    both branches to give the same shape). `pick` puts one draft under its own `If`; `chain` puts a
    whole sequential chain under one, so that each branch can take its own route through the chain.
    """

    def __init__(self, b: GraphBuilder, vocab: int, greedy_shortcut: bool, target_ids: np.ndarray | None = None,
                 target_vocab: int | None = None):
        """`vocab` is the vocabulary drawn from; with a draft vocabulary, `target_ids` [vocab] maps it into the
        target's `target_vocab`: tokens are returned as target ids, distributions over the target vocabulary."""
        self.b, self.vocab, self.greedy_shortcut = b, vocab, greedy_shortcut
        self.target_ids = None if target_ids is None else b.const(np.asarray(target_ids, np.int64))
        self.target_vocab = target_vocab or vocab
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

    def _branch(
        self, body: Callable[[GraphBuilder, bool], list[str]], outputs: list[tuple[str, int]], sample: bool
    ) -> onnx.GraphProto:
        sub = GraphBuilder(f"{self.b.prefix}{outputs[0][0]}_{'sample' if sample else 'argmax'}_")
        results = body(sub, sample)
        infos = [
            helper.make_tensor_value_info(value, elem_type, None) for value, (_, elem_type) in zip(results, outputs)
        ]
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
            token = self.to_target(sub, sub.op("Where", self.sampling_row, sampled, token))
            prob = self._on_target_vocab(sub, prob)
        elif self.greedy_shortcut:
            token = self.to_target(sub, token)
            prob = sub.op("Slice", logits, sub.const([0]), sub.const([0]), sub.const([-1]))  # [R, 0]
        else:
            token = self.to_target(sub, token)
            prob = sub.op("OneHot", token, sub.const([self.target_vocab]), sub.const([0.0, 1.0], np.float32), axis=-1)
        return token, sub.op("Unsqueeze", prob, sub.const([1]))

    def to_target(self, sub: GraphBuilder, token: str) -> str:
        """Draft-vocabulary ids -> target ids (unchanged without a draft vocabulary)."""
        return token if self.target_ids is None else sub.op("Gather", self.target_ids, token)

    def _on_target_vocab(self, sub: GraphBuilder, prob: str) -> str:
        """[R, V'] draft-vocabulary probabilities -> [R, V] on the target's vocabulary, zero elsewhere."""
        if self.target_ids is None:
            return prob
        rows = sub.op("Slice", sub.op("Shape", prob), sub.const([0]), sub.const([1]))
        zeros = sub.op("ConstantOfShape", sub.op("Concat", rows, sub.const([self.target_vocab]), axis=0),
                       value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))
        indices = sub.op("Expand", sub.op("Unsqueeze", self.target_ids, sub.const([0])), sub.op("Shape", prob))
        return sub.op("ScatterElements", zeros, indices, prob, axis=1)
