"""GGUF targets: files the `gguf` package writes from the demo target (F32, Q8_0, Q4_0, and Q5_0 for a type that
is re-quantized) build into engines that compute with the file's own weights, speculate losslessly, and carry the
Hugging Face tokenizer and chat template over; bad files fail in one line with nothing written."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from click.testing import CliRunner  # noqa: E402

from dspark_common.errors import DSparkError  # noqa: E402
from dspark_common.sampling import SamplingParams  # noqa: E402
from dspark_common.tokenizer import ChatTokenizer  # noqa: E402
from dspark_export.build import build_engine  # noqa: E402
from dspark_export.checkpoint import Checkpoint  # noqa: E402
from dspark_export.cli import main as export_main  # noqa: E402
from dspark_export.drafters.bundled import resolve_drafter  # noqa: E402
from dspark_export.graphs.target import build_target_onnx  # noqa: E402
from dspark_export.graphs.weights import WeightFormat  # noqa: E402
from dspark_export.model import DecoderModel  # noqa: E402
from dspark_export.presets import demo_dir, resolve_target  # noqa: E402
from dspark_export.sizing import size_engine  # noqa: E402
from dspark_runtime import Engine  # noqa: E402
from dspark_runtime.backend import OrtBackend, OrtRunner  # noqa: E402
from dspark_runtime.batches import TargetBatch  # noqa: E402
from dspark_common.graph_io import target_io  # noqa: E402
from tests.gguf_files import q6_k_bytes, write_gguf  # noqa: E402

TYPES = ("F32", "Q8_0", "Q4_0", "Q5_0")
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
TEXTS = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
         "Hello,  world! 12345 naïve café 😀\n\n\ttabs", "<|im_start|>user\nhi<|im_end|>\n"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {qtype: write_gguf(demo_dir(), root / f"demo-{qtype}.gguf", qtype, embedding_type="Q8_0" if qtype == "Q4_0"
                              else None) for qtype in TYPES}  # llama-quantize's Q4_0 of a tied model: so


def graph_logits(checkpoint, graph_file, ids: np.ndarray, weights: WeightFormat = WeightFormat()) -> np.ndarray:
    """The logits of every position of `ids`, prefilled in one call of a target graph built from `checkpoint`."""
    config = checkpoint.config
    graph = build_target_onnx(checkpoint, graph_file, weights=weights, lowering="ort", cache_rows=64)
    io = target_io(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, config.vocab_size, 0,
                   "float32", True, 1, 64)
    batch = TargetBatch(ids, np.arange(len(ids)), np.zeros(len(ids), np.int64), np.zeros(1, np.int64),
                        np.arange(len(ids)))
    return OrtRunner(graph, io, threads=1).run(batch)["logits"]


def test_the_tokenizer_and_chat_template_are_the_hugging_face_ones(files):
    spec = resolve_target(None, files["Q4_0"])
    ours, theirs = ChatTokenizer.from_dir(spec.path), ChatTokenizer.from_dir(demo_dir())
    assert ours.vocab_hash() == theirs.vocab_hash() and ours.special == theirs.special
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text)) == text
    chat = [{"role": "user", "content": "Write a haiku."}]
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat)
    assert ours.eos_token_ids[0] == theirs.eos_token_ids[0] and ours.pad_token_id == theirs.pad_token_id
    assert spec.config.architecture_fields() == resolve_target("demo").config.architecture_fields()


@pytest.mark.parametrize("qtype, weights", [("F32", "fp32"), ("Q8_0", "int8"), ("Q4_0", "int4"), ("Q5_0", "int8"),
                                            ("Q5_0", "int4")])
def test_an_engine_computes_with_the_files_own_weights(files, tmp_path, qtype, weights):
    """Logits of every position of a prompt equal the torch model holding the GGUF's dequantized weights (at
    accuracy level 0, float compute): each file's default format holds its blocks exactly (Q5_0's 5-bit codes fit
    int8's blocks of 32 too); Q5_0 forced into int4 is re-quantized and differs."""
    spec = resolve_target(None, files[qtype])
    assert spec.weights == weights or (qtype, weights) == ("Q5_0", "int4")
    checkpoint = spec.checkpoint()
    ids = np.asarray(ChatTokenizer.from_dir(spec.path).encode(TEXTS[0]))[:20]
    logits = graph_logits(checkpoint, tmp_path / "target.onnx", ids, WeightFormat(weights, accuracy_level=0))
    with torch.no_grad():
        reference = DecoderModel.from_checkpoint(checkpoint, "float32")(torch.from_numpy(ids[None])).logits[0].numpy()
    error = np.abs(logits - reference).max()
    assert error < 1e-3 if (qtype, weights) != ("Q5_0", "int4") else error > 1e-3
    if qtype == "Q4_0":  # and not our own int4 of the same weights: the file's blocks were carried
        ours = build_target_onnx(Checkpoint(demo_dir(), spec.config), tmp_path / "ours.onnx",
                                 weights=WeightFormat("int4", accuracy_level=0), lowering="ort", cache_rows=64)
        assert (tmp_path / "ours.onnx.data").read_bytes() != (tmp_path / "target.onnx.data").read_bytes()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_greedy_speculation_on_a_gguf_engine_equals_its_target(files, tmp_path, qtype):
    """Verification steps of every length compute alike (`fixed:1` = `fixed:3`); where this CPU computes a token
    alone as in a batch (`one_row_drift` 0: int4 on AVX-512 VNNI, not on AVX2) they equal `off` too, and with
    `exact_greedy` (every step an even number of rows) every mode equals `off` on every CPU."""
    spec = resolve_target(None, files[qtype])
    folder = build_engine(spec, tmp_path / "engine", resolve_drafter("demo-dspark"), "demo-dspark", cache_slots=2,
                          max_context=256, show_progress=False, weights=WeightFormat(spec.weights))
    assert json.loads((folder / "manifest.json").read_text())["sources"]["target"]
    size = size_engine(spec.config, 2, "float32", WeightFormat(spec.weights), max_context=256,
                       carrier=spec.checkpoint())  # the Q8_0 embedding of the Q4_0 file counted at 8 bits
    assert abs(size.weight_bytes - (folder / "target.onnx.data").stat().st_size) < 0.01 * size.weight_bytes
    with Engine.load(folder, OrtBackend(threads=1)) as engine:  # profiles on first load, one_row_drift included
        one_row_alike = json.loads((folder / "hardware_curve.json").read_text())["one_row_drift"] == 0.0
        for prompt in TEXTS[:2]:
            verified = engine.generate(prompt, GREEDY, spec="fixed:1").token_ids
            assert engine.generate(prompt, GREEDY, spec="fixed:3").token_ids == verified
            if one_row_alike:
                assert engine.generate(prompt, GREEDY, spec="off").token_ids == verified
    with Engine.load(folder, OrtBackend(threads=1), exact_greedy=True) as engine:
        for prompt in TEXTS[:2]:
            plain = engine.generate(prompt, GREEDY, spec="off").token_ids
            assert all(engine.generate(prompt, GREEDY, spec=mode).token_ids == plain
                       for mode in ("fixed:1", "fixed:3", "async"))


