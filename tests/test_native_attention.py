"""DSpark's attention operators (runtime/dspark_common/native/attention.c). `CachedAttention`: GroupQueryAttention's
slot-padded inputs and in-place caches, each query row computed the same alone and in a batch, checked against the
varlen reference (the contract every attention of DSpark's meets) with the rotary embedding applied in numpy, and
against ONNX Runtime's own GroupQueryAttention on the same inputs. `BlockAttention`: the contract's bidirectional op,
as a drafter's block uses it."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from dspark_common.native import DOMAIN, operators_library, usable
from dspark_plugins.onnx_function import opset_imports
from dspark_plugins.reference import varlen_attention

pytestmark = pytest.mark.skipif(not usable(), reason="DSpark's operators need an x86-64 CPU and a C compiler")

S, M, HQ, HKV, D, L = 3, 3, 4, 2, 48, 16  # D: a tail of 16 past the kernel's 32-wide steps
PAST = np.array([5, 0, 4])  # committed rows per slot
NEW = np.array([3, 1, 0])  # new tokens per slot (slot 2 idle)


def rope_tables(positions: int = L) -> tuple[np.ndarray, np.ndarray]:
    angles = np.arange(positions)[:, None] * (10000.0 ** (-np.arange(D // 2) / (D // 2)))[None]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rotated(x: np.ndarray, position: int, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of [..., D] at one position."""
    first, second = x[..., : D // 2], x[..., D // 2 :]
    c, s = cos[position], sin[position]
    return np.concatenate([first * c - second * s, second * c + first * s], axis=-1)


def graph_file(tmp_path, op: str) -> str:
    """A one-node graph: DSpark's CachedAttention, or ONNX Runtime's GroupQueryAttention as the target builds it."""
    floats = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    ints = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.INT32, shape)  # noqa: E731
    inputs = [floats("q", ["S", "M", HQ * D]), floats("k", ["S", "M", HKV * D]), floats("v", ["S", "M", HKV * D]),
              floats("past_key", [S, HKV, L, D]), floats("past_value", [S, HKV, L, D]), ints("seqlens_k", ["S"]),
              ints("query_seqlens", ["S"]), floats("cos", [L, D // 2]), floats("sin", [L, D // 2])]
    outputs = [floats("out", ["S", "M", HQ * D]), floats("present_key", [S, HKV, L, D]),
               floats("present_value", [S, HKV, L, D])]
    if op == "CachedAttention":
        node = helper.make_node(op, ["q", "k", "v", "past_key", "past_value", "seqlens_k", "query_seqlens", "cos",
                                     "sin"], ["out", "present_key", "present_value"], domain=DOMAIN)
        extra = [helper.make_opsetid(DOMAIN, 1)]
    else:
        inputs.append(ints("total_length", []))
        node = helper.make_node(op, ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total_length", "cos",
                                     "sin", *[""] * 7, "query_seqlens"], ["out", "present_key", "present_value"],
                                domain="com.microsoft", num_heads=HQ, kv_num_heads=HKV, do_rotary=1,
                                scale=float(D**-0.5))
        extra = [helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs), opset_imports=opset_imports() + extra)
    path = str(tmp_path / f"{op}.onnx")
    onnx.save(model, path)
    if op == "CachedAttention":
        onnx.checker.check_model(path)
    return path


def run(path: str, feeds: dict, caches: tuple[np.ndarray, np.ndarray], in_place: bool = True) -> tuple:
    """(out, present_key, present_value); in place as the runner binds them: present_* are the past_* buffers."""
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(operators_library()))
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    if not in_place:
        return tuple(session.run(None, {**{k: v for k, v in feeds.items() if k in names},
                                        "past_key": caches[0], "past_value": caches[1]}))
    buffers = [cache.copy() for cache in caches]  # the OrtValues below borrow these arrays' memory
    keys, values = (ort.OrtValue.ortvalue_from_numpy(buffer) for buffer in buffers)
    binding = session.io_binding()
    for name, value in feeds.items():
        if name in names:
            binding.bind_cpu_input(name, value)
    binding.bind_output("out", "cpu")
    binding.bind_ortvalue_input("past_key", keys)
    binding.bind_ortvalue_input("past_value", values)
    binding.bind_ortvalue_output("present_key", keys)
    binding.bind_ortvalue_output("present_value", values)
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0], buffers[0], buffers[1]


def step(rng: np.random.Generator, past: np.ndarray, new: np.ndarray) -> dict:
    width = max(int(new.max()), 1)
    q, k, v = (rng.standard_normal((S, width, h * D)).astype(np.float32) for h in (HQ, HKV, HKV))
    cos, sin = rope_tables()
    seqlens = np.where(past + new > 0, past + new - 1, 0).astype(np.int32)
    return {"q": q, "k": k, "v": v, "seqlens_k": seqlens, "query_seqlens": new.astype(np.int32), "cos": cos,
            "sin": sin, "total_length": np.array(seqlens.max() + 1, np.int32)}


