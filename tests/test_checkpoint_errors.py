"""Bad checkpoints and bad names fail with one clear message, in the library and on the command line."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from dspark_export.checkpoint import Checkpoint
from dspark_export.cli import main
from dspark_export.config import DecoderConfig
from dspark_export.presets import resolve_target
from dspark_common.errors import CheckpointError, ConfigError
from tests.conftest import write_hf_checkpoint


def open_checkpoint(folder):
    return Checkpoint(folder, DecoderConfig.from_dir(folder))


def run_cli(*args, env=None):
    result = CliRunner().invoke(main, list(args), env=env)
    return result.exit_code, result.output


def assert_one_line_error(code: int, output: str, *fragments: str) -> None:
    assert code != 0
    assert "Traceback" not in output
    for fragment in fragments:
        assert fragment in output


def test_missing_directory_lists_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    spec = resolve_target("qwen3-8b")
    with pytest.raises(CheckpointError, match="looked in") as info:
        spec.require_path()
    assert str(tmp_path / "hf" / "hub" / "models--Qwen--Qwen3-8B") in str(info.value)
    code, output = run_cli("inspect", "--target-path", str(tmp_path / "nowhere"))
    assert_one_line_error(code, output, "does not exist", str(tmp_path / "nowhere"))


def test_preset_found_in_hf_cache_and_checked_against_preset(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc123"
    write_hf_checkpoint(snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(
        ConfigError, match="does not match --target qwen3-0.6b.*hidden_size: preset 1024, checkpoint 64"
    ):
        resolve_target("qwen3-0.6b")


def test_missing_shard(tmp_path):
    folder = write_hf_checkpoint(tmp_path / "sharded", max_shard_size="40KB")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard.name} .* is missing"):
        open_checkpoint(folder)


def test_wrong_shape_names_the_tensor(tmp_path):
    folder = write_hf_checkpoint(tmp_path / "tiny")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 100
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=r"tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape \[128, 64\], expected \[100, 64\]",
    ):
        open_checkpoint(folder)


@pytest.mark.parametrize("damage", ["truncate", "garbage-header", "empty"])
def test_corrupt_safetensors(tmp_path, damage):
    folder = write_hf_checkpoint(tmp_path / "tiny")
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(
        {"truncate": data[: len(data) // 2], "garbage-header": data[:8] + b"{not json" + data[17:], "empty": b""}[
            damage
        ]
    )
    with pytest.raises(CheckpointError, match="corrupt|truncated|not a safetensors"):
        open_checkpoint(folder)
    code, output = run_cli("inspect", "--target-path", str(folder))
    assert_one_line_error(code, output, "model.safetensors")


def test_missing_weights_file(tmp_path):
    folder = write_hf_checkpoint(tmp_path / "tiny")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        open_checkpoint(folder)


def test_unknown_preset_lists_known_ones(tmp_path):
    with pytest.raises(ConfigError, match="unknown target 'qwen9'.*qwen3-8b.*demo"):
        resolve_target("qwen9")
    code, output = run_cli("inspect", "--target", "qwen9")
    assert_one_line_error(code, output, "qwen3-0.6b", "qwen3-14b", "demo")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "mistral"}, "unsupported architecture: model_type 'mistral'"),
        ({"model_type": "llama", "attention_bias": True}, "unsupported Llama variant: attention_bias"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
            "rope scaling 'yarn' is not supported",
        ),
        ({"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_unsupported_architecture(tmp_path, change, message):
    folder = write_hf_checkpoint(tmp_path / "tiny")
    config = json.loads((folder / "config.json").read_text()) | change
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        DecoderConfig.from_dir(folder)
    code, output = run_cli("inspect", "--target-path", str(folder))
    assert_one_line_error(code, output, message.split(":")[0])


def test_inspect_reports_a_real_checkpoint(tmp_path):
    folder = write_hf_checkpoint(tmp_path / "tiny", tie_word_embeddings=True)
    code, output = run_cli(
        "inspect", "--target-path", str(folder), "--cache-slots", "2", "--max-context", "100", "--json"
    )
    assert code == 0, output
    report = json.loads(output)
    config = DecoderConfig.from_dir(folder)
    from dspark_export.model import DecoderModel

    assert report["parameters"] == sum(p.numel() for p in DecoderModel(config).parameters())
    assert report["dtype"] == "float32"
    # 2 (K and V) x 3 layers x 1 KV head x 16 dims x (100 tokens + 1 row for a step) x 2 slots x 4 bytes (float32)
    assert report["memory"]["kv_cache_bytes"] == 2 * 3 * 1 * 16 * 101 * 2 * 4


def test_qwen3_8b_preset_numbers():
    code, output = run_cli("inspect", "--target", "qwen3-8b", "--cache-slots", "1", "--max-context", "4096", "--dtype",
                           "bfloat16", "--json")
    report = json.loads(output)
    assert round(report["parameters"] / 1e9, 2) == 8.19  # Qwen3-8B: 8.2B parameters
    assert report["memory"]["kv_cache_bytes"] == 36 * 8 * 128 * 2 * 2 * 4097


def test_copied_checkpoint_with_name_and_path_must_agree(tmp_path):
    folder = write_hf_checkpoint(tmp_path / "tiny")
    shutil.copytree(folder, tmp_path / "copy")
    with pytest.raises(ConfigError, match="does not match --target qwen3-4b"):
        resolve_target("qwen3-4b", tmp_path / "copy")