def test_inspect_names_each_files_quantization(files):
    for qtype, options, weights, exact in (("Q4_0", [], "int4", True), ("Q5_0", [], "int8", True),
                                           ("Q5_0", ["--weights", "int4"], "int4", False)):
        path = [str(files[qtype])] if options else ["--target-path", str(files[qtype])]  # PATH is --target-path
        result = CliRunner().invoke(export_main, ["inspect", *path, "--json", *options])
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)
        assert report["weights"] == str(files[qtype].resolve()) and report["memory"]["weights"] == weights
        found = report["gguf"]
        assert found["main_type"] == qtype and found["types"]["q_proj"] == f"{qtype} x6"
        assert found["all_exact"] == exact and (found["requantized_error"] > 0.05) == (not exact)
    twice = CliRunner().invoke(export_main, ["inspect", str(files["Q4_0"]), "--target-path", str(files["Q4_0"])])
    assert twice.exit_code == 2 and "PATH or --target-path" in twice.output


def test_bad_gguf_files_fail_in_one_line(files, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(files["Q4_0"].read_bytes()[: 1 << 20])
    foreign = write_gguf(demo_dir(), tmp_path / "foreign.gguf", "Q8_0", architecture="gemma")
    for file, message in ((truncated, "is not a valid GGUF file"), (foreign, "architecture 'gemma' is not one"),
                          (tmp_path / "missing.gguf", "does not exist")):
        result = CliRunner().invoke(export_main, ["build", "--target-path", str(file), "--no-drafter", "--out",
                                                  str(tmp_path / "engine")])
        assert result.exit_code != 0 and message in result.output, result.output
        assert not (tmp_path / "engine").exists()


def test_a_drafter_for_another_vocabulary_is_refused(tmp_path):
    """The bundled drafter (8192 tokens) beside a GGUF of another model (300 tokens): refused, nothing written."""
    from dspark_export.demo.tokenizer import train_tokenizer
    from tests.conftest import write_hf_checkpoint

    other = write_hf_checkpoint(tmp_path / "other", vocab_size=300, max_position_embeddings=64)
    train_tokenizer(["a small text for a small tokenizer"] * 4, other, vocab_size=300)
    file = write_gguf(other, tmp_path / "other.gguf", "Q8_0")
    with pytest.raises(DSparkError, match="vocab_size=8192, but this target has vocab_size=300"):
        build_engine(resolve_target(None, file), tmp_path / "engine", resolve_drafter("demo-dspark"), "demo-dspark",
                     show_progress=False)
    assert not (tmp_path / "engine").exists()


def test_a_gguf_is_found_by_name_where_its_tool_keeps_it(files, tmp_path, monkeypatch):
    """Ollama's manifests and blobs, LM Studio's models folder and the Hugging Face cache, as those tools lay them
    out; an unknown name and an ambiguous folder fail in one line."""
    import shutil

    home, ollama, hub = tmp_path / "home", tmp_path / "ollama", tmp_path / "hub"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    digest = "sha256:" + "ab" * 32
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "demo" / "q4"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32},
        {"mediaType": "application/vnd.ollama.image.model", "digest": digest}]}))
    (ollama / "blobs").mkdir()
    shutil.copy(files["Q4_0"], ollama / "blobs" / digest.replace(":", "-"))
    lmstudio = home / ".lmstudio" / "models" / "dspark" / "demo-GGUF"
    lmstudio.mkdir(parents=True)
    for qtype in ("Q4_0", "Q8_0"):
        shutil.copy(files[qtype], lmstudio / files[qtype].name)
    snapshot = hub / "models--dspark--demo-GGUF" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    shutil.copy(files["Q8_0"], snapshot / "demo-Q8_0.gguf")

    for reference, name, weights in (("ollama:demo:q4", "demo-q4", "int4"),
                                     ("lmstudio:dspark/demo-GGUF/demo-Q8_0.gguf", "dspark-demo-GGUF-demo-Q8_0", "int8"),
                                     ("hf:dspark/demo-GGUF", "dspark-demo-GGUF", "int8")):
        spec = resolve_target(None, reference)
        assert (spec.name, spec.weights) == (name, weights)
        assert spec.config.architecture_fields() == resolve_target("demo").config.architecture_fields()
    for reference, message in (("ollama:qwen3:8b", "Ollama has no model qwen3:8b here"),
                               ("lmstudio:dspark/demo-GGUF", "holds several GGUF files; name one"),
                               ("hf:dspark/other", "the Hugging Face cache has no GGUF file dspark/other")):
        with pytest.raises(DSparkError, match=message):
            resolve_target(None, reference)


