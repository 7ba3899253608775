"""Shared helpers and fixtures: tiny random Qwen3, Qwen2.5 and Llama-3 checkpoints written by `transformers` in
Hugging Face layout, drafters for them, and engines built from both."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
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


HF_CLASSES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "llama": ("LlamaConfig", "LlamaForCausalLM")}


def randomized(model):
    """`model` with random norm weights and biases, so that a wrong mapping cannot hide behind ones and zeros."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.uniform_(-0.5, 0.5)
    return model


def write_hf_checkpoint(folder: Path, seed: int = 0, max_shard_size: str | None = None, architecture: str = "qwen3",
                        **overrides) -> Path:
    """Save a randomly initialised `transformers` model of `architecture` (a model_type: qwen3, qwen2, llama; fp32)
    and return its folder."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config_class, model_class = (getattr(transformers, name) for name in HF_CLASSES[architecture])
    torch.manual_seed(seed)
    model = randomized(model_class(config_class(**(TINY | overrides))).eval())
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Path:
    return write_hf_checkpoint(tmp_path / "tiny")


@pytest.fixture
def tiny_target(tmp_path):
    """A tiny random target with its own 300-token tokenizer."""
    pytest.importorskip("torch")
    from dspark_export.demo.tokenizer import train_tokenizer

    folder = write_hf_checkpoint(tmp_path / "target", tie_word_embeddings=True, vocab_size=300)
    train_tokenizer(
        ["def add(a, b):\n    return a + b\n", "The answer is 42.", "Hello there!"] * 30, folder, vocab_size=300
    )
    return folder


def write_sequences(file, count=12, length=24):
    """A distillation file of `count` random sequences of `length` tokens, the first 6 of each the prompt."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, 290, size=count * length).astype(np.uint16)
    np.savez(file, tokens=tokens, starts=np.arange(count) * length, lengths=np.full(count, length, dtype=np.int32),
             prompt_lengths=np.full(count, 6, dtype=np.int32))


def write_drafter(target_folder, out, **overrides):
    """A randomly initialised drafter for the target in `target_folder` (DSpark, one layer, γ = 3 by default)."""
    from dspark_export.config import DecoderConfig
    from dspark_export.drafters.checkpoint import build_drafter, save_drafter
    from dspark_export.drafters.config import DrafterConfig
    from dspark_common.tokenizer import ChatTokenizer

    config = DecoderConfig.from_dir(target_folder)
    fields = dict(drafter_type="dspark", target=config.architecture_fields() | {"dtype": "float32"},
                  vocab_hash=ChatTokenizer.from_dir(target_folder).vocab_hash(), mask_token_id=3, num_layers=1,
                  gamma=3, feature_layers=(1,), markov_rank=8)
    save_drafter(build_drafter(DrafterConfig(**(fields | overrides))), out)
    return out


def build_echo_engine(root, markov_scale: float = 0.0, embedding_scale: float = 1.0, context: int = 64,
                      flat_curve: bool = False, weights: str = "fp32", accuracy_level: int = 4,
                      draft_vocab: int | None = None):
    """Positive control: with every layer's output projection zeroed, target and drafter both map a token
    to argmax E·norm(e_x); the drafter's first slot (the anchor's) always matches, later slots (MASK) rarely.
    A non-zero `markov_scale` gives the drafter a random Markov bias, so its distribution differs from p;
    `embedding_scale` sharpens both distributions (larger logits); `flat_curve` writes a stand-in
    hardware_curve.json so that loading skips profiling; `weights` quantizes the target (int8, int4); `draft_vocab`
    prunes the drafter to that many tokens of random frequencies at build."""
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
    vocab = None
    if draft_vocab:
        from dspark_export.drafters.draft_vocab import DraftVocab

        (root / "counts.json").write_text(json.dumps(np.random.default_rng(0).integers(0, 1000, 300).tolist()))
        vocab = DraftVocab(draft_vocab, (root / "counts.json",))
    engine_dir = build_engine(resolve_target(None, target), root / "engine", drafter_dir, "echo", cache_slots=8,
                              show_progress=False, weights=WeightFormat(weights, accuracy_level=accuracy_level),
                              draft_vocab=vocab)
    if flat_curve:
        write_curve(engine_dir, [0.001] * 256, [0.001] * 8)
    return engine_dir


def write_curve(folder: Path, target_seconds: list[float], draft_seconds: list[float], threads: int = 1,
                shared_pool: bool = False) -> None:
    """A stand-in hardware_curve.json, recorded as measured on this machine with `threads` threads (so that
    `Engine.load` with those threads schedules from it instead of profiling again)."""
    curve = {"target_seconds": target_seconds, "draft_seconds": draft_seconds,
             "machine": OrtBackend(threads, shared_pool=shared_pool).machine()}
    (folder / "hardware_curve.json").write_text(json.dumps(curve))


