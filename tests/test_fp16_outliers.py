"""Float16 engines and Qwen3's outlier activations: real Qwen3 residual streams carry values in the thousands,
and other toolkits lost almost all acceptance when the drafter's fused features were computed in fp16.

The checkpoint here is the demo target with its residual stream scaled by `SCALE` (the embedding, and every
layer's output projections), so the hidden states the drafter reads reach 1e4 while the model's function is
unchanged: every norm divides the scale out, the LM head is the unscaled embedding (untied), and the bundled
drafter's own output projections are scaled alike. The fp32 engine therefore accepts what it accepts on the
demo, and the fp16 engine must stay within 2% of it.

ONNX Runtime's CPU provider runs most fp16 element-wise ops in fp32 (it inserts the casts), so what an fp16
engine stores (residual stream, K/V, features) is what these numbers test; what a GPU's real fp16 kernels would
compute is pinned by the graph itself: every norm squares in fp32, and the features leave the graph in fp32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from safetensors.numpy import load_file, save_file

from dspark_export.build import build_engine
from dspark_export.checkpoint import Checkpoint
from dspark_export.config import DecoderConfig
from dspark_export.drafters.bundled import bundled_root
from dspark_export.graphs.target import build_target_onnx
from dspark_export.presets import demo_dir, resolve_target
from dspark_runtime import Engine, OrtBackend
from dspark_runtime.backend import OrtRunner
from dspark_runtime.batches import TargetBatch
from dspark_common.graph_io import target_io
from dspark_common.prompts import demo_prompts_path, read_prompts
from dspark_common.sampling import SamplingParams

SCALE = 300.0
OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight")


def scaled(file: Path, names: set[str]) -> dict[str, np.ndarray]:
    """The tensors of `file` with `names` and every output projection multiplied by `SCALE`."""
    tensors = load_file(file)
    for name, array in tensors.items():
        if name in names or name.endswith(OUTPUT_PROJECTIONS):
            tensors[name] = (array.astype(np.float32) * SCALE).astype(array.dtype)
    return tensors


def untie(config_file: Path, section: str | None = None) -> None:
    config = json.loads(config_file.read_text())
    (config[section] if section else config)["tie_word_embeddings"] = False
    config_file.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def outlier_models(tmp_path_factory) -> tuple[Path, Path]:
    """(target folder, drafter folder): the demo pair with a residual stream `SCALE` times larger."""
    root = tmp_path_factory.mktemp("outliers")
    target, drafter = root / "target", root / "drafter"
    shutil.copytree(demo_dir(), target)
    shutil.copytree(bundled_root() / "demo-dspark", drafter)
    weights = target / "model.safetensors"
    head = load_file(weights)["model.embed_tokens.weight"]
    save_file(scaled(weights, {"model.embed_tokens.weight"}) | {"lm_head.weight": head}, weights,
              metadata={"format": "pt"})
    untie(target / "config.json")
    save_file(scaled(drafter / "model.safetensors", set()), drafter / "model.safetensors", metadata={"format": "pt"})
    untie(drafter / "config.json", "target")
    return target, drafter


def prefill(folder: Path, dtype: str, graph_file: Path, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Logits and features of one request's prompt through a target graph of `dtype`."""
    config = DecoderConfig.from_dir(folder)
    layers = (1, 2, 3)  # the bundled drafter's
    build_target_onnx(Checkpoint(folder, config), graph_file, dtype, layers)
    io = target_io(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, config.vocab_size,
                   len(layers) * config.hidden_size, dtype, slots=1, cache_rows=len(tokens))
    batch = TargetBatch(tokens, np.arange(len(tokens)), np.zeros(len(tokens), np.int64), np.zeros(1, np.int64),
                        np.arange(len(tokens)))
    return OrtRunner(graph_file, io, threads=1).run(batch)


def test_fp16_features_stay_finite_and_close_with_activations_in_the_thousands(outlier_models, tmp_path):
    target, _ = outlier_models
    tokens = np.random.default_rng(0).integers(0, 8192, 48)
    wide, narrow = (prefill(target, dtype, tmp_path / dtype / "target.onnx", tokens)
                    for dtype in ("float32", "float16"))
    assert np.abs(wide["features"]).max() > 5e3  # the outliers are there
    assert np.isfinite(narrow["features"]).all() and np.isfinite(narrow["logits"]).all()
    relative = np.abs(narrow["features"] - wide["features"]).max(-1) / np.abs(wide["features"]).max(-1)
    assert relative.max() < 1e-2
    assert (narrow["logits"].argmax(-1) == wide["logits"].argmax(-1)).mean() >= 0.95


def test_an_fp16_target_graph_squares_in_fp32_and_hands_over_fp32_features(outlier_models, tmp_path):
    target, _ = outlier_models
    checkpoint = Checkpoint(target, DecoderConfig.from_dir(target))
    graph_file = build_target_onnx(checkpoint, tmp_path / "target.onnx", "float16", (1, 2, 3))
    graph = onnx.load(str(graph_file), load_external_data=False)
    made_by = {out: node for node in graph.graph.node for out in node.output}
    squares = [node for node in graph.graph.node if node.op_type == "Pow"]
    assert len(squares) == 2 * 6 + 1 + 2 * 6  # two norms a layer, the final norm, q/k norms
    for node in squares:
        source = made_by[node.input[0]]
        assert source.op_type == "Cast" and source.attribute[0].i == onnx.TensorProto.FLOAT
    features = next(o for o in graph.graph.output if o.name == "features")
    assert features.type.tensor_type.elem_type == onnx.TensorProto.FLOAT


def test_an_fp16_engine_accepts_within_2_percent_of_the_fp32_engine(outlier_models, tmp_path):
    target, drafter = outlier_models
    prompts = [row["prompt"] for row in read_prompts(demo_prompts_path(), per_domain=2, skip=30)]
    tau = {}
    for dtype in ("float32", "float16"):
        folder = build_engine(resolve_target(None, target), tmp_path / dtype, drafter, "demo-dspark", dtype=dtype,
                              cache_slots=1, max_batch_tokens=16, show_progress=False)
        with Engine.load(folder, OrtBackend(threads=1), profile=False) as engine:
            runs = [engine.generate(p, SamplingParams(max_tokens=48, temperature=0), spec="fixed:7") for p in prompts]
        tau[dtype] = sum(len(r.token_ids) for r in runs) / sum(r.stats.steps for r in runs)
    assert tau["float32"] > 2.5  # the scaled pair still drafts as well as the demo does
    assert tau["float16"] >= 0.98 * tau["float32"]