def test_a_qwen2_gguf_keeps_its_attention_biases(tmp_path):
    """Qwen2.5's q/k/v biases come through llama.cpp's names: the GGUF engine's logits equal the safetensors
    checkpoint's torch model."""
    from dspark_export.demo.tokenizer import train_tokenizer
    from tests.conftest import write_hf_checkpoint

    folder = write_hf_checkpoint(tmp_path / "qwen2", architecture="qwen2", vocab_size=300, max_position_embeddings=64)
    train_tokenizer(["a small text for a small tokenizer"] * 4, folder, vocab_size=300)
    spec = resolve_target(None, write_gguf(folder, tmp_path / "qwen2.gguf"))
    assert spec.config == resolve_target(None, folder).config.with_dtype("float32")
    ours, theirs = ChatTokenizer.from_dir(spec.path), ChatTokenizer.from_dir(folder)
    assert theirs.vocab_size < 300 and ours.vocab_hash() == theirs.vocab_hash()  # the [PAD] rows are not tokens
    checkpoint = spec.checkpoint()
    assert "model.layers.0.self_attn.q_proj.bias" in checkpoint.tensors
    ids = np.arange(3, 15)
    logits = graph_logits(checkpoint, tmp_path / "target.onnx", ids)
    reference = DecoderModel.from_checkpoint(resolve_target(None, folder).checkpoint(), "float32")
    with torch.no_grad():
        assert np.abs(logits - reference(torch.from_numpy(ids[None])).logits[0].numpy()).max() < 1e-4


