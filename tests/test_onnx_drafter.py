"""drafter.onnx against the torch drafter: same draft tokens, distributions and confidences for the
same noise, for several requests at once and across calls that commit the drafter's context cache."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")

from dspark_export.checkpoint import Checkpoint  # noqa: E402
from dspark_export.config import DecoderConfig  # noqa: E402
from dspark_export.drafters.block_drafter import block_draft  # noqa: E402
from dspark_export.drafters.eagle3 import eagle3_draft  # noqa: E402
from dspark_export.drafters.checkpoint import attach_target, build_drafter, save_drafter  # noqa: E402
from dspark_export.drafters.config import DrafterConfig  # noqa: E402
from dspark_export.model import DecoderModel  # noqa: E402
from dspark_export.build import with_gamma  # noqa: E402
from dspark_export.graphs.drafter import build_drafter_onnx  # noqa: E402
from dspark_export.graphs.weights import WeightFormat  # noqa: E402
from dspark_export.interop import open_drafter  # noqa: E402
from tests.conftest import write_hf_checkpoint  # noqa: E402

SLOTS, LMAX, GAMMA = 3, 40, 4


def make_drafter(tmp_path, kind, head, gamma=GAMMA):
    """The torch drafter and its graph's session, the graph drafting `gamma` a round (`with_gamma`); the torch
    drafter's config says the same."""
    folder = write_hf_checkpoint(tmp_path / "target", tie_word_embeddings=True, num_hidden_layers=4)
    config = DecoderConfig.from_dir(folder)
    checkpoint = Checkpoint(folder, config)
    target = DecoderModel.from_checkpoint(checkpoint, "float32")
    drafter_config = DrafterConfig(
        drafter_type=kind, target=config.architecture_fields() | {"dtype": "float32"}, vocab_hash="x", mask_token_id=3,
        num_layers=1 if kind == "eagle3" else 2, gamma=GAMMA, feature_layers=(1, 2), head=head, markov_rank=16,
        confidence=kind == "dspark")
    torch.manual_seed(0)
    drafter = build_drafter(drafter_config)
    with torch.no_grad():  # random, non-zero heads so that every term matters
        for name, param in drafter.named_parameters():
            if name.startswith(("markov", "rnn", "confidence")):
                param.normal_(0, 0.5)
    attach_target(drafter, target)
    save_drafter(drafter, tmp_path / "drafter")
    source = open_drafter(tmp_path / "drafter", config)
    if gamma != GAMMA:
        source = with_gamma(source, gamma)
        drafter.config = dataclasses.replace(drafter.config, gamma=gamma)
    graph = build_drafter_onnx(source, checkpoint, tmp_path / "engine" / "drafter.onnx")
    onnx.checker.check_model(str(graph), full_check=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return drafter.eval(), ort.InferenceSession(str(graph), options), config


@pytest.mark.parametrize(
    "kind, head", [("dspark", "markov"), ("dspark", "gated"), ("dspark", "rnn"), ("dflash", "none"), ("eagle3", "none")]
)
@pytest.mark.parametrize("temperatures", [(0.0, 0.0), (0.8, 0.8), (1.3, 0.0)])
def test_drafter_graph_matches_torch(tmp_path, kind, head, temperatures):
    check_against_torch(*make_drafter(tmp_path, kind, head), kind, temperatures, GAMMA)


@pytest.mark.parametrize("kind, head", [("dspark", "markov"), ("dspark", "rnn"), ("dflash", "none")])
def test_a_shorter_block_drafts_what_the_torch_drafter_drafts_from_that_block(tmp_path, kind, head):
    """`--gamma 2` on a drafter trained on blocks of 4: the block's first 2 rows, attending over each other only."""
    check_against_torch(*make_drafter(tmp_path, kind, head, gamma=2), kind, (0.8, 0.0), 2)


def check_against_torch(drafter, session, config, kind, temperatures, gamma):
    """Two calls for two requests (slots 2 and 0), the second after the first's context K/V are committed: the
    graph's drafts, distributions and confidences are the torch drafter's for the same noise."""
    draft = eagle3_draft if kind == "eagle3" else block_draft
    layers = 1 if kind == "eagle3" else 2
    rng = np.random.default_rng(1)
    features_dim = 2 * config.hidden_size
    shape = (SLOTS, config.num_key_value_heads, LMAX, config.head_dim)
    caches = [[np.zeros(shape, np.float32), np.zeros(shape, np.float32)] for _ in range(layers)]
    # request 0 in slot 2 and request 1 in slot 0; full histories of target features and tokens
    history = {
        2: rng.standard_normal((12, features_dim)).astype(np.float32),
        0: rng.standard_normal((9, features_dim)).astype(np.float32),
    }
    tokens = {2: rng.integers(4, config.vocab_size, 13), 0: rng.integers(4, config.vocab_size, 10)}
    committed = {2: 0, 0: 0}
    names = [o.name for o in session.get_outputs()]
    # two steps: slot 2's context grows in the second; slot 0's only for EAGLE-3, whose newest entry must be new
    for length_now in ({2: 5, 0: 7}, {2: 12, 0: 9 if kind == "eagle3" else 7}):
        slots = [2, 0]
        new = {s: range(committed[s], length_now[s]) for s in slots}
        feeds = {
            "context_features": np.concatenate([history[s][list(new[s])] for s in slots]).reshape(-1, features_dim),
            "context_slot": np.concatenate([[s] * len(new[s]) for s in slots]).astype(np.int64),
            "context_pos": np.concatenate([list(new[s]) for s in slots]).astype(np.int64),
            "context_ids": np.concatenate([tokens[s][[p + 1 for p in new[s]]] for s in slots]).astype(np.int64),
            "context_last": np.cumsum([len(new[s]) for s in slots]) - 1,
            "anchor_ids": np.array([tokens[s][length_now[s]] for s in slots], dtype=np.int64),
            "anchor_pos": np.array([length_now[s] for s in slots], dtype=np.int64),
            "request_slot": np.array(slots, dtype=np.int64),
            "cache_len": np.array([committed.get(s, 0) for s in range(SLOTS)], dtype=np.int64),
            "noise": rng.uniform(1e-6, 1 - 1e-6, (2, gamma)).astype(np.float32),
            "temperature": np.array(temperatures, dtype=np.float32),
        }
        for layer in range(layers):
            feeds[f"past_key_{layer}"], feeds[f"past_value_{layer}"] = caches[layer]
        inputs = {i.name for i in session.get_inputs()}
        out = dict(zip(names, session.run(None, {k: v for k, v in feeds.items() if k in inputs})))
        for row, s in enumerate(slots):
            with torch.no_grad():
                expected = draft(drafter, torch.from_numpy(tokens[s][None, : length_now[s] + 1]),
                                       torch.from_numpy(history[s][None, : length_now[s]]), temperatures[row],
                                       torch.from_numpy(feeds["noise"][row : row + 1]))
            assert out["draft_tokens"][row].tolist() == expected.tokens[0].tolist()
            assert np.abs(out["draft_probs"][row] - expected.probs[0].numpy()).max() <= 1e-5
            if kind == "dspark":
                confidence = 1 / (1 + np.exp(-out["confidence_logits"][row]))
                assert np.abs(confidence - expected.confidence[0].numpy()).max() <= 1e-5
        for layer in range(layers):  # commit the context K/V like the runtime does
            caches[layer][0][feeds["context_slot"], :, feeds["context_pos"]] = out[f"new_key_{layer}"]
            caches[layer][1][feeds["context_slot"], :, feeds["context_pos"]] = out[f"new_value_{layer}"]
        committed = dict(length_now)


def test_cpu_graph_int8_projections_stay_close_and_greedy_calls_skip_distributions(tmp_path, monkeypatch):
    """The CPU engine's drafter quantizes its projections to int8: drafts move a little, and the graph still
    returns the distribution each draft was drawn from; an all-greedy call returns none (and, on the candidate
    route, scores the Markov bias without a vocabulary-sized product)."""
    from dspark_export.graphs import block_body

    monkeypatch.setattr(block_body, "CANDIDATE_ROUTE_MIN", 0)
    make_drafter(tmp_path, "dspark", "markov")
    folder = tmp_path / "target"
    checkpoint = Checkpoint(folder, DecoderConfig.from_dir(folder))
    formats = {False: WeightFormat("fp32"), True: WeightFormat("int8", block_size=16)}
    source = open_drafter(tmp_path / "drafter", checkpoint.config)
    graphs = {int8: build_drafter_onnx(source, checkpoint, tmp_path / f"int8-{int8}" / "drafter.onnx", formats[int8],
                                       greedy_shortcut=int8) for int8 in (False, True)}
    quantized = onnx.load(str(graphs[True]), load_external_data=False)
    assert not any(node.op_type == "Gemm" for node in quantized.graph.node)  # every projection is int8
    (chain,) = [node for node in quantized.graph.node if node.op_type == "If"]  # the whole head: one If per call
    products = {branch.name: sum(node.op_type == "MatMulNBits" for node in branch.g.node) for branch in chain.attribute}
    assert products == {
        "then_branch": GAMMA,
        "else_branch": 0,
    }  # one Markov product per sampled step; greedy: candidates
    onnx.checker.check_model(str(graphs[True]), full_check=True)
    config = checkpoint.config
    rng = np.random.default_rng(0)
    shape = (SLOTS, config.num_key_value_heads, LMAX, config.head_dim)
    feeds = {"context_features": rng.standard_normal((5, 2 * config.hidden_size)).astype(np.float32),
             "context_slot": np.zeros(5, np.int64), "context_pos": np.arange(5), "anchor_ids": np.array([7]),
             "anchor_pos": np.array([5]), "request_slot": np.array([0]), "cache_len": np.zeros(SLOTS, np.int64),
             "noise": rng.uniform(0, 1, (1, GAMMA)).astype(np.float32), "temperature": np.array([1.0], np.float32)}
    feeds |= {f"past_{kind}_{layer}": np.zeros(shape, np.float32) for kind in ("key", "value") for layer in range(2)}
    out = {int8: ort.InferenceSession(str(graph)).run(["draft_probs"], feeds) for int8, graph in graphs.items()}
    assert np.abs(out[True][0][0, 0] - out[False][0][0, 0]).max() < 0.02  # the first draft's distribution
    assert np.allclose(out[True][0].sum(-1), 1.0, atol=1e-5)
    greedy = feeds | {"temperature": np.zeros(1, np.float32)}
    tokens, probs = ort.InferenceSession(str(graphs[True])).run(["draft_tokens", "draft_probs"], greedy)
    assert tokens.shape == (1, GAMMA) and probs.shape == (1, GAMMA, 0)


@pytest.mark.parametrize("route", ["candidates", "direct"])
@pytest.mark.parametrize("head", ["markov", "gated", "rnn"])
def test_cpu_graph_greedy_drafts_from_candidates_follow_the_full_vocabulary(tmp_path, monkeypatch, head, route):
    """All-greedy CPU calls score the sequential bias on the top base logits only where the bias over the whole
    vocabulary is large (else directly); with every token a candidate, their drafts are the greedy rows' drafts
    of a call that samples (full-vocabulary argmax)."""
    from dspark_export.graphs import block_body

    make_drafter(tmp_path, "dspark", head)
    folder = tmp_path / "target"
    checkpoint = Checkpoint(folder, DecoderConfig.from_dir(folder))
    config = checkpoint.config
    monkeypatch.setattr(block_body, "GREEDY_CANDIDATES", config.vocab_size)
    monkeypatch.setattr(block_body, "CANDIDATE_ROUTE_MIN", 0 if route == "candidates" else 1 << 62)
    # float projections, so that no int8 rounding differs between the two paths
    graph = build_drafter_onnx(
        open_drafter(tmp_path / "drafter", config), checkpoint, tmp_path / "cpu" / "drafter.onnx", greedy_shortcut=True
    )
    rng = np.random.default_rng(3)
    requests, shape = 3, (SLOTS, config.num_key_value_heads, LMAX, config.head_dim)
    feeds = {
        "context_features": rng.standard_normal((6, 2 * config.hidden_size)).astype(np.float32),
        "context_slot": np.repeat(np.arange(requests), 2),
        "context_pos": np.tile(np.arange(2), requests),
        "anchor_ids": rng.integers(4, config.vocab_size, requests),
        "anchor_pos": np.full(requests, 2),
        "request_slot": np.arange(requests),
        "cache_len": np.zeros(SLOTS, np.int64),
        "noise": rng.uniform(0, 1, (requests, GAMMA)).astype(np.float32),
        "temperature": np.zeros(requests, np.float32),
    }
    feeds |= {f"past_{kind}_{layer}": np.zeros(shape, np.float32) for kind in ("key", "value") for layer in range(2)}
    session = ort.InferenceSession(str(graph))
    greedy, probs = session.run(["draft_tokens", "draft_probs"], feeds)
    assert probs.shape[-1] == 0
    mixed, probs = session.run(
        ["draft_tokens", "draft_probs"], feeds | {"temperature": np.array([0, 0, 1], np.float32)}
    )
    assert probs.shape[-1] == config.vocab_size
    assert (greedy[:2] == mixed[:2]).all()
