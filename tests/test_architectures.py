"""Llama-3.x (`llama3` rotary scaling) and Qwen2.5 (q/k/v biases, no q/k norms) targets against `transformers`' own
classes. Stand-ins keep a published config.json whole (tests/fixtures/configs) but its sizes: the same rotary
scaling, biases, tying and fields, at a size a test can build. Our torch model and our ONNX engine generate
greedily what `transformers` generates and match its logits; a drafter of each kind, trained a few steps on each,
builds into an engine that is greedy-lossless and passes the chi-square test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy.stats")

from click.testing import CliRunner  # noqa: E402

from dspark_export.cli import main  # noqa: E402
from dspark_export.config import DecoderConfig  # noqa: E402
from dspark_export.loading import load_target  # noqa: E402
from dspark_export.presets import PRESETS, resolve_target  # noqa: E402
from dspark_runtime import Engine, OrtBackend, SamplingParams  # noqa: E402
from dspark_runtime.batches import TargetBatch  # noqa: E402
from dspark_common.engine_dir import read_manifest  # noqa: E402
from tests.conftest import (TEXT, exact_joint, p_value, randomized, sample_pairs, write_curve,  # noqa: E402
                            write_sequences)

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=1)
LOGIT_SCALE = 20.0  # peaked next-token distributions, so that a few thousand samples can tell two apart
PROMPTS = ["def add(a, b):", "The answer is", "Hello there"]


def published(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def cli(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("name", sorted(path.stem for path in CONFIGS.glob("*.json")))
def test_published_configs_read_as_their_presets(name):
    assert DecoderConfig.from_hf_dict(published(name)) == PRESETS[name][1]


@pytest.mark.parametrize("name, family", [("llama-3.1-8b", "Llama, 32 layers"), ("qwen2.5-7b", "Qwen2, 28 layers")])
def test_inspect_names_the_family_and_sizes_the_engine(name, family, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    output = cli("inspect", "--target", name, "--weights", "int4")
    assert family in output and "weights" in output and "KV cache" in output


@pytest.fixture(scope="module", params=["llama-3.1-8b", "qwen2.5-7b"])
def stand_in(request, tmp_path_factory) -> Path:
    """A random checkpoint whose config.json is the published one but for its sizes, with a 300-token tokenizer."""
    from dspark_export.demo.tokenizer import train_tokenizer

    folder = tmp_path_factory.mktemp(request.param)
    config = published(request.param) | SIZES
    hf_config = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(0)
    model = randomized(transformers.AutoModelForCausalLM.from_config(hf_config).eval())
    model.save_pretrained(folder)
    sharpen(folder)
    (folder / "config.json").write_text(json.dumps(config, indent=2))  # the published layout, not transformers' own
    train_tokenizer(TEXT, folder, vocab_size=300)
    return folder


def sharpen(folder: Path) -> None:
    """Scale the checkpoint's (untied) LM head by LOGIT_SCALE."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] *= LOGIT_SCALE
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def assert_lossless(engine_dir: Path) -> list[int]:
    """Greedy `fixed:3` gives `off`'s tokens for every prompt, and pairs of sampled tokens follow the target's own
    distribution (chi-square); returns each sampled request's verification rounds."""
    write_curve(engine_dir, [0.001] * 256, [0.001] * 8)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    rounds: list[int] = []
    with Engine.load(engine_dir, OrtBackend(threads=1)) as engine:
        prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
        for prompt in prompts:
            assert engine.generate(prompt, greedy, spec="fixed:3").token_ids == \
                engine.generate(prompt, greedy, spec="off").token_ids
        counts = sample_pairs(engine, prompts[2], sampled, "fixed:3", rounds)
    assert p_value(counts, exact_joint(engine_dir, prompts[2], sampled)) > 1e-3
    return rounds