def test_a_llama_gguf_is_read_back_to_its_hugging_face_model(tmp_path):
    """A Llama 3 as llama.cpp converts it (q and k rows permuted per head, llama3 rotary scaling as `rope_freqs`,
    pre-tokenizer llama-bpe): the config's rotary scaling is recovered, digits are split by threes, and the engine's logits equal the safetensors checkpoint's torch model
    (float weights) and the torch model on the file's dequantized weights (Q8_0, carried)."""
    from tokenizers import Tokenizer

    from dspark_export.demo.tokenizer import train_tokenizer
    from tests.conftest import write_hf_checkpoint

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 5e5}
    folder = write_hf_checkpoint(tmp_path / "llama", architecture="llama", vocab_size=300, max_position_embeddings=64,
                                 tie_word_embeddings=False, rope_parameters=rope)
    train_tokenizer(["a small text for a small tokenizer"] * 4, folder, vocab_size=300)
    hf = resolve_target(None, folder)
    assert hf.config.rope_type == "llama3"
    ids = np.arange(3, 15)
    with torch.no_grad():
        reference = DecoderModel.from_checkpoint(hf.checkpoint(), "float32")(torch.from_numpy(ids[None])).logits[0]
    for qtype in ("F32", "Q8_0"):
        spec = resolve_target(None, write_gguf(folder, tmp_path / f"llama-{qtype}.gguf", qtype,
                                               pre_tokenizer="llama-bpe"))
        assert spec.config == hf.config.with_dtype("float32")
        pieces = Tokenizer.from_file(str(spec.path / "tokenizer.json")).pre_tokenizer.pre_tokenize_str("x 12345")
        assert [piece for piece, _ in pieces] == ["x", "Ġ", "123", "45"]  # Llama 3 splits digits by threes
        checkpoint = spec.checkpoint()
        logits = graph_logits(checkpoint, tmp_path / f"{qtype}.onnx", ids,
                              WeightFormat(spec.weights, accuracy_level=0))
        if qtype == "F32":
            assert np.abs(logits - reference.numpy()).max() < 1e-4
        else:
            with torch.no_grad():
                dequantized = DecoderModel.from_checkpoint(checkpoint, "float32")(torch.from_numpy(ids[None]))
            assert np.abs(logits - dequantized.logits[0].numpy()).max() < 1e-3


