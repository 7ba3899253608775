"""`dspark-export build`: a valid engine directory, and every way a build can go wrong leaves none behind."""

from __future__ import annotations

import dataclasses
import errno
import importlib.util

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")

from dspark_export.cli import main  # noqa: E402
from dspark_export.demo.tokenizer import train_tokenizer  # noqa: E402
from dspark_export.config import DecoderConfig  # noqa: E402
from dspark_common.engine_dir import read_manifest  # noqa: E402
from dspark_common.errors import EngineError  # noqa: E402
from tests.conftest import write_drafter, write_hf_checkpoint  # noqa: E402


@pytest.fixture
def target(tmp_path):
    folder = write_hf_checkpoint(tmp_path / "target", vocab_size=300)
    train_tokenizer(["def f(x):\n    return x\n", "Hello!"] * 20, folder, vocab_size=300)
    return folder


def build(*args):
    return CliRunner().invoke(main, ["build", *args])


def test_build_writes_a_verified_engine(tmp_path, target):
    drafter = write_drafter(target, tmp_path / "drafter")
    result = build(
        "--target-path", str(target), "--drafter", str(drafter), "--out", str(tmp_path / "engine"), "--cache-slots", "4"
    )
    assert result.exit_code == 0, result.output
    manifest = read_manifest(tmp_path / "engine")
    assert manifest.gamma == 3 and manifest.cache_slots == 4 and manifest.feature_layers == [1]
    assert {"target.onnx", "target.onnx.data", "drafter.onnx", "tokenizer.json"} <= set(manifest.files)
    for graph in ("target.onnx", "drafter.onnx"):
        onnx.checker.check_model(str(tmp_path / "engine" / graph), full_check=True)
        ort.InferenceSession(str(tmp_path / "engine" / graph))
    refused = build("--target-path", str(target), "--out", str(tmp_path / "engine"))
    assert refused.exit_code != 0 and "already exists; pass --force" in refused.output
    replaced = build("--target-path", str(target), "--out", str(tmp_path / "engine"), "--force")
    assert replaced.exit_code == 0 and read_manifest(tmp_path / "engine").drafter is None


def test_gamma_shortens_a_block_drafters_round(tmp_path, target):
    drafter = write_drafter(target, tmp_path / "drafter")  # a DSpark drafter trained on blocks of 3
    shorter = build("--target-path", str(target), "--drafter", str(drafter), "--out", str(tmp_path / "engine"),
                    "--gamma", "2")
    assert shorter.exit_code == 0, shorter.output
    manifest = read_manifest(tmp_path / "engine")
    assert manifest.gamma == 2 and manifest.drafter["extra"]["trained_gamma"] == 3
    session = ort.InferenceSession(str(tmp_path / "engine" / "drafter.onnx"))
    assert [o.shape[1] for o in session.get_outputs() if o.name == "draft_tokens"] == [2]


def test_real_size_block_drafters_draft_a_short_block_on_onnx_runtime_by_default():
    from types import SimpleNamespace

    from dspark_export.build import CPU_DRAFT_BLOCK, default_gamma

    def source(kind, gamma=7):
        return SimpleNamespace(config=SimpleNamespace(drafter_type=kind, gamma=gamma))

    real, demo = SimpleNamespace(hidden_size=2048), SimpleNamespace(hidden_size=384)
    assert default_gamma(source("dspark"), "ort", real) == CPU_DRAFT_BLOCK
    assert default_gamma(source("dflash"), "ort", real) == CPU_DRAFT_BLOCK
    assert default_gamma(source("dspark"), "trt", real) is None  # a GPU verifies more drafts nearly free
    assert default_gamma(source("dspark"), "ort", demo) is None
    assert default_gamma(source("eagle3"), "ort", real) is None
    assert default_gamma(source("dspark", CPU_DRAFT_BLOCK), "ort", real) is None
    assert default_gamma(None, "ort", real) is None


