"""`--weights w4a8`: int4 weights in blocks of 32 (float16 scales) and activations quantized to int8 per row, through
DSpark's own ONNX Runtime operators (runtime/dspark_common/native/int4_rows.c, compiled on first use). A block's
products are integers; a row's result depends on nothing but the row, and it is what numpy computes from the same
codes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from dspark_common import int4_rows
from dspark_common.errors import DSparkError, MissingDependencyError
from dspark_common.native import DOMAIN, operators_library, uses_operators
from dspark_export.build import check_options
from dspark_export.graphs.model_file import uses_domain
from dspark_export.checkpoint import as_float32
from dspark_export.graphs.weights import ExternalData, WeightFormat, Weights, convert, format_values
from dspark_plugins.builder import GraphBuilder
from dspark_plugins.onnx_function import opset_imports

K, N = 96, 80


def session_of(tmp_path, weight: np.ndarray, emit, inputs: list, outputs: list) -> ort.InferenceSession:
    """A session of the nodes `emit(weights, b)` adds for a w4a8 `Weights` reading `weight` as "w"."""
    graph_file = tmp_path / "g.onnx"
    store = ExternalData(graph_file)
    weights = Weights(lambda name: (weight, "float32"), store, "float32", WeightFormat("w4a8"))
    b = GraphBuilder()
    b.op("Identity", emit(weights, b), name="y")
    store.close()
    assert uses_domain(b.nodes, DOMAIN)
    graph = helper.make_graph(b.nodes, "g", inputs, outputs, list(weights.initializers.values()))
    model = helper.make_model(graph, opset_imports=[*opset_imports(), helper.make_opsetid(DOMAIN, 1)])
    onnx.save(model, str(graph_file))
    assert uses_operators(graph_file)  # what a runner registers the library by
    onnx.checker.check_model(str(graph_file))
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(operators_library()))
    return ort.InferenceSession(str(graph_file), options, providers=["CPUExecutionProvider"])


def reference(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """What the operator computes, in numpy: per block of 32 the integer products of the row codes and the weight
    codes, scaled by the block's weight scale and summed over blocks in order, then by the row's scale."""
    codes = np.rint(format_values(weight, WeightFormat("w4a8")) / block_scales(weight)).astype(np.int64)
    row_scales = np.maximum(np.abs(x).max(1, keepdims=True) / np.float32(127), np.finfo(np.float32).tiny)
    row_codes = np.rint(x / row_scales).astype(np.int64)
    blocks = np.einsum("mbk,nbk->mnb", row_codes.reshape(len(x), -1, 32), codes.reshape(len(weight), -1, 32))
    return (blocks * block_scales(weight)[:, ::32]).sum(-1) * row_scales


def block_scales(weight: np.ndarray) -> np.ndarray:
    """Each weight's block scale, [N, K]."""
    _, scales = int4_rows.pack(weight)
    per_column = scales.transpose(0, 2, 1).reshape(-1, weight.shape[1] // 32).astype(np.float64)
    return np.repeat(per_column[: len(weight)], 32, axis=1)


@pytest.fixture
def weight():
    rng = np.random.default_rng(1)
    return (rng.standard_normal((N, K)) * rng.random((N, 1)) * 0.1).astype(np.float32)


def test_packing_keeps_each_blocks_largest_weight_and_the_rest_within_a_step(weight):
    codes, scales = int4_rows.pack(weight)
    assert codes.shape == (N // 8, K // 32, 128) and codes.dtype == np.uint8 and scales.dtype == np.float16
    values = int4_rows.unpack(codes, scales)
    step = block_scales(weight)
    assert np.all(np.abs(values - weight) <= np.abs(step) + 1e-7)  # half a step, but where code 7 clips
    peaks = np.abs(weight.reshape(N, -1, 32)).argmax(-1)
    largest = np.take_along_axis(weight.reshape(N, -1, 32), peaks[..., None], -1)
    assert np.allclose(np.take_along_axis(values.reshape(N, -1, 32), peaks[..., None], -1), largest, rtol=1e-3)


def test_a_w4a8_projection_is_integer_arithmetic_and_its_rows_ignore_their_neighbours(tmp_path, weight):
    session = session_of(tmp_path, weight, lambda weights, b: weights.linear(b, "x", "w"),
                         [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])])
    rng = np.random.default_rng(2)
    x = rng.standard_normal((9, K)).astype(np.float32)
    x[3] *= 1000  # a row with outliers gets its own scale; the others keep theirs
    x[5] = 0  # an all-zero row stays zero
    whole = session.run(None, {"x": x})[0]
    assert np.allclose(whole, reference(x, weight), rtol=1e-5, atol=0)
    assert not whole[5].any()
    for start, stop in ((0, 1), (3, 4), (1, 3), (2, 9), (4, 8), (8, 9)):
        assert np.array_equal(session.run(None, {"x": x[start:stop]})[0], whole[start:stop])
    exact = x @ weight.T
    assert np.abs(whole - exact).max() / np.abs(exact).max() < 0.1  # and it is near the float product


