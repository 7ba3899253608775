"""target.onnx, built from the safetensors weights, against the torch target: mixed prefill chunks and
verification of several requests in one call, with the KV cache committed between calls."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")

from dspark_export.checkpoint import Checkpoint  # noqa: E402
from dspark_export.config import Qwen3Config  # noqa: E402
from dspark_export.model import Qwen3Model  # noqa: E402
from dspark_export.graphs.target import build_target_onnx  # noqa: E402
from tests.conftest import write_hf_checkpoint  # noqa: E402

SLOTS, LMAX = 3, 32


def run_step(session, config, caches, requests):
    """requests: [(slot, token ids, first position)] -> logits of every token, features; commits K/V."""
    ids = np.concatenate([np.asarray(tokens) for _, tokens, _ in requests]).astype(np.int64)
    slot = np.concatenate([[s] * len(tokens) for s, tokens, _ in requests]).astype(np.int64)
    pos = np.concatenate([np.arange(start, start + len(tokens)) for _, tokens, start in requests]).astype(np.int64)
    cache_len = np.zeros(SLOTS, dtype=np.int64)
    for s, _, start in requests:
        cache_len[s] = start
    feeds = {"input_ids": ids, "pos": pos, "slot": slot, "cache_len": cache_len, "logit_index": np.arange(len(ids))}
    for layer in range(config.num_hidden_layers):
        feeds[f"past_key_{layer}"], feeds[f"past_value_{layer}"] = caches[layer]
    names = [o.name for o in session.get_outputs()]
    result = dict(zip(names, session.run(None, feeds)))
    for layer in range(config.num_hidden_layers):  # commit the new K/V at (slot, pos)
        keys, values = caches[layer]
        keys[slot, :, pos] = result[f"new_key_{layer}"]
        values[slot, :, pos] = result[f"new_value_{layer}"]
    return result


@pytest.mark.parametrize("tied", [True, False])
def test_target_graph_matches_torch(tmp_path, tied):
    folder = write_hf_checkpoint(tmp_path / "ckpt", seed=int(tied), tie_word_embeddings=tied)
    config = Qwen3Config.from_dir(folder)
    checkpoint = Checkpoint(folder, config)
    graph = build_target_onnx(checkpoint, tmp_path / "engine" / "target.onnx", feature_layers=(0, 1))
    onnx.checker.check_model(str(graph), full_check=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(graph), options)
    shape = (SLOTS, config.num_key_value_heads, LMAX, config.head_dim)
    caches = [(np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for _ in range(config.num_hidden_layers)]
    rng = np.random.default_rng(0)
    seq_a, seq_b = rng.integers(0, config.vocab_size, 9), rng.integers(0, config.vocab_size, 6)
    first = run_step(session, config, caches, [(2, seq_b[:4], 0), (0, seq_a[:5], 0)])  # two prefill chunks
    second = run_step(session, config, caches, [(0, seq_a[5:], 5), (2, seq_b[4:], 4)])  # continue both
    model = Qwen3Model.from_checkpoint(checkpoint, "float32")
    with torch.no_grad():
        ref_a = model(torch.from_numpy(seq_a[None]), feature_layers=(0, 1))
        ref_b = model(torch.from_numpy(seq_b[None]), feature_layers=(0, 1))
    got_a = np.concatenate([first["logits"][4:9], second["logits"][:4]])
    got_b = np.concatenate([first["logits"][:4], second["logits"][4:]])
    assert np.abs(got_a - ref_a.logits[0].numpy()).max() <= 1e-4
    assert np.abs(got_b - ref_b.logits[0].numpy()).max() <= 1e-4
    features_a = np.concatenate([first["features"][4:9], second["features"][:4]])
    expected = torch.cat([ref_a.features[0], ref_a.features[1]], -1)[0].numpy()
    assert np.abs(features_a - expected).max() <= 1e-4