def reference_greedy(folder: Path, prompt: list[int], count: int) -> tuple[list[int], np.ndarray]:
    """`transformers`' greedy continuation of `prompt`, and its logits over the prompt."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=count, do_sample=False, eos_token_id=None, pad_token_id=0)
        logits = model(ids).logits[0].numpy()
    return out[0, len(prompt):].tolist(), logits


def test_torch_model_and_engine_generate_what_transformers_does(stand_in, tmp_path):
    from dspark_common.tokenizer import ChatTokenizer

    prompt = ChatTokenizer.from_dir(stand_in).encode(PROMPTS[0])
    expected, expected_logits = reference_greedy(stand_in, prompt, 24)
    ours, _ = load_target(resolve_target(None, stand_in))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        assert np.abs(ours(ids).logits[0].numpy() - expected_logits).max() <= 1e-4
        for _ in range(24):
            ids = torch.cat([ids, ours(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert ids[0, len(prompt):].tolist() == expected

    engine_dir = tmp_path / "engine"
    cli("build", "--target-path", str(stand_in), "--out", str(engine_dir), "--cache-slots", "2")
    target, _ = OrtBackend(threads=1).open(engine_dir, read_manifest(engine_dir))
    batch = TargetBatch(np.asarray(prompt), np.arange(len(prompt)), np.zeros(len(prompt), np.int64),
                        np.zeros(2, np.int64), np.arange(len(prompt)))
    assert np.abs(target.run(batch)["logits"] - expected_logits).max() <= 1e-4
    write_curve(engine_dir, [0.001] * 256, [0.001] * 8)
    with Engine.load(engine_dir, OrtBackend(threads=1)) as engine:
        result = engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert result.token_ids == expected


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_a_trained_drafter_of_each_kind_evaluates_and_builds_into_a_lossless_engine(stand_in, tmp_path, kind):
    write_sequences(tmp_path / "data.npz")
    drafter, engine_dir = tmp_path / "drafter", tmp_path / "engine"
    cli("train", "--target-path", str(stand_in), "--drafter-type", kind, "--gamma", "3", "--data",
        str(tmp_path / "data.npz"), "--out", str(drafter), "--steps", "3", "--batch", "4", "--anchors", "4",
        "--threads", "1")
    report = json.loads(cli("eval", "--target-path", str(stand_in), "--drafter", str(drafter), "--limit", "1",
                            "--max-new", "12", "--temperature", "0", "--json"), parse_constant=pytest.fail)
    assert report["rounds"] > 0 and 1.0 <= report["tau"] <= 4.0  # the torch evaluator ran speculative rounds
    cli("build", "--target-path", str(stand_in), "--drafter", str(drafter), "--out", str(engine_dir))
    assert_lossless(engine_dir)


@pytest.mark.parametrize("layout", ["specforge", "speculators"])
def test_an_eagle3_drafter_for_a_llama_target_builds_and_is_lossless(tmp_path, layout):
    """SpecForge's EAGLE-3 layout (LlamaForCausalLMEagle3: Llama layers, no q/k norms), and the same drafter converted
    to speculators', drafting for a Llama-3 target with `llama3` rotary scaling, as published drafters for
    Llama-3.1-8B do."""
    import shutil

    from tests.conftest import SAMPLES, write_hf_checkpoint
    from tests.test_interop_engine import FIXTURES

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    fixture_target = json.loads((FIXTURES / "target" / "config.json").read_text())
    dims = {key: fixture_target[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                 "num_attention_heads", "num_key_value_heads", "head_dim")}
    target = write_hf_checkpoint(tmp_path / "target", architecture="llama", rope_parameters=rope, **dims)
    sharpen(target)
    from dspark_export.demo.tokenizer import train_tokenizer

    train_tokenizer(TEXT, target, vocab_size=300)
    drafter = shutil.copytree(FIXTURES / "specforge-eagle3", tmp_path / "specforge")
    config = json.loads((drafter / "config.json").read_text()) | {"rope_parameters": rope}
    (drafter / "config.json").write_text(json.dumps(config))
    if layout == "speculators":
        cli("convert", str(drafter), "--target-path", str(target), "--to", "speculators", "--out",
            str(tmp_path / "speculators"))
        drafter = tmp_path / "speculators"
    engine_dir = tmp_path / "engine"
    cli("build", "--target-path", str(target), "--drafter", str(drafter), "--out", str(engine_dir), "--max-context",
        "64")
    assert sum(assert_lossless(engine_dir)) > 0.5 * SAMPLES  # the drafts were verified


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2.5-7b"])
def test_a_preset_and_its_checkpoint_folder_resolve_together(name, tmp_path):
    """`--target NAME --target-path DIR` with the published config.json and a checkpoint of the full size (a sparse
    file: every tensor where its header says, no bytes written) passes every check before the weights are read."""
    import struct

    from dspark_export.checkpoint import expected_shapes

    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(published(name)))
    header, offset = {}, 0
    for tensor, shape in expected_shapes(PRESETS[name][1]).items():
        size = 2 * int(np.prod(shape))
        header[tensor] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    with (folder / "model.safetensors").open("wb") as handle:
        handle.write(struct.pack("<Q", len(blob)) + blob)
        handle.truncate(8 + len(blob) + offset)
    output = cli("inspect", "--target", name, "--target-path", str(folder), "--weights", "int4")
    assert f"weights      {folder}" in output and "dtype        bfloat16" in output
    tiny = published(name) | SIZES
    (folder / "config.json").write_text(json.dumps(tiny))
    result = CliRunner().invoke(main, ["build", "--target", name, "--target-path", str(folder)])
    assert result.exit_code == 1 and f"does not match --target {name}" in result.output
