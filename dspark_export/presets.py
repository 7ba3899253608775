"""Named targets (`--target qwen3-8b`) and where their weights are found on this machine.

Nothing is ever downloaded: weights come from `--target-path`, the bundled demo, or a Hugging Face
cache that is already on disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dspark_export.config import DecoderConfig
from dspark_export.checkpoint import Checkpoint
from dspark_export.gguf_target import GGUF_FILE, GGUFCheckpoint, is_gguf, natural_weights, prepare
from dspark_export.model_stores import cached_snapshots, find_gguf, hf_cache_roots, is_store_reference, store_label
from dspark_common.errors import CheckpointError, ConfigError


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tied: bool) -> DecoderConfig:
    """The published Qwen3 dense models share vocabulary, head size, KV heads, norms and RoPE."""
    return DecoderConfig(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8, head_dim=128,
                         rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=tied,
                         max_position_embeddings=40960, dtype="bfloat16")


def _qwen2_5(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, tied: bool,
             vocab: int = 151936) -> DecoderConfig:
    """Qwen2.5 (q/k/v biases, no q/k norms): head size hidden / heads, 32k positions in the instruct configs."""
    return DecoderConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=hidden // heads, rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=tied,
                         max_position_embeddings=32768, dtype="bfloat16", model_type="qwen2")


def _llama3(hidden: int, intermediate: int, layers: int, heads: int, head_dim: int, tied: bool,
            rope_factor: float) -> DecoderConfig:
    """Llama-3.1 / 3.2: 128k vocabulary, 8 KV heads, `llama3` rotary scaling of an 8k original context."""
    return DecoderConfig(vocab_size=128256, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
                         head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=500_000.0, rope_type="llama3",
                         rope_factor=rope_factor, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                         rope_original_max_position=8192, tie_word_embeddings=tied, max_position_embeddings=131072,
                         dtype="bfloat16", model_type="llama")


# Architecture numbers from each model's published config.json; the key is the Hugging Face repo id.
PRESETS: dict[str, tuple[str, DecoderConfig]] = {
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B", _qwen3(1024, 3072, 28, 16, tied=True)),
    "qwen3-1.7b": ("Qwen/Qwen3-1.7B", _qwen3(2048, 6144, 28, 16, tied=True)),
    "qwen3-4b": ("Qwen/Qwen3-4B", _qwen3(2560, 9728, 36, 32, tied=True)),
    "qwen3-8b": ("Qwen/Qwen3-8B", _qwen3(4096, 12288, 36, 32, tied=False)),
    "qwen3-14b": ("Qwen/Qwen3-14B", _qwen3(5120, 17408, 40, 40, tied=False)),
    "qwen2.5-0.5b": ("Qwen/Qwen2.5-0.5B-Instruct", _qwen2_5(896, 4864, 24, 14, 2, tied=True)),
    "qwen2.5-1.5b": ("Qwen/Qwen2.5-1.5B-Instruct", _qwen2_5(1536, 8960, 28, 12, 2, tied=True)),
    "qwen2.5-3b": ("Qwen/Qwen2.5-3B-Instruct", _qwen2_5(2048, 11008, 36, 16, 2, tied=True)),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B-Instruct", _qwen2_5(3584, 18944, 28, 28, 4, tied=False, vocab=152064)),
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B-Instruct", _llama3(2048, 8192, 16, 32, 64, tied=True, rope_factor=32.0)),
    "llama-3.2-3b": ("meta-llama/Llama-3.2-3B-Instruct", _llama3(3072, 8192, 28, 24, 128, tied=True,
                                                                 rope_factor=32.0)),
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B-Instruct", _llama3(4096, 14336, 32, 32, 128, tied=False,
                                                                 rope_factor=8.0)),
}
DEMO = "demo"
KNOWN_TARGETS = (*PRESETS, DEMO)


def demo_dir() -> Path:
    """The bundled demo target, shipped as package data."""
    return Path(str(resources.files("dspark_export") / "assets" / "demo"))


@dataclass(frozen=True)
class TargetSpec:
    """A resolved target: its architecture and, when found, the folder holding its weights."""

    name: str
    config: DecoderConfig
    path: Path | None
    searched: tuple[Path, ...] = ()
    weights: str | None = None  # the engine weight format the target's own quantization maps onto (GGUF files)

    def require_path(self) -> Path:
        """The weights folder, or an error that lists where it looked."""
        if self.path is None:
            places = ", ".join(str(p) for p in self.searched) or "nowhere"
            raise CheckpointError(
                f"no local checkpoint for {self.name} (looked in {places}); "
                "pass --target-path DIR (a Hugging Face model folder): DSpark never downloads weights"
            )
        return self.path

    def checkpoint(self) -> Checkpoint | GGUFCheckpoint:
        """The weights: a safetensors folder's, or a GGUF file's (`gguf_target.prepare`'s side folder)."""
        folder = self.require_path()
        if (folder / GGUF_FILE).exists():
            return GGUFCheckpoint(folder, self.config)
        return Checkpoint(folder, self.config)


def resolve_target(name: str | None = None, path: str | Path | None = None) -> TargetSpec:
    """Resolve `--target NAME` and/or `--target-path DIR|FILE.gguf` to an architecture and a weights folder.

    With a path, the architecture is the checkpoint's own `config.json` (a GGUF file's metadata); with a name too,
    the two must agree.
    """
    if name is None and path is None:
        raise ConfigError("name a target (--target) or a checkpoint folder (--target-path)")
    if name is not None and name not in KNOWN_TARGETS:
        raise ConfigError(f"unknown target {name!r}; known targets: {', '.join(KNOWN_TARGETS)}")
    if path is not None:
        reference = str(path)
        path = find_gguf(reference) if is_store_reference(reference) else Path(path).expanduser()
        if is_gguf(path):  # a GGUF file reads as a model folder made from its metadata
            folder, gguf = prepare(path)
            config = DecoderConfig.from_dir(folder)
            if name is not None:
                _check_against_preset(name, config)
            label = store_label(reference) if is_store_reference(reference) else path.stem
            return TargetSpec(name or label, config, folder, (path,), natural_weights(gguf))
        if not path.is_dir():
            raise CheckpointError(f"checkpoint folder {path} does not exist")
        config = DecoderConfig.from_dir(path)
        if name is not None:
            _check_against_preset(name, config)
        return TargetSpec(name or path.name, config, path, (path,))
    if name == DEMO:
        folder = demo_dir()
        if not (folder / "config.json").is_file():
            raise CheckpointError(f"the bundled demo target is missing from {folder}; reinstall DSpark")
        return TargetSpec(DEMO, DecoderConfig.from_dir(folder), folder, (folder,))
    repo_id, config = PRESETS[name]
    snapshots = cached_snapshots(repo_id)
    searched = tuple(root / ("models--" + repo_id.replace("/", "--")) for root in hf_cache_roots())
    if not snapshots:
        return TargetSpec(name, config, None, searched)
    _check_against_preset(name, DecoderConfig.from_dir(snapshots[0]))
    return TargetSpec(name, config, snapshots[0], searched)


def _check_against_preset(name: str, config: DecoderConfig) -> None:
    if name == DEMO:
        expected = DecoderConfig.from_dir(demo_dir())
    else:
        expected = PRESETS[name][1]
    want, got = expected.architecture_fields(), config.architecture_fields()
    diffs = [f"{key}: preset {want[key]}, checkpoint {got[key]}" for key in want if want[key] != got[key]]
    if diffs:
        raise ConfigError(f"the checkpoint's config.json does not match --target {name} ({'; '.join(diffs)})")
