"""Sampling through the engine is lossless: the joint distribution of the first two generated tokens under
speculative decoding matches the target's exact distribution (chi-square), and a deliberately wrong
verifier (resampling from p instead of the residual on rejection) fails the same test. The target is the
engine's own target graph run alone (float32 weights, and block-quantized int4 ones: the quantized model is
the target)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from dspark_runtime import Engine, SamplingParams
from dspark_runtime.backend import open_graphs
from dspark_runtime.batches import TargetBatch
from dspark_runtime.engine_dir import read_manifest
from dspark_runtime.sampling import target_rows

torch = pytest.importorskip("torch")
scipy_stats = pytest.importorskip("scipy.stats")

from tests.conftest import build_echo_engine  # noqa: E402

SAMPLES = 3000
# three tokens, so that the second is produced by verifying a draft (a last token needs no draft)
SETTINGS = {"T1": SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True),
            "T1-topp0.9": SamplingParams(max_tokens=3, temperature=1.0, top_p=0.9, ignore_eos=True),
            "T1-topk20": SamplingParams(max_tokens=3, temperature=1.0, top_k=20, ignore_eos=True)}


@pytest.fixture(scope="module", params=["fp32", "int4"])
def skewed_engine_dir(tmp_path_factory, request):
    """The echo engine with a random Markov bias: drafts agree with the target often, but q differs from p."""
    return build_echo_engine(tmp_path_factory.mktemp(f"skewed-{request.param}"), markov_scale=0.3, embedding_scale=5.0,
                             weights=request.param)


def exact_joint(engine_dir, prompt_ids, params) -> dict[tuple[int, int], float]:
    """The target graph's own distribution of the first two tokens: a prefill of the prompt, then of each
    continuation the first token can take."""
    target, _ = open_graphs(engine_dir, read_manifest(engine_dir), "ort", threads=1)
    slots = read_manifest(engine_dir).cache_slots

    def last_logits(ids: list[int]) -> np.ndarray:
        batch = TargetBatch(
            np.asarray(ids),
            np.arange(len(ids)),
            np.zeros(len(ids), np.int64),
            np.zeros(slots, np.int64),
            np.asarray([len(ids) - 1]),
        )
        return target.run(batch.feeds(target.io))["logits"]

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
            rounds.append(result.stats["rounds"])
    return counts


def p_value(counts, joint) -> float:
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
    return scipy_stats.chisquare(observed, expected).pvalue


@pytest.mark.parametrize("setting", SETTINGS)
def test_spec_sampling_matches_the_target_and_a_wrong_verifier_fails(skewed_engine_dir, monkeypatch, setting):
    params = SETTINGS[setting]
    with Engine.load(skewed_engine_dir, threads=1) as engine:
        prompt = engine.tokenizer.encode("Hello there")
        joint = exact_joint(skewed_engine_dir, prompt, params)
        assert p_value(sample_pairs(engine, prompt, params, "fixed:3"), joint) > 1e-3

        import dspark_runtime.core as core
        from dspark_runtime.verify import sample

        def no_residual(target_probs, draft_probs, draft_tokens, uniform):
            for k, token in enumerate(draft_tokens):
                if uniform(k, 0) * draft_probs[k, token] >= target_probs[k, token]:
                    return k, sample(target_probs[k], uniform(k, 1))  # wrong: should be the residual
            return len(draft_tokens), sample(target_probs[len(draft_tokens)], uniform(len(draft_tokens), 1))

        monkeypatch.setattr(core, "verify_sampled", no_residual)
        assert p_value(sample_pairs(engine, prompt, params, "fixed:3"), joint) < 1e-6


@pytest.mark.parametrize("spec", ["sync", "async"])
def test_scheduled_sampling_matches_the_target(skewed_engine_dir, tmp_path, spec):
    """`sync` and `async` on a curve that is flat up to 12 tokens and steep after: with eight requests
    decoding in lockstep, only the four most confident drafts fit, so some requests verify a draft and others not."""
    folder = tmp_path / "engine"
    shutil.copytree(skewed_engine_dir, folder)
    curve = {
        "target_seconds": [0.001] * 12 + [0.001 * (1.5 + 0.5 * b) for b in range(244)],
        "draft_seconds": [0.0001] * 8,
    }
    (folder / "hardware_curve.json").write_text(json.dumps(curve))
    params = SETTINGS["T1"]
    with Engine.load(folder, threads=1) as engine:
        prompt = engine.tokenizer.encode("Hello there")
        rounds: list[int] = []
        assert (
            p_value(sample_pairs(engine, prompt, params, spec, rounds), exact_joint(skewed_engine_dir, prompt, params))
            > 1e-3
        )
    verified = sum(r > 0 for r in rounds)
    assert 0.05 * SAMPLES < verified < 0.95 * SAMPLES, verified
