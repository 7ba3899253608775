"""The Triton kernel of `DSparkVarlenAttention` against the numpy reference: on a GPU when there is one,
else on CPU through Triton's interpreter (`TRITON_INTERPRET=1`), which runs the same kernel code."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from dspark_plugins.reference import varlen_attention as reference  # noqa: E402
from dspark_plugins.triton_varlen import default_splits, varlen_attention  # noqa: E402
from dspark_plugins.trt_plugin import launch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ragged_batch(rng, slots, q_heads, kv_heads, dim, capacity, new_per_slot):
    """Interleaved new tokens of several slots (a prefill chunk, verification blocks, an idle slot) over
    caches whose rows past `cache_len` hold huge values that must never be read."""
    cache_len = rng.integers(0, capacity - max(new_per_slot), slots)
    cache_len[0] = 0  # a fresh request: prefill with no cache
    slot = np.concatenate([np.full(n, s) for s, n in enumerate(new_per_slot)])
    rng.shuffle(slot)
    pos = np.zeros(len(slot), dtype=np.int64)
    for s in range(slots):
        mine = np.flatnonzero(slot == s)
        pos[mine] = cache_len[s] + np.arange(len(mine))
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    k_cache, v_cache = normal(slots, kv_heads, capacity, dim), normal(slots, kv_heads, capacity, dim)
    for s in range(slots):
        k_cache[s, :, cache_len[s]:] = 1e4
        v_cache[s, :, cache_len[s]:] = 1e4
    tokens = len(slot)
    return (
        normal(tokens, q_heads, dim),
        normal(tokens, kv_heads, dim),
        normal(tokens, kv_heads, dim),
        k_cache,
        v_cache,
        slot.astype(np.int64),
        pos,
        cache_len.astype(np.int64),
    )


@pytest.mark.parametrize("q_heads, kv_heads, dim, bidirectional, splits", [
    (8, 2, 64, False, 1),  # GQA 4:1, causal, one split
    (6, 2, 16, False, 3),  # a group of 3 (not a power of two), split cache
    (4, 4, 32, True, 2),  # MHA, bidirectional mode (the drafter)
])
def test_kernel_matches_the_reference(q_heads, kv_heads, dim, bidirectional, splits):
    rng = np.random.default_rng(q_heads * dim + splits)
    arrays = ragged_batch(
        rng, slots=4, q_heads=q_heads, kv_heads=kv_heads, dim=dim, capacity=80, new_per_slot=[9, 4, 0, 1]
    )
    expected = reference(*arrays, bidirectional=bidirectional)
    tensors = [torch.from_numpy(a).to(DEVICE) for a in arrays]
    out = varlen_attention(*tensors, bidirectional=bidirectional, splits=splits, block_n=16)
    np.testing.assert_allclose(out.cpu().numpy(), expected, atol=1e-5)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
def test_half_precision_accumulates_in_float32(dtype, tolerance):
    rng = np.random.default_rng(7)
    arrays = ragged_batch(rng, slots=2, q_heads=4, kv_heads=2, dim=32, capacity=64, new_per_slot=[3, 5])
    rounded = [torch.from_numpy(a).to(dtype).float().numpy() if a.dtype.kind == "f" else a for a in arrays]
    tensors = [torch.from_numpy(a).to(DEVICE) for a in arrays]
    tensors[:5] = [t.to(dtype) for t in tensors[:5]]
    out = varlen_attention(*tensors, splits=2, block_n=16)
    assert out.dtype == dtype
    np.testing.assert_allclose(out.float().cpu().numpy(), reference(*rounded), atol=tolerance)


def test_plugin_launcher_writes_the_output_buffer():
    rng = np.random.default_rng(3)
    arrays = ragged_batch(rng, slots=2, q_heads=2, kv_heads=1, dim=16, capacity=40, new_per_slot=[2, 3])
    tensors = [torch.from_numpy(a).to(DEVICE) for a in arrays]
    out = torch.zeros_like(tensors[0])
    launch(tensors, bidirectional=0, scale=0.0, out=out)  # scale 0 means "1/sqrt(D)", as in the ONNX node
    np.testing.assert_allclose(out.cpu().numpy(), reference(*arrays), atol=1e-5)


def test_split_heuristic():
    assert default_splits(tokens=512, kv_heads=8, max_context=8192) == 1  # prefill fills the GPU by itself
    assert default_splits(tokens=4, kv_heads=8, max_context=8192) == 8  # decode over a long context: split
    assert default_splits(tokens=4, kv_heads=8, max_context=512) == 1
