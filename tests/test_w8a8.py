"""`--weights w8a8`: int8 weights per output channel, activations quantized per row at run time, integer products
through ONNX Runtime's `MatMulInteger`. A row's result is exact integer arithmetic followed by two scalings, so it
is the same whatever other rows share the step, and it is what numpy computes from the same codes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from dspark_common import cpu
from dspark_export.graphs.weights import (
    ExternalData,
    WeightFormat,
    Weights,
    channel_quantized_values,
    quantize_channels,
)
from dspark_plugins.builder import GraphBuilder
from dspark_plugins.onnx_function import opset_imports

K, N = 96, 80


CODE_MAX = cpu.int8_code_max()  # what a build on this CPU stores: 8-bit codes sum exactly only with VNNI or AMX


def one_projection(tmp_path, weight: np.ndarray, code_max: int = CODE_MAX, bias: np.ndarray | None = None,
                   coupled_rows: bool = False):
    """A session computing x @ weight^T (+ bias) as a w8a8 engine's `Weights.linear` emits it (a drafter's with
    `coupled_rows`), and its store."""
    tensors = {"w": weight} | ({"b": bias} if bias is not None else {})
    graph_file = tmp_path / "g.onnx"
    store = ExternalData(graph_file)
    weights = Weights(lambda name: (tensors[name], "float32"), store, "float32",
                      WeightFormat("w8a8", code_max=code_max), coupled_rows=coupled_rows)
    b = GraphBuilder()
    y = weights.linear(b, "x", "w", "b" if bias is not None else None)
    b.op("Identity", y, name="y")
    store.close()
    graph = helper.make_graph(b.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])],
                              list(weights.initializers.values()))
    model = helper.make_model(graph, opset_imports=[*opset_imports(), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(graph_file))
    onnx.checker.check_model(str(graph_file))
    session = ort.InferenceSession(str(graph_file), providers=["CPUExecutionProvider"])
    return session, weights


def reference(x: np.ndarray, weight: np.ndarray, code_max: int = CODE_MAX) -> np.ndarray:
    """What the graph computes, in numpy: integer products of the row codes and weight codes, then the scales."""
    codes, scales = quantize_channels(weight, code_max)
    row_scales = np.maximum(np.abs(x).max(1, keepdims=True) / np.float32(127), np.finfo(np.float32).tiny)
    row_codes = np.rint(x / row_scales).astype(np.int64)
    product = (row_codes @ codes.T.astype(np.int64)).astype(np.float32)
    return product * scales * row_scales


@pytest.fixture
def weight():
    rng = np.random.default_rng(1)
    return (rng.standard_normal((N, K)) * rng.random((N, 1)) * 0.1).astype(np.float32)


def test_a_w8a8_projection_is_integer_arithmetic_and_its_rows_ignore_their_neighbours(tmp_path, weight):
    session, _ = one_projection(tmp_path, weight)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((9, K)).astype(np.float32)
    x[3] *= 1000  # a row with outliers gets its own scale; the others keep theirs
    x[5] = 0  # an all-zero row stays zero
    whole = session.run(None, {"x": x})[0]
    assert np.array_equal(whole, reference(x, weight))
    assert not whole[5].any()
    for start, stop in ((0, 1), (3, 4), (1, 3), (2, 9), (4, 8), (8, 9)):
        assert np.array_equal(session.run(None, {"x": x[start:stop]})[0], whole[start:stop])
    exact = x @ weight.T
    assert np.abs(whole - exact).max() / np.abs(exact).max() < 0.02  # and it is close to the float product


def test_w8a8_adds_the_bias_and_shares_one_activation_quantization_per_input(tmp_path, weight):
    bias = np.linspace(-1, 1, N).astype(np.float32)
    session, weights = one_projection(tmp_path, weight, bias=bias)
    x = np.random.default_rng(3).standard_normal((4, K)).astype(np.float32)
    assert np.allclose(session.run(None, {"x": x})[0], reference(x, weight) + bias, rtol=0, atol=1e-6)
    b = GraphBuilder()
    weights.linear(b, "x", "w")
    weights.linear(b, "x", "w")
    assert [node.op_type for node in b.nodes].count("ReduceMax") == 1


def test_a_drafters_w8a8_product_is_one_fused_op_over_the_same_codes(tmp_path, weight):
    """A drafter's projections (`coupled_rows`) quantize the whole input with one scale in ONNX Runtime's fused
    `DynamicQuantizeMatMul` (no per-row ops: its drafts are guesses the target verifies), over the same weight codes:
    close to the float product, the bias added."""
    bias = np.linspace(-1, 1, N).astype(np.float32)
    session, weights = one_projection(tmp_path, weight, bias=bias, coupled_rows=True)
    b = GraphBuilder()
    weights.linear(b, "x", "w")
    assert [node.op_type for node in b.nodes] == ["DynamicQuantizeMatMul"]
    x = np.random.default_rng(5).standard_normal((6, K)).astype(np.float32)
    exact = x @ weight.T + bias
    assert np.abs(session.run(None, {"x": x})[0] - exact).max() / np.abs(exact).max() < 0.03


def test_seven_bit_codes_cannot_saturate_an_int16_pair_of_products(tmp_path, weight):
    """Without VNNI, ONNX Runtime's u8 x s8 kernel adds two products (each up to 255 · |code|) in int16: the 7-bit
    codes chosen there keep every pair below 2^15, and the projection still agrees with numpy."""
    session, weights = one_projection(tmp_path, weight, code_max=63)
    codes = onnx.numpy_helper.to_array(weights.initializers["w.q"], str(tmp_path)).astype(np.int64)
    assert codes.shape == (K, N) and np.abs(codes).max() == 63
    pairs = 255 * (np.abs(codes[0::2]) + np.abs(codes[1::2]))
    assert pairs.max() < 2**15
    x = np.random.default_rng(4).standard_normal((3, K)).astype(np.float32)
    assert np.array_equal(session.run(None, {"x": x})[0], reference(x, weight, 63))
    assert np.abs(channel_quantized_values(weight, 63) - weight).max() <= np.abs(weight).max() / 63


@pytest.mark.parametrize("flags, machine, expected", [({"avx2", "avx512_vnni"}, "x86_64", 127),
                                                       ({"avx2", "avx_vnni"}, "x86_64", 127),
                                                       ({"avx2", "amx_int8"}, "x86_64", 127),
                                                       ({"avx2", "avx512bw"}, "x86_64", 63),
                                                       (set(), "x86_64", 63),
                                                       (set(), "aarch64", 127)])
def test_the_code_range_follows_how_the_cpu_sums_int8_products(monkeypatch, flags, machine, expected):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu.platform, "machine", lambda: machine)
    assert cpu.int8_code_max() == expected


def test_w8a8_needs_float32_activations():
    from dspark_export.build import check_options
    from dspark_common.errors import DSparkError

    with pytest.raises(DSparkError, match="w8a8 computes in float32"):
        check_options(None, "ort", "float16", WeightFormat("w8a8"), None)
    with pytest.raises(Exception, match="63 .* or 127"):
        WeightFormat("w8a8", code_max=100)


def test_smoothing_keeps_the_function_and_tames_massive_input_channels(tmp_path):
    """SmoothQuant folded into the norms and the v/up rows: the torch model of the smoothed tensors computes what the
    checkpoint does, and a channel made 100x larger at q/k/v's input (its norm weight x100, their columns /100) comes
    back to the others' range there, where w8a8 quantizes each activation row with one scale."""
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file, save_file

    from dspark_export.checkpoint import Checkpoint
    from dspark_export.config import DecoderConfig
    from dspark_export.model import DecoderModel
    from dspark_export.smoothing import SmoothedCheckpoint, activation_peaks
    from tests.conftest import write_hf_checkpoint

    folder = write_hf_checkpoint(tmp_path / "ckpt", architecture="qwen2")  # q/k/v biases: v's is smoothed too
    tensors = load_file(folder / "model.safetensors")
    for layer in (0, 1):
        tensors[f"model.layers.{layer}.input_layernorm.weight"][3] *= 100
        for name in "qkv":
            tensors[f"model.layers.{layer}.self_attn.{name}_proj.weight"][:, 3] /= 100
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    checkpoint = Checkpoint(folder, DecoderConfig.from_dir(folder))
    prompts = [list(range(1, 40)), list(range(50, 70))]
    smoothed = SmoothedCheckpoint(checkpoint, prompts)
    ids = torch.tensor([list(range(5, 30))])
    with torch.no_grad():
        expected = DecoderModel.from_checkpoint(checkpoint, "float32")(ids).logits
        got = DecoderModel.from_checkpoint(smoothed, "float32")(ids).logits
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4)
    name = "model.layers.0.self_attn.q_proj.weight"
    spread = lambda peaks: peaks[name].max() / np.median(peaks[name])  # noqa: E731
    peaks = activation_peaks(checkpoint, prompts)  # one padded batch: the pads' activations left out
    alone = [activation_peaks(checkpoint, [ids]) for ids in prompts]
    assert all(np.allclose(peaks[key], np.maximum(*(one[key] for one in alone)), rtol=1e-5) for key in peaks)
    before, after = spread(peaks), spread(activation_peaks(smoothed, prompts))
    assert before > 50 and after < before / 10


def test_smoothing_is_refused_without_w8a8(tmp_path):
    from dspark_export.build import build_engine
    from dspark_export.presets import resolve_target
    from dspark_common.errors import DSparkError

    with pytest.raises(DSparkError, match="--smooth .* --weights w8a8"):
        build_engine(resolve_target("demo"), tmp_path / "e", weights=WeightFormat("int4"), smooth=True)


def test_smoothing_without_a_named_format_builds_w8a8(tmp_path):
    """`--smooth` alone asks for w8a8: no probe, no refusal."""
    pytest.importorskip("torch")
    from dspark_export.build import build_engine
    from dspark_export.presets import resolve_target
    from dspark_common.engine_dir import read_manifest

    folder = build_engine(resolve_target("demo"), tmp_path / "e", cache_slots=1, max_context=64, smooth=True,
                          show_progress=False)
    assert read_manifest(folder).weights == "w8a8"
