"""The ops of a decoder layer on flattened [T, H] activations, shared by the target and drafter graphs."""

from __future__ import annotations

from typing import Callable

import numpy as np
from onnx import TensorProto

from dspark_export.graphs.weights import Weights
from dspark_plugins.builder import GraphBuilder


class DecoderOps:
    """The ops of a decoder layer on [T, H] activations, appending to one GraphBuilder. `fused_norms`: each residual
    add and the norm after it are ONNX Runtime's one `SkipSimplifiedLayerNormalization` (else Add, then the norm)."""

    def __init__(self, b: GraphBuilder, weights: Weights, eps: float, dtype: int, head_dim: int,
                 fused_norms: bool = False):
        self.b, self.weights, self.eps, self.dtype, self.head_dim = b, weights, eps, dtype, head_dim
        self.fused_norms = fused_norms

    def layer(self, h: str, x: str, prefix: str, next_norm: str, attend: Callable[[str], str]) -> tuple[str, str]:
        """One pre-norm decoder layer, every form's (`{prefix}self_attn.o_proj.weight`, `{prefix}mlp.` ...): from the
        layer's normed input `h` and the residual stream `x`, the next layer's normed input (normed by `next_norm`,
        model.norm's after the last layer) and the new residual. `attend(h)` is the attention output [T, Hq·D]."""
        h, x = self.add_norm(x, self.linear(attend(h), prefix + "self_attn.o_proj.weight"),
                             prefix + "post_attention_layernorm.weight")
        return self.add_norm(x, self.swiglu(h, prefix + "mlp."), next_norm)

    def add_norm(self, x: str, delta: str, weight: str) -> tuple[str, str]:
        """(RMSNorm(x + delta) · weight, x + delta)."""
        b = self.b
        if self.fused_norms:
            normed, _, _, total = b.op("SkipSimplifiedLayerNormalization", delta, x, self.weights(weight), outputs=4,
                                       domain="com.microsoft", epsilon=self.eps)
            return normed, total
        total = b.op("Add", x, delta)
        return self.rms_norm(total, weight), total

    def rms_norm(self, x: str, weight_name: str) -> str:
        """Normalise in float32 over the last axis, then scale in the graph dtype (as Hugging Face does)."""
        b = self.b
        wide = b.op("Cast", x, to=TensorProto.FLOAT)
        # Pow (not Mul) so that ONNX Runtime fuses the pattern into one SimplifiedLayerNormalization
        variance = b.op("ReduceMean", b.op("Pow", wide, b.const(2.0, np.float32)), b.const([-1]), keepdims=1)
        normed = b.op("Div", wide, b.op("Sqrt", b.op("Add", variance, b.const(self.eps, np.float32))))
        return b.op("Mul", b.op("Cast", normed, to=self.dtype), self.weights(weight_name))

    def linear(self, x: str, weight_name: str) -> str:
        return self.weights.linear(self.b, x, weight_name)

    def swiglu(self, x: str, prefix: str) -> str:
        """The MLP: down(silu(gate(x)) · up(x)) (`{prefix}gate_proj.weight` etc.). Gate and up stay two projections:
        as one, ONNX Runtime's int4 kernel took 9% longer over a whole step (grown Qwen3-1.7B, one token, 2 AVX2
        cores; and at 2-8 tokens)."""
        b = self.b
        gate, up = (self.linear(x, prefix + name) for name in ("gate_proj.weight", "up_proj.weight"))
        return self.linear(b.op("Mul", b.op("Mul", gate, b.op("Sigmoid", gate)), up), prefix + "down_proj.weight")

    def attention_inputs(self, x: str, prefix: str, heads: tuple[int, int], qk_norm: bool, bias: bool = False,
                         batched: Callable[[str], str] | None = None, queries: str | None = None) -> list[str]:
        """q, k and v of an attention layer (`{prefix}q_proj.weight` etc.) from one projection of x's rows (with the
        q/k/v biases when `bias`), q and k RMS-normed per head when `qk_norm`: per head, [T, H, D]; or, with
        `batched` re-laying the projection [T, N] out as [S, M, N] (after the projection, so padding costs no matmul
        rows), GroupQueryAttention's [S, M, H·D]. With `queries` (per-head layout only), q comes from those rows
        alone and x's rows give only k and v: rows that only feed the cache cost no query projection."""
        b, d = self.b, self.head_dim
        names = [prefix + n for n in ("q_proj", "k_proj", "v_proj")]
        project = lambda rows, part: self.weights.linear(  # noqa: E731
            b, rows, [name + ".weight" for name in part], [name + ".bias" for name in part] if bias else None)
        widths = [heads[0] * d, heads[1] * d, heads[1] * d]
        if queries is not None:
            q = project(queries, names[:1])
            k, v = b.op("Split", project(x, names[1:]), b.const(widths[1:]), axis=-1, outputs=2)
        else:
            projected = project(x, names)
            if batched is not None:
                projected = batched(projected)
            q, k, v = b.op("Split", projected, b.const(widths), axis=-1, outputs=3)
        if batched is None:
            per_head = b.const([0, -1, d])
            q, k, v = (b.op("Reshape", part, per_head) for part in (q, k, v))
            return [*self._qk_norm(q, k, prefix, qk_norm), v]
        if not qk_norm:
            return [q, k, v]
        per_head, flat = b.const([0, 0, -1, d]), b.const([0, 0, -1])
        q, k = self._qk_norm(*(b.op("Reshape", part, per_head) for part in (q, k)), prefix, qk_norm)
        return [b.op("Reshape", q, flat), b.op("Reshape", k, flat), v]

    def _qk_norm(self, q: str, k: str, prefix: str, qk_norm: bool) -> tuple[str, str]:
        if not qk_norm:
            return q, k
        return self.rms_norm(q, prefix + "q_norm.weight"), self.rms_norm(k, prefix + "k_norm.weight")

    def rope(self, x: str, cos: str, sin: str) -> str:
        """x·cos + rotate_half(x)·sin, with `sin` from `rope_tables` (sign folded in): rotate_half is one Gather."""
        b, half = self.b, self.head_dim // 2
        swapped = b.const(np.r_[np.arange(half, 2 * half), np.arange(half)])
        return b.op("Add", b.op("Mul", x, cos), b.op("Mul", b.op("Gather", x, swapped, axis=-1), sin))


def rope_angles(b: GraphBuilder, pos: str, inv_freq: np.ndarray) -> str:
    """The rotary angles [T, D/2] of absolute positions (float32, from the config's `inverse_frequencies`)."""
    return b.op("Mul", b.op("Unsqueeze", b.op("Cast", pos, to=TensorProto.FLOAT), b.const([1])),
                b.const(inv_freq, np.float32))


def rope_tables(b: GraphBuilder, pos: str, inv_freq: np.ndarray, dtype: int) -> tuple[str, str]:
    """cos [T, 1, D] and the signed sin [-sin, sin] [T, 1, D] for absolute positions (`rope_angles`, then the graph
    dtype), for `DecoderOps.rope`."""
    angles = rope_angles(b, pos, inv_freq)
    angles = b.op("Unsqueeze", b.op("Concat", angles, angles, axis=-1), b.const([1]))
    sign = b.const(np.repeat([-1.0, 1.0], len(inv_freq)), np.float32)
    return b.op("Cast", b.op("Cos", angles), to=dtype), b.op("Cast", b.op("Mul", b.op("Sin", angles), sign), to=dtype)
