"""A draft vocabulary chosen at build, train or eval: the N most frequent tokens of a named source, `d2t` in the
engine, greedy output unchanged, and bad input refused with one line before anything is written."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")

from dspark_export.cli import main  # noqa: E402
from dspark_export.drafters.draft_vocab import DraftVocab, most_frequent  # noqa: E402
from dspark_common.errors import ConfigError  # noqa: E402
from dspark_runtime import Engine, OrtBackend, SamplingParams  # noqa: E402
from tests.fakes import RecordingDrafter  # noqa: E402
from tests.conftest import write_drafter, write_sequences  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["def add(", "The answer", "Hello"]


def test_the_most_frequent_tokens_win_and_ties_go_to_the_lower_id():
    assert most_frequent(np.array([5, 0, 9, 5, 1]), 3).tolist() == [0, 2, 3]


def test_counts_come_from_distillation_files_or_a_counts_file(tmp_path):
    write_sequences(tmp_path / "data.npz")
    ids, origin = DraftVocab(20, (tmp_path / "data.npz",)).choose(300, 300)
    assert len(ids) == 20 and "data.npz (216 generated tokens)" in origin  # 12 sequences x 18 generated tokens
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps({"counts": list(range(300))}))
    assert DraftVocab(3, (counts,)).choose(300, 300)[0].tolist() == [297, 298, 299]
    assert DraftVocab(None, (counts,)).choose(300, 300)[0].tolist() == list(range(150, 300))  # counts alone: half
    with pytest.raises(ConfigError, match="needs 300 non-negative counts"):
        counts.write_text(json.dumps([1, 2, 3]))
        DraftVocab(3, (counts,)).choose(300, 300)
    with pytest.raises(ConfigError, match="must lie in 1..300"):
        DraftVocab(301, (counts,)).choose(300, 300)


def build(runner, target, drafter, out, *options):
    return runner.invoke(main, ["build", "--target-path", str(target), "--drafter", str(drafter), "--out", str(out),
                                "--cache-slots", "2", *options])


def test_build_prunes_any_drafter_and_greedy_output_is_unchanged(tmp_path, tiny_target):
    write_sequences(tmp_path / "data.npz")
    drafter = write_drafter(tiny_target, tmp_path / "drafter", gamma=3)
    runner = CliRunner()
    result = build(runner, tiny_target, drafter, tmp_path / "engine", "--draft-vocab", "40", "--draft-vocab-counts",
                   str(tmp_path / "data.npz"))
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "engine" / "manifest.json").read_text())
    assert manifest["drafter"]["draft_vocab_size"] == 40 and manifest["drafter"]["own_lm_head"]
    assert manifest["drafter"]["extra"]["draft_vocab_source"] == "data.npz (216 generated tokens)"
    allowed = DraftVocab(40, (tmp_path / "data.npz",)).choose(300, 300)[0]
    backend = RecordingDrafter(OrtBackend(threads=1))
    with Engine.load(tmp_path / "engine", backend, profile=False) as engine:
        for prompt in PROMPTS[:3]:
            plain = engine.generate(prompt, GREEDY, spec="off").token_ids
            assert engine.generate(prompt, GREEDY, spec="fixed:3").token_ids == plain
        for seed in range(4):
            engine.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=1.0, seed=seed), spec="fixed:3")
    drafted = backend.drafter.outputs
    tokens = np.concatenate([out["draft_tokens"].ravel() for out in drafted])
    probs = np.concatenate([out["draft_probs"] for out in drafted if out["draft_probs"].shape[-1]])
    outside = np.setdiff1d(np.arange(300), allowed)
    assert np.isin(tokens, allowed).all() and len(probs) and not probs[..., outside].any()


def test_bad_draft_vocabularies_are_refused_with_one_line_and_nothing_written(tmp_path, tiny_target):
    write_sequences(tmp_path / "data.npz")
    drafter = write_drafter(tiny_target, tmp_path / "drafter", gamma=3)
    runner = CliRunner()
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps({"counts": [1] * 120}))
    other_tokens = tmp_path / "other.npz"
    np.savez(other_tokens, tokens=np.full(40, 5000, np.uint16), starts=np.array([0]), lengths=np.array([40], np.int32),
             prompt_lengths=np.array([4], np.int32))
    cases = [
        (["--draft-vocab", "301", "--draft-vocab-counts", str(tmp_path / "data.npz")], "must lie in 1..300"),
        (["--draft-vocab", "0", "--draft-vocab-counts", str(tmp_path / "data.npz")], "0 is not in the range x>=1"),
        (["--draft-vocab", "40"], "needs a frequency source"),
        (["--draft-vocab", "40", "--draft-vocab-counts", str(counts)], "has 120 counts"),
        (["--draft-vocab", "40", "--draft-vocab-counts", str(other_tokens)], "made for another tokenizer"),
    ]
    for options, message in cases:
        result = build(runner, tiny_target, drafter, tmp_path / "engine", *options)
        assert result.exit_code != 0 and message in result.output, (options, result.output)
        errors = [line for line in result.output.splitlines() if line.startswith("Error")]
        assert len(errors) == 1 and not (tmp_path / "engine").exists()
    pruned = tmp_path / "pruned"
    trained = runner.invoke(main, ["train", "--target-path", str(tiny_target), "--data", str(tmp_path / "data.npz"),
                                   "--out", str(pruned), "--steps", "1", "--batch", "2", "--anchors", "1", "--gamma",
                                   "2", "--draft-vocab", "50"])
    assert trained.exit_code == 0, trained.output
    assert json.loads((pruned / "config.json").read_text())["draft_vocab_size"] == 50
    again = build(runner, tiny_target, pruned, tmp_path / "engine", "--draft-vocab", "40", "--draft-vocab-counts",
                  str(tmp_path / "data.npz"))
    assert again.exit_code != 0 and "already drafts over 50 tokens" in again.output
    assert not (tmp_path / "engine").exists()
