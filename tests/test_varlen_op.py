"""DSparkVarlenAttention: numpy reference, the ONNX function under onnxruntime and a naive per-request
attention agree on ragged batches; tokens never see another slot or a position past cache_len."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from dspark_plugins.onnx_function import opset_imports, varlen_attention_function, varlen_attention_node
from dspark_plugins.reference import varlen_attention
from dspark_plugins.contract import INPUTS

HQ, HKV, D, S, LMAX = 6, 2, 16, 4, 24


def op_model(bidirectional: bool) -> onnx.ModelProto:
    float_in = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    int_in = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.INT64, shape)  # noqa: E731
    inputs = [float_in("q", ["T", HQ, D]), float_in("k_new", ["T", HKV, D]), float_in("v_new", ["T", HKV, D]),
              float_in("k_cache", [S, HKV, LMAX, D]), float_in("v_cache", [S, HKV, LMAX, D]),
              int_in("slot", ["T"]), int_in("pos", ["T"]), int_in("cache_len", [S])]
    graph = helper.make_graph([varlen_attention_node(list(INPUTS), "out", D, bidirectional)], "varlen",
                              inputs, [float_in("out", ["T", HQ, D])])
    model = helper.make_model(graph, opset_imports=opset_imports(), functions=[varlen_attention_function()])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.fixture(scope="module")
def sessions():
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return {
        bidirectional: ort.InferenceSession(op_model(bidirectional).SerializeToString(), options)
        for bidirectional in (False, True)
    }


def ragged_batch(rng, requests):
    """requests: [(slot, cache_len, new tokens)] -> op inputs; positions continue each slot's cache."""
    cache_len = np.zeros(S, dtype=np.int64)
    slot, pos = [], []
    for s, length, count in requests:
        start = max([p + 1 for p, q in zip(pos, slot) if q == s], default=length)  # a later run continues its slot
        cache_len[s] = min(cache_len[s] or length, length)
        slot += [s] * count
        pos += list(range(start, start + count))
    tokens = len(slot)
    return {
        "q": rng.standard_normal((tokens, HQ, D)).astype(np.float32),
        "k_new": rng.standard_normal((tokens, HKV, D)).astype(np.float32),
        "v_new": rng.standard_normal((tokens, HKV, D)).astype(np.float32),
        "k_cache": rng.standard_normal((S, HKV, LMAX, D)).astype(np.float32),
        "v_cache": rng.standard_normal((S, HKV, LMAX, D)).astype(np.float32),
        "slot": np.array(slot, dtype=np.int64),
        "pos": np.array(pos, dtype=np.int64),
        "cache_len": cache_len,
    }


def naive(inputs, bidirectional):
    """Per request: keys = cache prefix + the request's new tokens, one dense masked attention."""
    out = np.zeros(inputs["q"].shape, dtype=np.float64)
    for s in np.unique(inputs["slot"]):
        rows = np.flatnonzero(inputs["slot"] == s)
        length, group = inputs["cache_len"][s], HQ // HKV
        for h in range(HQ):
            keys = np.concatenate([inputs["k_cache"][s, h // group, :length], inputs["k_new"][rows, h // group]])
            values = np.concatenate([inputs["v_cache"][s, h // group, :length], inputs["v_new"][rows, h // group]])
            scores = inputs["q"][rows, h] @ keys.T / np.sqrt(D)
            if not bidirectional:
                positions = inputs["pos"][rows]
                scores[:, length:] = np.where(positions[None, :] <= positions[:, None], scores[:, length:], -np.inf)
            weights = np.exp(scores - scores.max(1, keepdims=True))
            out[rows, h] = (weights / weights.sum(1, keepdims=True)) @ values
    return out


BATCHES = {
    "decode-one": [(2, 9, 1)],
    "prefill-chunk-and-verify": [(0, 0, 7), (1, 12, 5), (3, 20, 1)],
    "verify-several": [(3, 5, 8), (0, 17, 8), (2, 1, 3), (1, 0, 1)],
    "interleaved": [(1, 3, 2), (0, 6, 3), (1, 5, 2)],  # slot 1's tokens come in two runs
    "all-prefill": [(0, 0, 5), (2, 0, 3)],  # nothing cached anywhere yet
}


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("batch", BATCHES)
def test_reference_onnx_and_naive_agree(sessions, batch, bidirectional):
    inputs = ragged_batch(np.random.default_rng(len(batch)), BATCHES[batch])
    reference = varlen_attention(**inputs, bidirectional=bidirectional)
    (onnx_out,) = sessions[bidirectional].run(None, inputs)
    assert np.abs(reference - naive(inputs, bidirectional)).max() <= 1e-5
    assert np.abs(onnx_out - reference).max() <= 1e-5


def test_no_token_sees_another_slot_or_past_cache_len(sessions):
    inputs = ragged_batch(np.random.default_rng(7), BATCHES["verify-several"])
    (base,) = sessions[False].run(None, inputs)
    poked = dict(inputs)
    for name in ("k_cache", "v_cache"):
        poked[name] = inputs[name].copy()
        for s in range(S):
            poked[name][s, :, inputs["cache_len"][s]:] = 1e3  # garbage past the committed length
    (after,) = sessions[False].run(None, poked)
    assert np.abs(after - base).max() <= 1e-6
    mine = inputs["slot"] == 3
    other = dict(inputs, k_new=inputs["k_new"].copy(), v_new=inputs["v_new"].copy())
    other["k_new"][~mine] += 5.0
    other["v_new"][~mine] -= 5.0
    (changed,) = sessions[False].run(None, other)
    assert np.abs(changed[mine] - base[mine]).max() <= 1e-6
    assert np.abs(changed[~mine] - base[~mine]).max() > 1e-3  # and the others did change


def test_causal_mode_hides_later_tokens_bidirectional_mode_does_not(sessions):
    inputs = ragged_batch(np.random.default_rng(3), [(1, 4, 5)])
    later = dict(inputs, v_new=inputs["v_new"].copy())
    later["v_new"][3:] += 10.0
    for bidirectional, sees_later in [(False, False), (True, True)]:
        (base,) = sessions[bidirectional].run(None, inputs)
        (changed,) = sessions[bidirectional].run(None, later)
        moved = np.abs(changed[:3] - base[:3]).max() > 1e-3
        assert moved == sees_later