def test_matches_reference_and_appends_in_place(tmp_path):
    rng = np.random.default_rng(0)
    caches = tuple(rng.standard_normal((S, HKV, L, D)).astype(np.float32) for _ in range(2))
    feeds = step(rng, PAST, NEW)
    path = graph_file(tmp_path, "CachedAttention")
    out, keys, values = run(path, feeds, caches)
    cos, sin = feeds["cos"], feeds["sin"]
    for s in range(S):
        n, past = NEW[s], PAST[s]
        new_k = np.stack([rotated(feeds["k"][s, j].reshape(HKV, D), past + j, cos, sin) for j in range(n)]) \
            if n else np.zeros((0, HKV, D), np.float32)
        new_v = feeds["v"][s, :n].reshape(n, HKV, D)
        q = np.stack([rotated(feeds["q"][s, j].reshape(HQ, D), past + j, cos, sin) for j in range(n)]) \
            if n else np.zeros((0, HQ, D), np.float32)
        expected = varlen_attention(q, new_k, new_v, caches[0], caches[1], np.full(n, s), past + np.arange(n),
                                    np.where(np.arange(S) == s, PAST, 0))
        np.testing.assert_allclose(out[s, :n].reshape(n, HQ, D), expected, rtol=2e-5, atol=2e-6)
        assert not out[s, n:].any()  # padding rows
        np.testing.assert_allclose(keys[s, :, past : past + n], new_k.transpose(1, 0, 2), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(values[s, :, past : past + n], new_v.transpose(1, 0, 2))
        untouched = np.ones(L, bool)
        untouched[past : past + n] = False
        np.testing.assert_array_equal(keys[s][:, untouched], caches[0][s][:, untouched])
    # not bound in place, the caches are carried over into fresh outputs
    apart = run(path, feeds, caches, in_place=False)
    for mine, theirs in zip(apart, (out, keys, values)):
        np.testing.assert_array_equal(mine, theirs)


def test_agrees_with_group_query_attention(tmp_path):
    rng = np.random.default_rng(1)
    caches = tuple(rng.standard_normal((S, HKV, L, D)).astype(np.float32) for _ in range(2))
    feeds = step(rng, PAST, NEW)
    ours = run(graph_file(tmp_path, "CachedAttention"), feeds, caches)
    theirs = run(graph_file(tmp_path, "GroupQueryAttention"), feeds, caches)
    for s in range(S):
        np.testing.assert_allclose(ours[0][s, : NEW[s]], theirs[0][s, : NEW[s]], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ours[2], theirs[2])


def test_a_row_alone_computes_what_it_computes_in_a_batch(tmp_path):
    rng = np.random.default_rng(2)
    caches = tuple(rng.standard_normal((S, HKV, L, D)).astype(np.float32) for _ in range(2))
    path = graph_file(tmp_path, "CachedAttention")
    batch = step(rng, PAST, NEW)
    out, keys, values = run(path, batch, caches)
    for j in range(NEW[0]):  # slot 0's token j, alone after its predecessors were committed
        alone = step(rng, PAST + np.array([j, 0, 0]), np.array([1, 0, 0])) | {
            key: batch[key][:, j : j + 1] for key in "qkv"}
        lone = run(path, alone, (keys, values))[0]
        np.testing.assert_array_equal(lone[0, 0], out[0, j])


def test_block_attention_is_the_bidirectional_contract(tmp_path):
    """Three context tokens then a block of four per slot's order, interleaved: the block's rows attend by the
    contract after the rotary embedding, and the context tokens' keys come back rotated."""
    rng = np.random.default_rng(3)
    slots, tokens, block = 3, 7, 4
    slot = np.array([1, 0, 1, 1, 0, 1, 1])  # interleaved; slot 2 idle; the last 4 tokens have queries
    cache_len = np.array([4, 9, 6])
    pos = np.array([cache_len[s] + (slot[:t] == s).sum() for t, s in enumerate(slot)])
    q = rng.standard_normal((block, HQ, D)).astype(np.float32)
    k, v = (rng.standard_normal((tokens, HKV, D)).astype(np.float32) for _ in range(2))
    caches = [rng.standard_normal((slots, HKV, L, D)).astype(np.float32) for _ in range(2)]
    cos, sin = (table[pos] for table in rope_tables())
    floats = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    longs = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.INT64, shape)  # noqa: E731
    names = ["q", "k_new", "v_new", "k_cache", "v_cache", "slot", "cache_len", "cos", "sin"]
    inputs = [floats("q", ["Tq", HQ, D]), floats("k_new", ["T", HKV, D]), floats("v_new", ["T", HKV, D]),
              floats("k_cache", [slots, HKV, L, D]), floats("v_cache", [slots, HKV, L, D]), longs("slot", ["T"]),
              longs("cache_len", [slots]), floats("cos", ["T", D // 2]), floats("sin", ["T", D // 2])]
    node = helper.make_node("BlockAttention", names, ["out", "context_keys"], domain=DOMAIN)
    graph = helper.make_graph([node], "g", inputs, [floats("out", ["Tq", HQ, D]),
                                                     floats("context_keys", ["C", HKV, D])])
    path = str(tmp_path / "block.onnx")
    onnx.save(helper.make_model(graph, opset_imports=opset_imports() + [helper.make_opsetid(DOMAIN, 1)]), path)
    onnx.checker.check_model(path)
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(operators_library()))
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    out, context_keys = session.run(None, dict(zip(names, [q, k, v, *caches, slot, cache_len, cos, sin])))
    table_cos, table_sin = rope_tables(int(pos.max()) + 1)
    k_rotated = np.stack([rotated(k[t], pos[t], table_cos, table_sin) for t in range(tokens)])
    q_rotated = np.stack([rotated(q[j], pos[tokens - block + j], table_cos, table_sin) for j in range(block)])
    q_all = np.concatenate([np.zeros((tokens - block, HQ, D), np.float32), q_rotated])
    expected = varlen_attention(q_all, k_rotated, v, *caches, slot, pos, cache_len, bidirectional=True)
    np.testing.assert_allclose(out, expected[tokens - block:], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(context_keys, k_rotated[: tokens - block], rtol=1e-6, atol=1e-6)
