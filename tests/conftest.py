"""Shared helpers and fixtures: tiny random Qwen3 checkpoints written by `transformers` in Hugging Face
layout, drafters for them, and engines built from both."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# CLI commands run in the test process: keep per-session thread pools, which other tests' sessions need
os.environ["DSPARK_THREAD_POOL"] = "session"

TEXT = ["def add(a, b):\n    return a + b\n", "The answer is 42.", "Hello there, friend!"] * 20

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=256,
)


def write_hf_checkpoint(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """Save a randomly initialised `transformers.Qwen3ForCausalLM` (fp32) and return its folder."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**(TINY | overrides))
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # random norms, so a wrong norm weight mapping cannot hide behind all-ones
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Path:
    return write_hf_checkpoint(tmp_path / "tiny")


def write_drafter(target_folder, out, **overrides):
    """A randomly initialised drafter for the target in `target_folder` (DSpark, one layer, γ = 3 by default)."""
    from dspark_export.config import Qwen3Config
    from dspark_export.drafters.checkpoint import build_drafter, save_drafter
    from dspark_export.drafters.config import DrafterConfig
    from dspark_runtime.tokenizer import ChatTokenizer

    config = Qwen3Config.from_dir(target_folder)
    fields = dict(drafter_type="dspark", target=config.architecture_fields() | {"dtype": "float32"},
                  vocab_hash=ChatTokenizer.from_dir(target_folder).vocab_hash(), mask_token_id=3, num_layers=1,
                  gamma=3, feature_layers=(1,), markov_rank=8)
    save_drafter(build_drafter(DrafterConfig(**(fields | overrides))), out)
    return out


def build_echo_engine(root, markov_scale: float = 0.0, embedding_scale: float = 1.0, context: int = 64,
                      flat_curve: bool = False, weights: str = "fp32", accuracy_level: int = 4):
    """Positive control: with every layer's output projection zeroed, target and drafter both map a token
    to argmax E·norm(e_x); the drafter's first slot (the anchor's) always matches, later slots (MASK) rarely.
    A non-zero `markov_scale` gives the drafter a random Markov bias, so its distribution differs from p;
    `embedding_scale` sharpens both distributions (larger logits); `flat_curve` writes a stand-in
    hardware_curve.json so that loading skips profiling; `weights` quantizes the target (int8, int4)."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    from dspark_export.build import build_engine
    from dspark_export.demo.tokenizer import train_tokenizer
    from dspark_export.drafters.checkpoint import build_drafter, save_drafter
    from dspark_export.drafters.config import DrafterConfig
    from dspark_export.graphs.weights import WeightFormat
    from dspark_export.presets import resolve_target

    target = write_hf_checkpoint(
        root / "target", vocab_size=300, max_position_embeddings=context, tie_word_embeddings=True
    )
    train_tokenizer(TEXT, target, vocab_size=300)
    tensors = load_file(target / "model.safetensors")
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name].zero_()
    tensors["model.embed_tokens.weight"] *= embedding_scale
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    drafter_dir = write_drafter(target, root / "drafter", gamma=3)
    drafter = build_drafter(DrafterConfig.from_dir(drafter_dir))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
            if name == "markov_head.markov_w2.weight":
                param.normal_(0, markov_scale) if markov_scale else param.zero_()
    save_drafter(drafter, drafter_dir)
    engine_dir = build_engine(resolve_target(None, target), root / "engine", drafter_dir, "echo", cache_slots=8,
                              show_progress=False, weights=WeightFormat(weights, accuracy_level=accuracy_level))
    if flat_curve:
        curve = {"target_seconds": [0.001] * 256, "draft_seconds": [0.001] * 8}
        (engine_dir / "hardware_curve.json").write_text(json.dumps(curve))
    return engine_dir
