"""Shared fixtures: tiny random Qwen3 checkpoints written by `transformers` in Hugging Face layout."""

from __future__ import annotations

from pathlib import Path

import pytest

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
