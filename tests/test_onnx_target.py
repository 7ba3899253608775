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
from dspark_export.config import Qwen3Config  # noqa: E402
from dspark_export.graphs.target import build_target_onnx  # noqa: E402
from dspark_export.graphs.weights import WeightFormat, quantize_rows  # noqa: E402
from dspark_export.model import Qwen3Model  # noqa: E402
from dspark_runtime.backend import OrtGraph  # noqa: E402
from dspark_runtime.batches import TargetBatch  # noqa: E402
from dspark_runtime.graph_io import target_io  # noqa: E402
from tests.conftest import write_hf_checkpoint  # noqa: E402

SLOTS, ROWS = 3, 32


def run_step(graph: OrtGraph, requests):
    """requests: [(slot, token ids, first position)] -> logits of every token, features; commits K/V."""
    ids = np.concatenate([np.asarray(tokens) for _, tokens, _ in requests])
    slot = np.concatenate([[s] * len(tokens) for s, tokens, _ in requests])
    pos = np.concatenate([np.arange(start, start + len(tokens)) for _, tokens, start in requests])
    cache_len = np.zeros(SLOTS, dtype=np.int64)
    for s, _, start in requests:
        cache_len[s] = start
    batch = TargetBatch(ids, pos, slot, cache_len, np.arange(len(ids)))
    result = graph.run(batch.feeds(graph.io))
    if not graph.io.in_place:  # commit the new K/V at (slot, pos), as the runtime does
        graph.cache.write(slot, pos, result)
    return result


def two_requests(folder, graph_file, lowering="portable", weights=WeightFormat(), feature_layers=(0, 1)):
    """Two requests prefilled in interleaved chunks over two calls; returns (graph, logits a, logits b, features a)."""
    config = Qwen3Config.from_dir(folder)
    graph_file = build_target_onnx(
        Checkpoint(folder, config), graph_file, "float32", feature_layers, weights, lowering, ROWS
    )
    onnx.checker.check_model(str(graph_file), full_check=True)
    io = target_io(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, config.vocab_size,
                   2 * config.hidden_size, "float32", lowering == "ort", SLOTS, ROWS)
    graph = OrtGraph(graph_file, io, threads=1)
    rng = np.random.default_rng(0)
    seq_a, seq_b = rng.integers(0, config.vocab_size, 9), rng.integers(0, config.vocab_size, 6)
    first = run_step(graph, [(2, seq_b[:4], 0), (0, seq_a[:5], 0)])  # two prefill chunks
    second = run_step(graph, [(0, seq_a[5:], 5), (2, seq_b[4:], 4)])  # continue both
    logits_a = np.concatenate([first["logits"][4:9], second["logits"][:4]])
    logits_b = np.concatenate([first["logits"][:4], second["logits"][4:]])
    features_a = np.concatenate([first["features"][4:9], second["features"][:4]])
    return (seq_a, seq_b), logits_a, logits_b, features_a


@pytest.mark.parametrize("lowering", ["portable", "ort"])
@pytest.mark.parametrize("tied", [True, False])
def test_target_graph_matches_torch(tmp_path, tied, lowering):
    folder = write_hf_checkpoint(tmp_path / "ckpt", seed=int(tied), tie_word_embeddings=tied)
    (seq_a, seq_b), logits_a, logits_b, features_a = two_requests(folder, tmp_path / "target.onnx", lowering)
    model = Qwen3Model.from_checkpoint(Checkpoint(folder, Qwen3Config.from_dir(folder)), "float32")
    with torch.no_grad():
        ref_a = model(torch.from_numpy(seq_a[None]), feature_layers=(0, 1))
        ref_b = model(torch.from_numpy(seq_b[None]), feature_layers=(0, 1))
    assert np.abs(logits_a - ref_a.logits[0].numpy()).max() <= 1e-4
    assert np.abs(logits_b - ref_b.logits[0].numpy()).max() <= 1e-4
    expected = torch.cat([ref_a.features[0], ref_a.features[1]], -1)[0].numpy()
    assert np.abs(features_a - expected).max() <= 1e-4


def dequantized(weight: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    codes, scales = quantize_rows(weight.float().numpy(), bits, block_size)
    if bits == 4:
        codes = np.stack([codes & 15, codes >> 4], -1).reshape(*codes.shape[:2], block_size)
    values = (codes.astype(np.float32) - (1 << (bits - 1))) * scales[..., None]
    return torch.from_numpy(values.reshape(weight.shape))


@pytest.mark.parametrize("name, bits", [("int8", 8), ("int4", 4)])
def test_quantized_target_computes_with_its_dequantized_weights(tmp_path, name, bits):
    """accuracy_level 0 (float compute): the quantized graph is the torch model with dequantized projections."""
    folder = write_hf_checkpoint(tmp_path / "ckpt", tie_word_embeddings=True)
    weights = WeightFormat(name, block_size=16, accuracy_level=0)
    (seq_a, _), logits_a, _, features_a = two_requests(folder, tmp_path / "target.onnx", "ort", weights)
    model = Qwen3Model.from_checkpoint(Checkpoint(folder, Qwen3Config.from_dir(folder)), "float32")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) or isinstance(module, torch.nn.Embedding):
                module.weight.copy_(dequantized(module.weight, bits, 16))
        reference = model(torch.from_numpy(seq_a[None]), feature_layers=(0, 1))
    assert np.abs(logits_a - reference.logits[0].numpy()).max() <= 1e-3
    expected = torch.cat([reference.features[0], reference.features[1]], -1)[0].numpy()
    assert np.abs(features_a - expected).max() <= 1e-3
    plain = Qwen3Model.from_checkpoint(Checkpoint(folder, Qwen3Config.from_dir(folder)), "float32")
    with torch.no_grad():
        error = np.abs(logits_a - plain(torch.from_numpy(seq_a[None])).logits[0].numpy()).max()
    assert error > 1e-3  # the weights really were quantized