def test_q6_k_blocks_are_carried_exactly():
    """Q6_K (Q4_K_M's output layer and some v/down projections) becomes 8-bit codes in blocks of 16 with zero point
    32: (code - 32) · scale equals the gguf package's own dequantization bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from dspark_export.gguf_target import Dequantized, _q6_k

    rng = np.random.default_rng(0)
    n, k = 6, 512
    codes = rng.integers(0, 64, (n, k), dtype=np.uint8)
    sub_scales = rng.integers(-128, 128, (n, k // 16))
    d = rng.random((n, k // 256)).astype(np.float16) * 0.01
    data = q6_k_bytes(codes, sub_scales, d)
    values = dequantize(data, GGMLQuantizationType.Q6_K).reshape(n, k)
    carried = _q6_k(data, n, Dequantized(data, GGMLQuantizationType.Q6_K, (n, k)))
    assert (carried.layout.bits, carried.layout.block_size) == (8, 16)
    rebuilt = (carried.codes.astype(np.float32) - carried.zero_points[..., None]) * carried.scales[..., None]
    assert np.array_equal(rebuilt.reshape(n, k), values)
    nonzero = np.repeat(sub_scales != 0, 16, axis=1)
    assert np.array_equal(carried.codes.reshape(n, k)[nonzero], codes[nonzero])


def ggml_q8_k(x: np.ndarray) -> np.ndarray:
    """ggml's `quantize_row_q8_K_ref`, each code times its block's d: per 256, iscale = -127/peak (the first element
    of largest magnitude), code = min(127, nearest_int(iscale·x)), d = 1/iscale; a block of zeros stays zeros."""
    blocks = x.astype(np.float32).reshape(-1, 256)
    out = np.zeros_like(blocks)
    for row, block in enumerate(blocks):
        peak = block[np.argmax(np.abs(block))]
        if peak != 0:
            iscale = np.float32(-127.0) / peak
            out[row] = np.minimum(np.float32(127), np.rint(iscale * block)) * (np.float32(1) / iscale)
    return out.reshape(x.shape)


def test_the_q8_k_rounding_nodes_round_as_ggml_does():
    """ggml's codes and scales (their product to float rounding: ONNX Runtime may fold code · (1/iscale) into one
    division), with zeros, a negative peak, a tie of magnitudes (the first wins) and codes on halves (to even)."""
    from onnx import TensorProto, helper
    import onnxruntime as ort

    from dspark_export.graphs.ggml_rounding import q8_k_rounding
    from dspark_plugins.builder import GraphBuilder

    x = np.random.default_rng(1).standard_normal((3, 768)).astype(np.float32)
    x[0, :256] = 0
    x[1, 300] = -9.0
    x[2, :256] = np.arange(256) % 20 - 9.5
    x[2, 0] = -127.0  # scale 1: the halves above round to even
    x[2, 512:514] = 5.0, -5.0
    b = GraphBuilder()
    b.op("Identity", q8_k_rounding(b, "x"), name="y")
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [3, 768])  # noqa: E731
    model = helper.make_model(helper.make_graph(b.nodes, "q8_k", [value("x")], [value("y")]),
                              opset_imports=[helper.make_opsetid("", 21)])
    (ours,) = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    np.testing.assert_allclose(ours, ggml_q8_k(x), rtol=1e-6, atol=0)  # a code off by one is 1/127 or more
    assert not ours[0, :256].any() and np.array_equal(ours[2, :20], np.rint(x[2, :20]))


def test_a_q6_k_head_multiplies_activations_rounded_as_llama_cpp_rounds_them(tmp_path):
    """llama.cpp multiplies Q6_K blocks (a Q4_0 file's tied LM head at real sizes) by activations rounded to Q8_K:
    the engine's logits are the file's dequantized head times the final hidden states so rounded, not unrounded."""
    from dspark_export.demo.tokenizer import train_tokenizer
    from tests.conftest import write_hf_checkpoint

    folder = write_hf_checkpoint(tmp_path / "qwen3", vocab_size=300, hidden_size=256, max_position_embeddings=64,
                                 tie_word_embeddings=True)
    train_tokenizer(["a small text for a small tokenizer"] * 4, folder, vocab_size=300)
    spec = resolve_target(None, write_gguf(folder, tmp_path / "q6_k.gguf", "Q8_0", embedding_type="Q6_K"))
    checkpoint = spec.checkpoint()
    assert checkpoint.rounds_activations("model.embed_tokens.weight")
    assert not checkpoint.rounds_activations("model.layers.0.mlp.up_proj.weight")  # Q8_0: ONNX Runtime's own int8
    ids = np.arange(3, 15)
    logits = graph_logits(checkpoint, tmp_path / "target.onnx", ids, WeightFormat(spec.weights, accuracy_level=0))
    with torch.no_grad():
        model = DecoderModel.from_checkpoint(checkpoint, "float32")
        hidden = model(torch.from_numpy(ids[None]), feature_layers=[2], logits=False).features[2][0].numpy()
    head = checkpoint.float32("model.embed_tokens.weight")
    assert np.abs(logits - ggml_q8_k(hidden) @ head.T).max() < 1e-4
    assert np.abs(logits - hidden @ head.T).max() > 1e-3


def k_quant_file(tmp_path, kind: str):
    """A Qwen3 with every width a multiple of 256 (K-quant blocks), written as `kind` with a Q6_K embedding, as
    llama-quantize's Q4_K_M and Q5_K_M keep it."""
    from dspark_export.demo.tokenizer import train_tokenizer
    from tests.conftest import write_hf_checkpoint

    folder = write_hf_checkpoint(tmp_path / "qwen3", vocab_size=300, hidden_size=256, intermediate_size=512,
                                 num_attention_heads=4, num_key_value_heads=1, head_dim=64, max_position_embeddings=64,
                                 tie_word_embeddings=True)
    train_tokenizer(["a small text for a small tokenizer"] * 4, folder, vocab_size=300)
    return resolve_target(None, write_gguf(folder, tmp_path / f"{kind}.gguf", kind, embedding_type="Q6_K"))


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_k_quant_blocks_are_carried_exactly(kind):
    """Codes, scales d·sc and offsets -dmin·m read from Q4_K/Q5_K blocks give back the gguf package's dequantized
    weights bit for bit (an all-zero run and a constant one included)."""
    from gguf.quants import dequantize

    from dspark_export.gguf_target import _k_quant
    from tests.gguf_files import k_quant

    rng = np.random.default_rng(0)
    values = (rng.standard_normal((8, 512)) * np.linspace(0.01, 3, 512)).astype(np.float32)
    values[0, :32], values[1, 32:64] = 0.0, 5.0
    blocks = k_quant(values, kind)
    expected = dequantize(blocks, gguf.GGMLQuantizationType[kind]).astype(np.float32)
    carried = _k_quant(blocks, 8, expected, kind)
    codes = carried.codes
    if carried.layout.bits == 4:  # two to a byte, the even element low
        codes = np.stack([codes & 0xF, codes >> 4], axis=-1)
    weights = codes.reshape(8, -1, 32).astype(np.float32) * carried.scales[..., None] + carried.offsets[..., None]
    assert np.array_equal(weights.reshape(8, -1).view(np.uint32), expected.view(np.uint32))
    assert not carried.zero_points.any()


@pytest.mark.parametrize("kind, weights", [("Q4_K", "int4"), ("Q5_K", "int8")])
@pytest.mark.parametrize("operators", [True, False], ids=["ggml-products", "matmulnbits"])
def test_a_k_quant_file_is_computed_with_its_own_weights(tmp_path, monkeypatch, kind, weights, operators):
    """No matrix of a Q4_K or Q5_K file is re-quantized, and the engine's logits are the torch model's on the file's
    dequantized weights: with DSpark's K-quant operators (x86-64 with a C compiler) every product's input rounded to
    Q8_K as ggml rounds it; without them (`MatMulNBits`), their rounding left out (it has its own test)."""
    from dspark_common import native
    from dspark_export.gguf_target import GGUFCheckpoint, quantization_report

    if operators and not native.usable():
        pytest.skip("DSpark's operators need an x86-64 CPU and a C compiler")
    monkeypatch.setattr(native, "usable", lambda: operators)
    spec = k_quant_file(tmp_path, kind)
    checkpoint = spec.checkpoint()
    report = quantization_report(checkpoint, WeightFormat(spec.weights))
    assert spec.weights == weights and report["requantized"] == {} and report["all_exact"]
    assert checkpoint.rounds_activations("model.layers.0.mlp.up_proj.weight")
    monkeypatch.setattr(GGUFCheckpoint, "rounds_activations", lambda self, name: False)
    ids = np.arange(3, 15)
    logits = graph_logits(checkpoint, tmp_path / "target.onnx", ids, WeightFormat(weights, accuracy_level=0))
    with torch.no_grad():
        model = DecoderModel.from_checkpoint(checkpoint, "float32")
        unrounded = model(torch.from_numpy(ids[None])).logits[0].numpy()
        if not operators:
            assert np.abs(logits - unrounded).max() < 1e-4
            return
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda _, inputs: torch.from_numpy(ggml_q8_k(inputs[0].numpy())))
        rounded = model(torch.from_numpy(ids[None])).logits[0].numpy()
    # the first position attends to itself alone: the same function to float rounding. Later ones attend in a
    # different float order, and where that moves an activation across a rounding edge its code differs by one.
    assert np.abs(logits[0] - rounded[0]).max() < 1e-5 < 1e-3 < np.abs(logits[0] - unrounded[0]).max()
    assert np.abs(logits - rounded).max() < 0.05


def test_the_default_engine_is_one_chat_of_half_a_gib(tmp_path):
    """`inspect` (and so `build`) of Qwen3-1.7B by default: one slot, a KV cache of at most 0.5 GiB."""
    result = CliRunner().invoke(export_main, ["inspect", "--target", "qwen3-1.7b", "--json"])
    memory = json.loads(result.output)["memory"]
    assert memory["slots"] == 1 and memory["kv_cache_bytes"] <= 1 << 29 and memory["context"] >= 2048
