"""`dspark-export train` and `eval` end to end on a tiny random target with its own tokenizer."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")

from dspark_export.cli import main  # noqa: E402
from dspark_export.demo.tokenizer import train_tokenizer  # noqa: E402
from tests.conftest import write_hf_checkpoint, write_sequences  # noqa: E402


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_train_then_eval(tmp_path, tiny_target, kind):
    write_sequences(tmp_path / "data.npz")
    runner = CliRunner()
    trained = runner.invoke(main, ["train", "--target-path", str(tiny_target), "--drafter-type", kind, "--gamma", "3",
                                   "--data", str(tmp_path / "data.npz"), "--out", str(tmp_path / kind), "--steps", "3",
                                   "--batch", "2", "--anchors", "2"])
    assert trained.exit_code == 0, trained.output
    config = json.loads((tmp_path / kind / "config.json").read_text())
    assert config["drafter_type"] == kind and config["feature_layers"] == [1]  # L // 2 for one drafter layer of three
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"domain": d, "prompt": p}) + "\n" for d, p in [("code", "def add("), ("chat", "Hello")])
    )
    result = runner.invoke(main, ["eval", "--target-path", str(tiny_target), "--drafter", str(tmp_path / kind),
                                  "--prompts", str(prompts), "--max-new", "6", "--temperature", "1", "--json",
                                  "--plot", str(tmp_path / "curves.png")])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert set(report["per_domain"]) == {"code", "chat"}
    assert 1 <= report["tau"] <= 4 and len(report["per_position_acceptance"]) == 3
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_eval_refuses_a_drafter_of_another_target(tmp_path, tiny_target):
    write_sequences(tmp_path / "data.npz")
    runner = CliRunner()
    runner.invoke(
        main,
        [
            "train",
            "--target-path",
            str(tiny_target),
            "--data",
            str(tmp_path / "data.npz"),
            "--out",
            str(tmp_path / "d"),
            "--steps",
            "1",
            "--batch",
            "2",
            "--anchors",
            "1",
            "--gamma",
            "2",
        ],
    )
    other = write_hf_checkpoint(tmp_path / "other", hidden_size=32, num_attention_heads=2, vocab_size=300)
    train_tokenizer(["something else entirely"] * 30, other, vocab_size=300)
    result = runner.invoke(main, ["eval", "--target-path", str(other), "--drafter", str(tmp_path / "d")])
    assert result.exit_code != 0 and "hidden_size=64, but this target has hidden_size=32" in result.output
    not_prompts = runner.invoke(main, ["eval", "--target-path", str(tiny_target), "--drafter", str(tmp_path / "d"),
                                       "--prompts", str(tmp_path / "data.npz")])
    assert not_prompts.exit_code != 0 and "cannot read prompts" in not_prompts.output
    small = write_hf_checkpoint(tmp_path / "small-vocab", vocab_size=100)
    train_tokenizer(["text"] * 30, small, vocab_size=300)
    mismatch = runner.invoke(main, ["eval", "--target-path", str(small), "--drafter", str(tmp_path / "d")])
    assert mismatch.exit_code != 0 and "tokens but the model only 100" in mismatch.output
    missing = runner.invoke(main, ["eval", "--target-path", str(tiny_target), "--drafter", "demo-nothing"])
    assert missing.exit_code != 0 and "no bundled drafter 'demo-nothing'" in missing.output
