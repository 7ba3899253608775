"""The demo build's parts on tiny inputs: problem generator, splits, training (resumable), distillation."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest

from dspark_export.demo import mathgen
from dspark_export.demo.corpus import split_of

torch = pytest.importorskip("torch")

from dspark_export.config import DecoderConfig  # noqa: E402
from dspark_export.demo.distill import generate_batch  # noqa: E402
from dspark_export.demo.train import TrainConfig, train  # noqa: E402
from dspark_export.model import DecoderModel  # noqa: E402

TINY = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True)


def test_math_problems_are_deterministic_and_correct():
    first = [mathgen.problem(random.Random(7)) for _ in range(3)]
    assert first == [mathgen.problem(random.Random(7)) for _ in range(3)]
    rng = random.Random(0)
    for _ in range(300):
        question, solution = mathgen.problem(rng)
        answer = int(re.search(r"The answer is (-?\d+)\.$", solution).group(1))
        equation = re.search(r"Solve for x: (\d+)x ([+−]) (\d+) = (-?\d+)\.", question)
        if equation:  # check the algebra itself
            a, sign, b, c = int(equation[1]), equation[2], int(equation[3]), int(equation[4])
            assert a * answer + (b if sign == "+" else -b) == c


def test_splits_follow_the_document_key():
    keys = [f"stdlib/module_{i}.py" for i in range(2000)]
    splits = [split_of(k) for k in keys]
    assert splits == [split_of(k) for k in keys]
    assert 0.9 < splits.count("train") / len(splits) < 0.97 and splits.count("test") > 20


def write_streams(folder, seed=0):
    rng = np.random.default_rng(seed)
    for domain in ("code", "math", "chat"):
        for split in ("train", "val"):
            # a learnable stream: each token is the previous plus one, modulo the vocabulary
            start = rng.integers(0, 64, size=1)
            stream = (start + np.arange(4000)) % 64
            stream.astype(np.uint16).tofile(folder / f"{domain}.{split}.u16")


def test_training_resumes_exactly_where_it_stopped(tmp_path):
    write_streams(tmp_path)
    cfg = TrainConfig(
        steps=6, batch=4, seq_len=32, lr=3e-3, warmup=2, eval_every=6, eval_batches=1, checkpoint_every=100
    )
    straight = train(TINY, tmp_path, tmp_path / "straight", cfg, threads=1)
    train(TINY, tmp_path, tmp_path / "resumed", cfg, threads=1, until=3)  # interrupted after step 3
    resumed = train(TINY, tmp_path, tmp_path / "resumed", cfg, threads=1)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


def test_training_reduces_held_out_loss(tmp_path):
    write_streams(tmp_path)
    cfg = TrainConfig(
        steps=60, batch=4, seq_len=32, lr=3e-3, warmup=5, eval_every=30, eval_batches=2, checkpoint_every=60
    )
    train(TINY, tmp_path, tmp_path / "run", cfg, threads=1)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    evaluations = [record["val"] for record in log if "val" in record]
    assert len(evaluations) == 2
    assert evaluations[-1]["code"] < evaluations[0]["code"] < np.log(64)


def test_greedy_batch_generation_matches_a_plain_loop():
    torch.manual_seed(0)
    model = DecoderModel(TINY).eval()
    prompts = torch.randint(3, 64, (3, 5))
    continuations = generate_batch(model, prompts, max_new=8, greedy=True, generator=torch.Generator())
    for row, continuation in zip(prompts, continuations):
        ids = row.tolist()
        expected = []
        for _ in range(len(continuation)):
            with torch.no_grad():
                token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            expected.append(token)
            ids.append(token)
        assert continuation == expected