@pytest.fixture
def curve_as_written(monkeypatch):
    """Engines decide from the curve `write_curve` wrote: what steps cost in the loop is not recorded
    (`dspark_runtime.loop_costs`), so a stand-in curve's decisions do not depend on this machine's speed."""
    from dspark_runtime.loop_costs import LoopCosts

    monkeypatch.setattr(LoopCosts, "target_step", lambda self, tokens, seconds: None)
    monkeypatch.setattr(LoopCosts, "drafter_call", lambda self, requests, context_rows, sampling, seconds: None)


# ---- losslessness: the target graph's exact joint of the first two tokens, and sampled pairs against it ----

from dspark_runtime import SamplingParams  # noqa: E402
from dspark_runtime.backend import OrtBackend  # noqa: E402
from dspark_runtime.batches import TargetBatch  # noqa: E402
from dspark_common.engine_dir import read_manifest  # noqa: E402
from dspark_common.lossless import target_rows  # noqa: E402

SAMPLES = 3000


def exact_joint(engine_dir, prompt_ids, params) -> dict[tuple[int, int], float]:
    """The target graph's own distribution of the first two tokens: a prefill of the prompt, then of each
    continuation the first token can take."""
    target, _ = OrtBackend(threads=1).open(engine_dir, read_manifest(engine_dir))
    slots = read_manifest(engine_dir).cache_slots

    def last_logits(ids: list[int]) -> np.ndarray:
        batch = TargetBatch(
            np.asarray(ids),
            np.arange(len(ids)),
            np.zeros(len(ids), np.int64),
            np.zeros(slots, np.int64),
            np.asarray([len(ids) - 1]),
        )
        return target.run_feeds(batch.feeds(target.io))["logits"]

    first = target_rows(last_logits(prompt_ids), np.asarray(prompt_ids), np.zeros(0, np.int64), params)[0]
    joint = {}
    for y1 in np.flatnonzero(first):
        ids = prompt_ids + [int(y1)]
        second = target_rows(last_logits(ids), np.asarray(ids), np.zeros(0, np.int64), params)[0]
        for y2 in np.flatnonzero(second):
            joint[(int(y1), int(y2))] = first[y1] * second[y2]
    return joint


def sample_pairs(engine, prompt_ids, params, spec, rounds: list[int] | None = None) -> dict[tuple[int, int], int]:
    """Counts of the first two generated tokens over SAMPLES seeds (and each request's verification rounds)."""
    requests = [
        engine.submit(prompt_ids, SamplingParams(**{**params.__dict__, "seed": seed}), spec=spec)
        for seed in range(SAMPLES)
    ]
    counts: dict[tuple[int, int], int] = {}
    for request in requests:
        result = request.result()
        pair = tuple(result.token_ids[:2])
        counts[pair] = counts.get(pair, 0) + 1
        if rounds is not None:
            rounds.append(result.stats.rounds)
    return counts


def p_value(counts, joint) -> float:
    """Chi-square p-value of the sampled pair counts against the exact joint (sparse bins merged; 0 for any pair
    the target cannot produce)."""
    keys = sorted(joint, key=lambda k: -joint[k])
    expected = np.array([joint[k] for k in keys]) * SAMPLES
    observed = np.array([counts.get(k, 0) for k in keys], dtype=float)
    outside = SAMPLES - observed.sum()  # pairs the target can never produce
    if outside > 0:
        return 0.0
    small = expected < 5  # merge sparse bins
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    from scipy import stats

    return stats.chisquare(observed, expected).pvalue


def drafter_feeds(reference, source, temperature: float, slots: int = 2, rows: int = 16) -> dict[str, np.ndarray]:
    """Drafter-graph inputs for the two requests of an interop fixture's `reference.npz`, at once: request r in
    slot r, all of its context new; caches of `slots` x `rows` positions."""
    config, target = source.config, source.config.target_config
    contexts = [reference[f"features_{r}"] for r in range(2)]
    shape = (slots, target.num_key_value_heads, rows, target.head_dim)
    return (
        {
            "context_features": np.concatenate(contexts),
            "cache_len": np.zeros(slots, np.int64),
            "context_slot": np.concatenate([np.full(len(c), r) for r, c in enumerate(contexts)]).astype(np.int64),
            "context_pos": np.concatenate([np.arange(len(c)) for c in contexts]).astype(np.int64),
            "anchor_ids": reference["anchors"].astype(np.int64),
            "anchor_pos": np.array([len(c) for c in contexts]),
            "request_slot": np.arange(2),
            "noise": reference["noise"][:, : config.gamma],
            "temperature": np.full(2, temperature, np.float32),
        }
        | {
            f"past_{kind}_{layer}": np.zeros(shape, np.float32)
            for kind in ("key", "value")
            for layer in range(config.num_layers)
        }
        | (
            {
                "context_ids": np.concatenate([reference[f"context_ids_{r}"] for r in range(2)]).astype(np.int64),
                "context_last": np.cumsum([len(c) for c in contexts]) - 1,
            }
            if config.drafter_type == "eagle3"
            else {}
        )
    )
