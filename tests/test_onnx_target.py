"""target.onnx, built from the safetensors weights, against the torch target: mixed prefill chunks and
verification of several requests in one call, with the KV cache committed between calls, in both lowerings
(the portable op, and ONNX Runtime's GroupQueryAttention appending to its caches in place) and with
block-quantized weights (against the torch model holding the same dequantized weights)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from dspark_export.checkpoint import Checkpoint  # noqa: E402
from dspark_export.config import DecoderConfig  # noqa: E402
from dspark_export.graphs.target import build_target_onnx  # noqa: E402
from dspark_export.graphs.weights import WeightFormat, quantize_rows  # noqa: E402
from dspark_export.model import DecoderModel  # noqa: E402
from dspark_runtime.backend import OrtRunner  # noqa: E402
from dspark_runtime.batches import TargetBatch  # noqa: E402
from dspark_common.graph_io import target_io  # noqa: E402
from tests.conftest import write_hf_checkpoint  # noqa: E402

SLOTS, ROWS = 3, 32


def run_step(graph: OrtRunner, requests, slots: int = SLOTS):
    """requests: [(slot, token ids, first position)] -> logits of every token, features; commits K/V."""
    ids = np.concatenate([np.asarray(tokens) for _, tokens, _ in requests])
    slot = np.concatenate([[s] * len(tokens) for s, tokens, _ in requests])
    pos = np.concatenate([np.arange(start, start + len(tokens)) for _, tokens, start in requests])
    cache_len = np.zeros(slots, dtype=np.int64)
    for s, _, start in requests:
        cache_len[s] = start
    batch = TargetBatch(ids, pos, slot, cache_len, np.arange(len(ids)))
    return graph.run(batch)  # commits the new K/V at (slot, pos)


def two_requests(folder, graph_file, lowering="portable", weights=WeightFormat(), feature_layers=(0, 1)):
    """Two requests prefilled in interleaved chunks over two calls; returns (graph, logits a, logits b, features a)."""
    config = DecoderConfig.from_dir(folder)
    graph_file = build_target_onnx(
        Checkpoint(folder, config), graph_file, "float32", feature_layers, weights, lowering, ROWS
    )
    onnx.checker.check_model(str(graph_file), full_check=True)
    io = target_io(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, config.vocab_size,
                   2 * config.hidden_size, "float32", lowering == "ort", SLOTS, ROWS)
    graph = OrtRunner(graph_file, io, threads=1)
    rng = np.random.default_rng(0)
    seq_a, seq_b = rng.integers(0, config.vocab_size, 9), rng.integers(0, config.vocab_size, 6)
    first = run_step(graph, [(2, seq_b[:4], 0), (0, seq_a[:5], 0)])  # two prefill chunks
    second = run_step(graph, [(0, seq_a[5:], 5), (2, seq_b[4:], 4)])  # continue both
    logits_a = np.concatenate([first["logits"][4:9], second["logits"][:4]])
    logits_b = np.concatenate([first["logits"][:4], second["logits"][4:]])
    features_a = np.concatenate([first["features"][4:9], second["features"][:4]])
    return (seq_a, seq_b), logits_a, logits_b, features_a


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 5e5}
ARCHITECTURES = {"qwen3-tied": dict(tie_word_embeddings=True), "qwen3-untied": dict(tie_word_embeddings=False),
                 "qwen2.5": dict(architecture="qwen2", tie_word_embeddings=True),
                 "llama3": dict(architecture="llama", tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)}


@pytest.mark.parametrize("lowering", ["portable", "ort"])
@pytest.mark.parametrize("case", ARCHITECTURES)
def test_target_graph_matches_torch(tmp_path, case, lowering):
    folder = write_hf_checkpoint(tmp_path / "ckpt", seed=len(case), **ARCHITECTURES[case])
    (seq_a, seq_b), logits_a, logits_b, features_a = two_requests(folder, tmp_path / "target.onnx", lowering)
    model = DecoderModel.from_checkpoint(Checkpoint(folder, DecoderConfig.from_dir(folder)), "float32")
    with torch.no_grad():
        ref_a = model(torch.from_numpy(seq_a[None]), feature_layers=(0, 1))
        ref_b = model(torch.from_numpy(seq_b[None]), feature_layers=(0, 1))
    assert np.abs(logits_a - ref_a.logits[0].numpy()).max() <= 1e-4
    assert np.abs(logits_b - ref_b.logits[0].numpy()).max() <= 1e-4
    expected = torch.cat([ref_a.features[0], ref_a.features[1]], -1)[0].numpy()
    assert np.abs(features_a - expected).max() <= 1e-4


def test_one_slot_graph_skips_the_slot_layout(tmp_path):
    """An engine of one cache slot needs no slot layout (its rows are the slot's): its graph reads neither
    `slot_rows` nor `token_rows` and computes what the slot-laid-out graph computes, over chunked steps."""
    folder = write_hf_checkpoint(tmp_path / "ckpt", tie_word_embeddings=True)
    config = DecoderConfig.from_dir(folder)
    io = target_io(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, config.vocab_size, 0,
                   "float32", True, 1, ROWS)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, 9)
    logits = []
    for one_slot in (False, True):
        graph_file = build_target_onnx(Checkpoint(folder, config), tmp_path / f"{one_slot}.onnx", lowering="ort",
                                       cache_rows=ROWS, one_slot=one_slot)
        read = {name for node in onnx.load(str(graph_file)).graph.node for name in node.input}
        assert ("slot_rows" in read, "token_rows" in read) == (not one_slot, not one_slot)
        graph = OrtRunner(graph_file, io, threads=1)
        steps = [run_step(graph, [(0, tokens[:5], 0)], 1), run_step(graph, [(0, tokens[5:8], 5)], 1),
                 run_step(graph, [(0, tokens[8:], 8)], 1)]
        logits.append(np.concatenate([step["logits"] for step in steps]))
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-5)


def dequantized(weight: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    codes, scales = quantize_rows(weight.float().numpy(), bits, block_size)
    if bits == 4:
        codes = np.stack([codes & 15, codes >> 4], -1).reshape(*codes.shape[:2], block_size)
    values = (codes.astype(np.float32) - (1 << (bits - 1))) * scales[..., None]
    return torch.from_numpy(values.reshape(weight.shape))


@pytest.mark.parametrize("name, bits, architecture", [("int8", 8, "qwen3"), ("int4", 4, "qwen3"), ("int4", 4, "qwen2")])
def test_quantized_target_computes_with_its_dequantized_weights(tmp_path, name, bits, architecture):
    """accuracy_level 0 (float compute): the quantized graph is the torch model with dequantized projections (and
    Qwen2.5's q/k/v biases added by the quantized matmul)."""
    folder = write_hf_checkpoint(tmp_path / "ckpt", tie_word_embeddings=True, architecture=architecture)
    weights = WeightFormat(name, block_size=16, accuracy_level=0)
    (seq_a, _), logits_a, _, features_a = two_requests(folder, tmp_path / "target.onnx", "ort", weights)
    model = DecoderModel.from_checkpoint(Checkpoint(folder, DecoderConfig.from_dir(folder)), "float32")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) or isinstance(module, torch.nn.Embedding):
                module.weight.copy_(dequantized(module.weight, bits, 16))
        reference = model(torch.from_numpy(seq_a[None]), feature_layers=(0, 1))
    assert np.abs(logits_a - reference.logits[0].numpy()).max() <= 1e-3
    expected = torch.cat([reference.features[0], reference.features[1]], -1)[0].numpy()
    assert np.abs(features_a - expected).max() <= 1e-3
    plain = DecoderModel.from_checkpoint(Checkpoint(folder, DecoderConfig.from_dir(folder)), "float32")
    with torch.no_grad():
        error = np.abs(logits_a - plain(torch.from_numpy(seq_a[None])).logits[0].numpy()).max()
    assert error > 1e-3  # the weights really were quantized
