"""The graph I/O contract: every built graph declares exactly its ports, the runner takes exactly a graph's
inputs, an engine whose graphs drifted from the contract is refused, and every drafter kind and dtype runs
through the same feeds (profiling an EAGLE-3 engine and generating from a float16 engine once failed)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from dspark_export.build import build_engine  # noqa: E402
from dspark_export.checkpoint import Checkpoint  # noqa: E402
from dspark_export.config import DecoderConfig  # noqa: E402
from dspark_export.demo.tokenizer import train_tokenizer  # noqa: E402
from dspark_export.graphs.drafter import BODIES, build_drafter_onnx  # noqa: E402
from dspark_export.interop import open_drafter  # noqa: E402
from dspark_export.graphs.target import build_target_onnx  # noqa: E402
from dspark_export.graphs.weights import ONNX_DTYPES  # noqa: E402
from dspark_export.presets import resolve_target  # noqa: E402
from dspark_runtime import DSparkError, Engine, OrtBackend, SamplingParams  # noqa: E402
from dspark_common.engine_dir import read_manifest  # noqa: E402
from dspark_common.errors import EngineError  # noqa: E402
from dspark_common.graph_io import DRAFTER_TYPES, GraphIO, drafter_io, target_io  # noqa: E402
from tests.conftest import TEXT, write_drafter, write_hf_checkpoint  # noqa: E402

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
DRAFTER_FIELDS = {"dspark": {}, "dflash": {"head": "none", "confidence": False},
                  "eagle3": {"head": "none", "confidence": False}}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = write_hf_checkpoint(
        tmp_path_factory.mktemp("contract") / "target", vocab_size=300, max_position_embeddings=64
    )
    train_tokenizer(TEXT, folder, vocab_size=300)
    return folder


def declared(model: onnx.ModelProto) -> tuple[list, list]:
    """(name, element type, dims) of a model's inputs and outputs, in order."""
    def rows(values):
        return [(v.name, v.type.tensor_type.elem_type,
                 [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]) for v in values]
    return rows(model.graph.input), rows(model.graph.output)


def expected(io: GraphIO) -> tuple[list, list]:
    def rows(tensors):
        return [(t.name, ONNX_DTYPES[t.dtype], list(t.shape)) for t in tensors]
    return rows(io.inputs), rows(io.outputs)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_target_graph_declares_the_contract(tmp_path, target, dtype):
    config = DecoderConfig.from_dir(target)
    graph = build_target_onnx(Checkpoint(target, config), tmp_path / "target.onnx", dtype, feature_layers=(0, 1))
    onnx.checker.check_model(str(graph), full_check=True)
    io = target_io(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, config.vocab_size,
                   2 * config.hidden_size, dtype)
    assert declared(onnx.load(str(graph), load_external_data=False)) == expected(io)


@pytest.mark.parametrize("kind", DRAFTER_TYPES)
def test_drafter_graph_declares_the_contract(tmp_path, target, kind):
    config = DecoderConfig.from_dir(target)
    drafter = write_drafter(target, tmp_path / "drafter", drafter_type=kind, **DRAFTER_FIELDS[kind])
    graph = build_drafter_onnx(open_drafter(drafter, config), Checkpoint(target, config), tmp_path / "drafter.onnx")
    onnx.checker.check_model(str(graph), full_check=True)
    io = drafter_io(kind, 1, config.num_key_value_heads, config.head_dim, config.hidden_size, 3, kind == "dspark")
    assert declared(onnx.load(str(graph), load_external_data=False)) == expected(io)


def test_every_drafter_type_of_the_contract_has_a_graph_body():
    assert set(BODIES) == set(DRAFTER_TYPES)


@pytest.mark.parametrize("kind", DRAFTER_TYPES)
def test_every_drafter_kind_profiles_and_runs_the_scheduled_modes(tmp_path, target, kind):
    drafter = write_drafter(target, tmp_path / "drafter", drafter_type=kind, **DRAFTER_FIELDS[kind])
    folder = build_engine(resolve_target(None, target), tmp_path / "engine", drafter, kind, cache_slots=2,
                          max_batch_tokens=16, show_progress=False)
    with Engine.load(folder, OrtBackend(threads=1), profile=False) as engine:
        curve = engine.profile(context=8, rounds=1)
        assert len(curve["target_seconds"]) == 2 * (engine.gamma + 1) and len(curve["draft_seconds"]) == 2
        plain = engine.generate("def add(", GREEDY, spec="off").token_ids
        assert [engine.generate("def add(", GREEDY, spec=spec).token_ids for spec in ("fixed:3", "sync", "async")] == [
            plain
        ] * 3