def test_an_embedding_gathers_the_rows_its_tied_head_multiplies(tmp_path, weight):
    session = session_of(tmp_path, weight, lambda weights, b: weights.embedding(b, "ids", "w"),
                         [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, K])])
    ids = np.array([[0, 7, 8], [79, 41, 7]], np.int64)
    assert np.array_equal(session.run(None, {"ids": ids})[0], int4_rows.unpack(*int4_rows.pack(weight))[ids])


def test_an_output_width_short_of_whole_tiles_is_padded_and_sliced(tmp_path, weight):
    narrow = weight[:12]  # 12 outputs: a tile and a half
    session = session_of(tmp_path, narrow, lambda weights, b: weights.linear(b, "x", "w"),
                         [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 12])])
    x = np.random.default_rng(4).standard_normal((3, K)).astype(np.float32)
    assert np.allclose(session.run(None, {"x": x})[0], reference(x, narrow), rtol=1e-5, atol=0)


def test_w4a8_needs_float32_activations_and_input_widths_of_whole_blocks(tmp_path):
    with pytest.raises(DSparkError, match="w4a8 computes in float32"):
        check_options(None, "ort", "float16", WeightFormat("w4a8"), None)
    odd = np.ones((16, 48), np.float32)  # 48 inputs: a block and a half
    weights = Weights(lambda name: (odd, "float32"), ExternalData(tmp_path / "g.onnx"), "float32",
                      WeightFormat("w4a8"))
    with pytest.raises(DSparkError, match="input widths that 32 divides"):
        weights.linear(GraphBuilder(), "x", "w")


def test_without_a_c_compiler_w4a8_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(MissingDependencyError, match="install gcc, or set CC"):
        operators_library()


def test_stacked_bfloat16_matrices_pack_as_their_float_values(tmp_path, weight):
    """q, k and v stored in bfloat16 and stacked into one product pack as one float32 matrix of their values."""
    halves = {"a": convert(weight[:40], "float32", "bfloat16"), "b": convert(weight[40:], "float32", "bfloat16")}
    weights = Weights(lambda name: (halves[name], "bfloat16"), ExternalData(tmp_path / "g.onnx"), "float32",
                      WeightFormat("w4a8"))
    codes, scales = weights._tiles(["a", "b"])
    weights.store.close()
    values = np.concatenate([as_float32(halves["a"], "bfloat16"), as_float32(halves["b"], "bfloat16")])
    assert [int(d) for d in weights.initializers[codes].dims] == [N // 8, K // 32, 128]
    assert np.array_equal(onnx.numpy_helper.to_array(weights.initializers[scales], str(tmp_path)), int4_rows.pack(values)[1])


def test_a_graph_without_dspark_operators_is_told_apart(tmp_path):
    """`uses_operators` reads the opset imports from the file's protobuf fields: a graph of ONNX's own ops alone (its
    node named after the domain, which a text search would mistake) does not import `ai.dspark`."""
    node = helper.make_node("Identity", ["x"], ["y"], name=DOMAIN)
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [2])  # noqa: E731
    model = helper.make_model(helper.make_graph([node], DOMAIN, [value("x")], [value("y")]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(tmp_path / "plain.onnx"))
    assert not uses_operators(tmp_path / "plain.onnx")