def test_bundled_demo_engine_is_rebuilt_when_its_weights_or_graphs_change(tmp_path, monkeypatch):
    """An upgrade that replaces the bundled drafter or the exporter's graphs must not leave the user cache
    running the old engine."""
    import json

    from dspark_export import demo_engine

    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    folder = demo_engine()
    manifest = read_manifest(folder)
    # the draft vocabulary's counts and the generation defaults count as sources too
    assert set(manifest.sources) == {"target", "drafter", "target_counts", "generation_config"}
    (folder / "hardware_curve.json").write_text("{}")  # a file only the cached engine has
    assert demo_engine() == folder and (folder / "hardware_curve.json").is_file()  # current: reused
    stale = json.loads((folder / "manifest.json").read_text())
    stale["sources"]["drafter"] = "0" * 64  # as if built from an older bundled drafter
    (folder / "manifest.json").write_text(json.dumps(stale))
    assert demo_engine() == folder and not (folder / "hardware_curve.json").exists()  # rebuilt
    assert read_manifest(folder).sources == manifest.sources
    stale["sources"], stale["format_version"] = manifest.sources, manifest.format_version - 1  # an older exporter's
    (folder / "manifest.json").write_text(json.dumps(stale))
    (folder / "hardware_curve.json").write_text("{}")
    assert demo_engine() == folder and not (folder / "hardware_curve.json").exists()  # rebuilt


def test_altered_or_missing_files_are_refused(tmp_path, target):
    assert build("--target-path", str(target), "--out", str(tmp_path / "e")).exit_code == 0
    config = tmp_path / "e" / "tokenizer_config.json"
    config.write_text(config.read_text() + " ")
    with pytest.raises(EngineError, match="tokenizer_config.json in .* changed after the build; rebuild"):
        read_manifest(tmp_path / "e")
    (tmp_path / "e" / "target.onnx.data").unlink()
    with pytest.raises(EngineError, match="lacks target.onnx.data"):
        read_manifest(tmp_path / "e")
    with pytest.raises(EngineError, match="not a DSpark engine directory"):
        read_manifest(tmp_path)


def test_full_disk_leaves_no_engine(tmp_path, target, monkeypatch):
    from dspark_export.graphs import weights as onnx_weights

    written = []
    original = onnx_weights.ExternalData.add

    def add(self, name, array, dtype):
        if len(written) == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(name)
        return original(self, name, array, dtype)

    monkeypatch.setattr(onnx_weights.ExternalData, "add", add)
    result = build("--target-path", str(target), "--out", str(tmp_path / "engine"))
    assert result.exit_code != 0
    assert not (tmp_path / "engine").exists()
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


