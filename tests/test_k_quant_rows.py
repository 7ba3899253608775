"""GGUF K-quant matrices (Q4_K, Q5_K, Q6_K) through DSpark's own ONNX Runtime operators (native/k_quants.c): the
packed layout holds the gguf package's dequantized values bit for bit, a gathered row is them bit for bit, and a
product is ggml's integer arithmetic on activations rounded to Q8_K, whatever rows share it."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType, quants
from onnx import TensorProto, helper, numpy_helper

from dspark_common import k_quant_rows, native

pytestmark = pytest.mark.skipif(not native.usable(), reason="DSpark's operators need x86-64 and a C compiler")
KINDS = ["Q4_K", "Q5_K", "Q6_K"]
N, K = 20, 512  # N not a multiple of 8: the last tile is padded


def random_blocks(kind: str, rng: np.random.Generator) -> np.ndarray:
    """Blocks of random bytes (every byte pattern is a valid K-quant block) with finite float16 d (and dmin)."""
    supers = K // k_quant_rows.SUPER
    blocks = rng.integers(0, 256, (N, supers, k_quant_rows.BLOCK_BYTES[kind]), dtype=np.uint8)

    def halves() -> np.ndarray:
        return (rng.random((N, supers)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8).reshape(N, supers, 2)

    if kind == "Q6_K":
        blocks[..., 208:210] = halves()
    else:
        blocks[..., 0:2], blocks[..., 2:4] = halves(), halves()
    return blocks.reshape(N, -1)


def session(kind: str, raw: np.ndarray, op: str, ids: bool) -> ort.InferenceSession:
    packed = k_quant_rows.pack(raw, kind)
    inputs = [helper.make_tensor_value_info("x", TensorProto.INT64, ["m"]) if ids
              else helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", K])]
    graph = helper.make_graph([helper.make_node(op, ["x", *k_quant_rows.PARTS], ["y"], domain=native.DOMAIN)], "g",
                              inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", "n"])],
                              [numpy_helper.from_array(packed[part], part) for part in k_quant_rows.PARTS])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(native.DOMAIN, 1)])
    onnx.checker.check_model(model)
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(native.operators_library()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def ggml_product(x: np.ndarray, raw: np.ndarray, kind: str) -> np.ndarray:
    """ggml's vec_dot_q*_K_q8_K in numpy: x rounded to Q8_K (per 256 iscale = 127/peak), integer dots per 32 (Q6_K:
    16) weighted by the block's sc, minus the m (Q6_K: 32·sc) terms, one float step per 256."""
    parts = k_quant_rows.decode(raw, kind)
    blocks = x.reshape(len(x), -1, k_quant_rows.SUPER)
    peak = np.abs(blocks).max(-1, keepdims=True)
    iscale = np.float32(127) / np.where(peak == 0, 1, peak)
    codes = np.rint(blocks * iscale).astype(np.int64)
    d = np.where(peak == 0, 0, np.float32(1) / iscale)[..., 0].astype(np.float64)  # [M, supers]
    sub = 16 if kind == "Q6_K" else 32
    a = codes.reshape(len(x), -1, sub)
    dots = np.einsum("msk,nsk->mns", a, parts["codes"].astype(np.int64).reshape(N, -1, sub))
    scales = parts["scales"].astype(np.int64)[None]
    per_super = lambda v: v.reshape(len(x), N, -1, k_quant_rows.SUPER // sub).sum(-1)  # noqa: E731
    offsets = a.sum(-1)[:, None] * (32 * scales if kind == "Q6_K" else parts["mins"].astype(np.int64)[None])
    if kind == "Q6_K":
        return (d[:, None] * parts["d"][None] * (per_super(dots * scales) - per_super(offsets))).sum(-1)
    sums, mins = per_super(dots * scales), per_super(offsets)
    return (d[:, None] * (parts["d"][None] * sums - parts["dmin"][None] * mins)).sum(-1)


@pytest.mark.parametrize("kind", KINDS)
def test_the_packed_blocks_hold_the_gguf_packages_values_and_gather_them_bit_for_bit(kind):
    raw = random_blocks(kind, np.random.default_rng(0))
    expected = quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(N, K).astype(np.float32)
    assert np.array_equal(k_quant_rows.values(raw, kind).view(np.uint32), expected.view(np.uint32))
    (rows,) = session(kind, raw, k_quant_rows.GATHER, ids=True).run(None, {"x": np.arange(N)[::-1].copy()})
    assert np.array_equal(rows.view(np.uint32), expected[::-1].view(np.uint32))


@pytest.mark.parametrize("kind", KINDS)
def test_a_product_is_ggmls_integer_arithmetic_and_a_row_ignores_its_neighbours(kind):
    rng = np.random.default_rng(1)
    raw = random_blocks(kind, rng)
    x = rng.standard_normal((7, K)).astype(np.float32) * np.linspace(0.1, 3, K, dtype=np.float32)
    x[3] = 0  # a block of zeros: d = 0, codes 0
    x[5, :256] = np.arange(256) % 20 - 9.5  # codes on halves: round to even
    run = session(kind, raw, k_quant_rows.MATMUL, ids=False)
    (y,) = run.run(None, {"x": x})
    assert y.shape == (7, 24) and not y[:, N:].any()  # the padding columns of the last tile
    y = y[:, :N]
    expected = ggml_product(x, raw, kind)
    assert np.abs(y - expected).max() <= 1e-6 * np.abs(expected).max()
    assert not y[3].any()
    unrounded = x @ k_quant_rows.values(raw, kind).T
    assert np.abs(y - unrounded).max() > 1e-3 * np.abs(expected).max()  # the activations are rounded
    for row in (0, 5, 6):
        assert np.array_equal(run.run(None, {"x": x[row : row + 1]})[0][:, :N], y[row : row + 1])