def test_a_float16_engine_generates_and_speculation_keeps_its_output(tmp_path, target):
    drafter = write_drafter(target, tmp_path / "drafter")
    folder = build_engine(
        resolve_target(None, target),
        tmp_path / "engine",
        drafter,
        "d",
        dtype="float16",
        cache_slots=2,
        max_batch_tokens=16,
        show_progress=False,
    )
    with Engine.load(folder, OrtBackend(threads=1), profile=False) as engine:
        plain = engine.generate("def add(", GREEDY, spec="off")
        assert len(plain.token_ids) == 16
        assert engine.generate("def add(", GREEDY, spec="fixed:3").token_ids == plain.token_ids


def test_bfloat16_for_onnx_runtime_is_refused_before_anything_is_written(tmp_path, target):
    with pytest.raises(DSparkError, match="bfloat16 needs --backend trt"):
        build_engine(resolve_target(None, target), tmp_path / "engine", dtype="bfloat16", show_progress=False)
    assert not (tmp_path / "engine").exists()


def test_a_block_drafter_drafts_at_most_its_trained_gamma(tmp_path, target):
    drafter = write_drafter(target, tmp_path / "drafter", gamma=3)
    with pytest.raises(DSparkError, match="trained on blocks of 3 drafts"):
        build_engine(resolve_target(None, target), tmp_path / "engine", drafter, gamma=4, show_progress=False)
    assert not (tmp_path / "engine").exists()


def test_the_runner_takes_exactly_the_graphs_inputs(tmp_path, target):
    folder = build_engine(resolve_target(None, target), tmp_path / "engine", cache_slots=2, show_progress=False)
    graph, _ = OrtBackend(threads=1).open(folder, read_manifest(folder))
    from dspark_runtime.batches import TargetBatch

    one = np.zeros(1, np.int64)
    feeds = TargetBatch(one, one, one, np.zeros(2, np.int64), one).feeds(graph.io)  # the caches are bound to the graph
    assert set(graph.inputs) == {"input_ids", "logit_index", "slot_rows", "token_rows", "seqlens_k", "query_seqlens",
                                 "total_length"}
    assert set(graph.run_feeds(feeds)) == {"logits"}  # the in-place ONNX Runtime graph appends to its caches itself
    with pytest.raises(DSparkError, match=r"missing \['token_rows'\]"):
        graph.run_feeds({k: v for k, v in feeds.items() if k != "token_rows"})
    with pytest.raises(DSparkError, match=r"unknown \['noise'\]"):
        graph.run_feeds(feeds | {"noise": np.zeros(1, np.float32)})


def test_an_engine_whose_graph_drifted_from_the_contract_is_refused(tmp_path, target):
    drafter = write_drafter(target, tmp_path / "drafter")
    folder = build_engine(
        resolve_target(None, target), tmp_path / "engine", drafter, "d", cache_slots=2, show_progress=False
    )
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["feature_layers"] = [0, 1]  # the contract now expects twice the feature width the graphs have
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match="target.onnx has 'features' of shape .* rebuild the engine"):
        Engine.load(folder, OrtBackend(threads=1), profile=False)


def test_an_engine_built_for_tensorrt_runs_its_onnx_graphs_on_onnx_runtime(tmp_path, target, capsys):
    """No TensorRT runner exists: ONNX Runtime runs such an engine's graphs, and loading says so."""
    folder = build_engine(resolve_target(None, target), tmp_path / "engine", cache_slots=2, show_progress=False)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(manifest | {"backend": "trt"}))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with Engine.load(folder, OrtBackend(threads=1)) as engine:
        assert len(engine.generate("Hello", greedy).token_ids) == 6
    assert "built for TensorRT" in capsys.readouterr().err