def test_bad_inputs(tmp_path, target):
    other = write_drafter(
        target,
        tmp_path / "other",
        target=DecoderConfig.from_dir(target).architecture_fields() | {"hidden_size": 32, "num_attention_heads": 2},
    )
    result = build("--target-path", str(target), "--drafter", str(other), "--out", str(tmp_path / "e1"))
    assert result.exit_code != 0 and "hidden_size=32, but this target has hidden_size=64" in result.output
    wrong_vocab = write_drafter(target, tmp_path / "vocab", vocab_hash="0000")
    result = build("--target-path", str(target), "--drafter", str(wrong_vocab), "--out", str(tmp_path / "e2"))
    assert result.exit_code != 0 and "vocabulary" in result.output
    result = build("--target-path", str(target), "--dtype", "int4", "--out", str(tmp_path / "e3"))
    assert result.exit_code == 2 and "int4" in result.output
    (target / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{oops")
    result = build("--target-path", str(target), "--out", str(tmp_path / "e4"))
    assert result.exit_code != 0 and "corrupt" in result.output and not (tmp_path / "e4").exists()
    result = build("--target-path", str(target), "--backend", "trt", "--out", str(tmp_path / "e5"))
    assert result.exit_code != 0 and "[trt]" in result.output


def test_tensorrt_profiles_cover_every_graph_input(tmp_path, target):
    """The TensorRT path's optimization profile, derived from the manifest, for the real graphs (no GPU needed)."""
    from dspark_export.trt_build import dimension_ranges, profile_shapes
    from dspark_common.graph_io import GraphIO, Tensor

    drafter = write_drafter(target, tmp_path / "drafter")
    assert build("--target-path", str(target), "--drafter", str(drafter), "--out", str(tmp_path / "engine"),
                 "--cache-slots", "4", "--max-context", "96", "--max-batch-tokens", "64").exit_code == 0
    manifest = dataclasses.replace(read_manifest(tmp_path / "engine"), backend="trt", attention="varlen")
    ranges = dimension_ranges(manifest)
    assert ranges["T"] == (1, 16, 64) and ranges["R"] == (1, 4, 4)
    target_shapes = profile_shapes(manifest.target_io(), ranges)  # the portable graph a TensorRT build holds
    assert set(target_shapes) == {"input_ids", "pos", "slot", "cache_len", "logit_index"} | {
        f"past_{kind}_{layer}" for kind in ("key", "value") for layer in range(3)}
    assert target_shapes["input_ids"] == ((1,), (16,), (64,))
    assert target_shapes["past_key_0"] == ((4, 1, 100, 16),) * 3  # fixed cache: S, Hkv, context + γ + 1, D
    drafter_shapes = profile_shapes(manifest.drafter_io(), ranges)
    assert drafter_shapes["noise"] == ((1, 3), (4, 3), (4, 3)) and drafter_shapes["context_features"][2][0] == 64
    with pytest.raises(Exception, match="dimension 'T'"):
        profile_shapes(GraphIO("x", (Tensor("x", "int64", ("T",)),), ()), {})


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_tensorrt_backend_without_tensorrt_names_the_extra(tmp_path, target):
    result = build("--target-path", str(target), "--out", str(tmp_path / "engine"), "--backend", "trt")
    assert result.exit_code != 0 and "pip install 'dspark[trt]'" in result.output and "GPU" in result.output
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize("weights", ["fp32", "int4", "w8a8", "w4a8"])
def test_inspect_and_build_size_an_engine_alike(tmp_path, target, weights):
    """The context a KV budget holds and the weights' size: what `inspect` predicts is what `build` writes."""
    import json

    options = ["--target-path", str(target), "--weights", weights, "--quant-block-size", "16", "--kv-memory", "96KiB",
               "--cache-slots", "8"]
    report = json.loads(CliRunner().invoke(main, ["inspect", *options, "--json"]).output)["memory"]
    assert build(*options, "--out", str(tmp_path / "e")).exit_code == 0
    manifest = read_manifest(tmp_path / "e")
    # 96 KiB / (8 slots x 2 x 3 layers x 16 dims x 4 bytes) = 32 rows, less one for a step
    assert manifest.max_context == report["context"] == 31 and manifest.weights == weights
    written = (tmp_path / "e" / "target.onnx.data").stat().st_size
    assert abs(written - report["weights_bytes"]) / written < 0.05


def _tamper(folder, change):
    import json

    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest, folder)
    if manifest is not None:
        (folder / "manifest.json").write_text(json.dumps(manifest))


TAMPERED = {  # what an edited or damaged engine directory may hold -> a fragment of the one-line error
    "wrong vocab_size": (lambda m, f: m.update(vocab_size=m["vocab_size"] + 1), "vocab_size"),
    "zero cache slots": (lambda m, f: m.update(cache_slots=0), "'cache_slots' is 0"),
    "a file outside the directory": (
        lambda m, f: m["files"].update({"../../../../etc/hostname": "0" * 64}),
        "not a file name",
    ),
    "files as a list": (lambda m, f: m.update(files=["target.onnx"]), "'files'"),
    "context beyond the model": (lambda m, f: m.update(max_context=4096), "exceeds the model's"),
    "an end id outside the vocabulary": (lambda m, f: m.update(eos_token_ids=[10**6]), "outside the vocabulary"),
    "an unknown field": (lambda m, f: m.update(extra=1), "unknown field"),
    "a field missing": (lambda m, f: m.pop("backend"), "no 'backend'"),
    "not UTF-8": (lambda m, f: (f / "manifest.json").write_bytes(b"\xff\xfe{"), "corrupt"),
    "a corrupt speed curve": (
        lambda m, f: (f / "hardware_curve.json").write_text('{"target_seconds": [1, -2]}'),
        "hardware_curve.json is corrupt",
    ),
    "speed curve not JSON": (
        lambda m, f: (f / "hardware_curve.json").write_text("{"),
        "hardware_curve.json is corrupt",
    ),
    "a corrupt calibration": (
        lambda m, f: (f / "calibration.json").write_text('{"by_temperature": 5}'),
        "calibration.json is corrupt",
    ),
    "calibration of another γ": (
        lambda m, f: (f / "calibration.json").write_text('{"by_temperature": {"1.0": {"temperatures": [1.0]}}}'),
        "calibration.json is corrupt",
    ),
}


@pytest.mark.parametrize("case", TAMPERED)
def test_a_tampered_engine_directory_is_one_clear_line(tmp_path, target, case):
    from dspark_runtime import Engine, OrtBackend
    from dspark_runtime.cli import main as run_main

    change, fragment = TAMPERED[case]
    drafter = write_drafter(target, tmp_path / "drafter")
    assert build("--target-path", str(target), "--drafter", str(drafter), "--out", str(tmp_path / "e")).exit_code == 0
    _tamper(tmp_path / "e", lambda m, f: change(m, f) if case != "not UTF-8" else None)
    if case == "not UTF-8":
        change(None, tmp_path / "e")
    with pytest.raises(EngineError, match=fragment):
        Engine.load(tmp_path / "e", OrtBackend(threads=1), profile=False)
    result = CliRunner().invoke(run_main, [str(tmp_path / "e"), "-p", "hi", "-n", "2"])
    assert result.exit_code == 1 and result.output.count("\n") == 1 and fragment.strip("'") in result.output


def test_the_weight_formats_the_exporter_writes_are_those_engines_may_hold():
    from dspark_common.engine_checks import WEIGHT_FORMATS
    from dspark_export.graphs.weights import FLOAT_WEIGHTS, QUANTIZED_BITS

    assert (*FLOAT_WEIGHTS, *QUANTIZED_BITS) == WEIGHT_FORMATS



@pytest.mark.parametrize("block", [16, 32, 128])
def test_int4_rows_of_a_batch_compute_alike_whatever_else_is_in_it(block):
    """Verification runs several requests' rows in one batch: ONNX Runtime's MatMulNBits (accuracy level 4) must
    compute a row of a batch of an even number of rows alike whatever the other rows are, or a request's output
    would depend on its neighbours. (It computes rows in pairs; a lone row, alone or last in an odd batch, takes
    another kernel, which agrees bit for bit on some CPUs only: AVX2 with blocks of 16, AVX-512 VNNI with 16 and 32;
    `dspark-run profile` measures it on the engine, `one_row_drift`, and `exact_greedy` pads steps to pairs.)"""
    from onnx import TensorProto, helper, numpy_helper

    k = n = 512
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 255, (n, k // block, block // 2), dtype=np.uint8)
    scales = rng.random(n * (k // block)).astype(np.float32) * 0.01
    node = helper.make_node("MatMulNBits", ["X", "W", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block, accuracy_level=4)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
                              [numpy_helper.from_array(codes, "W"), numpy_helper.from_array(scales, "S")])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((8, k)).astype(np.float32)
    whole = session.run(None, {"X": x})[0]
    for start, stop in ((0, 2), (0, 4), (1, 3), (1, 7), (2, 8)):
        assert np.array_equal(session.run(None, {"X": x[start:stop]})[0], whole[start:stop])
