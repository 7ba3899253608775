"""`dspark-export train` and `eval` end to end on a tiny random target with its own tokenizer."""

from __future__ import annotations

import json

import pytest
import numpy as np
from click.testing import CliRunner

torch = pytest.importorskip("torch")

from dspark_export.cli import main  # noqa: E402
from dspark_export.demo.tokenizer import train_tokenizer  # noqa: E402
from tests.conftest import write_hf_checkpoint, write_sequences  # noqa: E402


@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_train_takes_each_sequential_head(tmp_path, tiny_target, head):
    write_sequences(tmp_path / "data.npz")
    trained = CliRunner().invoke(main, ["train", "--target-path", str(tiny_target), "--head", head, "--gamma", "3",
                                        "--data", str(tmp_path / "data.npz"), "--out", str(tmp_path / "d"),
                                        "--steps", "2", "--batch", "2", "--anchors", "2"])
    assert trained.exit_code == 0, trained.output
    assert json.loads((tmp_path / "d" / "config.json").read_text())["head"] == head


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


def test_train_from_a_drafter_on_the_features_of_fp32_and_int4_targets(tmp_path, tiny_target):
    write_sequences(tmp_path / "data.npz")
    runner = CliRunner()
    common = ["train", "--target-path", str(tiny_target), "--data", str(tmp_path / "data.npz"), "--batch", "2",
              "--anchors", "2", "--steps", "2"]
    first = runner.invoke(main, common + ["--out", str(tmp_path / "first"), "--gamma", "3", "--markov-rank", "8"])
    assert first.exit_code == 0, first.output
    again = runner.invoke(main, common + ["--out", str(tmp_path / "again"), "--init", str(tmp_path / "first"),
                                          "--target-weights", "fp32,int4", "--markov-rank", "16"])
    assert again.exit_code == 0, again.output
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["markov_rank"] == 8 and config["gamma"] == 3  # the architecture is the starting drafter's
    assert config["extra"]["distilled_from"] == "fp32,int4"
    counts = json.loads((tmp_path / "again" / "token_counts.json").read_text())
    assert len(counts["counts"]) == 300 and sum(counts["counts"]) == 12 * 18
    bad = runner.invoke(main, common + ["--out", str(tmp_path / "bad"), "--target-weights", "int4,int4"])
    assert bad.exit_code != 0 and "each at most once" in bad.output


def test_a_quantized_torch_target_computes_what_the_int4_engine_does(tmp_path, tiny_target):
    """int4 weights as the graph stores them, float compute (accuracy level 0): the same logits as the engine."""
    from dspark_export.build import build_engine
    from dspark_export.graphs.weights import WeightFormat
    from dspark_export.loading import load_target
    from dspark_export.presets import resolve_target
    from dspark_runtime.backend import OrtBackend
    from dspark_runtime.batches import TargetBatch
    from dspark_common.engine_dir import read_manifest

    spec = resolve_target(None, str(tiny_target))
    engine = build_engine(spec, tmp_path / "engine", weights=WeightFormat("int4", accuracy_level=0), cache_slots=1,
                          show_progress=False)
    target, _ = OrtBackend(threads=1).open(engine, read_manifest(engine))
    ids = np.arange(10, 40)
    batch = TargetBatch(ids, np.arange(len(ids)), np.zeros(len(ids), np.int64), np.zeros(1, np.int64),
                        np.arange(len(ids)))
    logits = target.run(batch)["logits"]
    for weights, close in (("int4", True), ("fp32", False)):
        model, _ = load_target(spec, weights=weights)
        with torch.no_grad():
            expected = model(torch.from_numpy(ids)[None]).logits[0].numpy()
        assert (np.abs(expected - logits).max() < 1e-4) == close


def test_a_torch_only_command_without_torch_names_the_extra():
    import subprocess
    import sys

    blocked = "import sys; sys.modules['torch'] = None; from dspark_export.cli import main; main()"
    result = subprocess.run([sys.executable, "-c", blocked, "eval", "--drafter", "demo-dspark"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: this command needs torch: pip install 'dspark[export]' (torch==2.13.0 first: a bare `torch` is a "
        "multi-GB CUDA build)")


def test_training_beside_a_streamed_target_learns_exactly_what_it_learns_beside_a_resident_one(tmp_path, monkeypatch):
    """What large targets get (layers and an untied LM head read from the checkpoint as they run, the compact
    optimizer), forced on a tiny one: the same drafter as with the target in memory."""
    from safetensors.numpy import load_file

    from dspark_export.drafters import recipe, train
    from tests.conftest import TEXT

    target = write_hf_checkpoint(tmp_path / "target", tie_word_embeddings=False, vocab_size=300)
    train_tokenizer(TEXT, target, vocab_size=300)
    write_sequences(tmp_path / "data.npz")
    monkeypatch.setattr(train, "COMPACT_OPTIMIZER_PARAMS", 0)
    drafters = []
    for limit in (1 << 40, 0):  # resident, then streamed
        monkeypatch.setattr(recipe, "STREAMED_TARGET_BYTES", limit)
        out = tmp_path / f"drafter-{limit}"
        torch.manual_seed(0)  # the new drafter's initial weights
        result = CliRunner().invoke(main, ["train", "--target-path", str(target), "--data", str(tmp_path / "data.npz"),
                                           "--out", str(out), "--steps", "2", "--batch", "2", "--anchors", "2",
                                           "--gamma", "2", "--draft-vocab", "50"])
        assert result.exit_code == 0, result.output
        drafters.append(load_file(out / "model.safetensors"))
    assert drafters[0].keys() == drafters[1].keys()
    assert all(np.array_equal(drafters[0][name], drafters[1][name]) for name in drafters[0])
