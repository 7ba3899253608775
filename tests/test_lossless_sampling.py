"""Sampling through the engine is lossless: the joint distribution of the first two generated tokens under
speculative decoding matches the target's exact distribution (chi-square), and a deliberately wrong
verifier (resampling from p instead of the residual on rejection) fails the same test. The target is the
engine's own target graph run alone (float32 weights, and block-quantized int4 ones: the quantized model is
the target)."""

from __future__ import annotations

import shutil

import pytest

import dspark_common.lossless as lossless
from dspark_common.lossless import sample
from dspark_runtime import Engine, OrtBackend, SamplingParams

torch = pytest.importorskip("torch")
pytest.importorskip("scipy.stats")

from tests.conftest import SAMPLES, build_echo_engine, exact_joint, p_value, sample_pairs, write_curve  # noqa: E402

# three tokens, so that the second is produced by verifying a draft (a last token needs no draft)
SETTINGS = {"T1": SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True),
            "T1-topp0.9": SamplingParams(max_tokens=3, temperature=1.0, top_p=0.9, ignore_eos=True),
            "T1-topk20": SamplingParams(max_tokens=3, temperature=1.0, top_k=20, ignore_eos=True)}


def no_residual(target_probs, draft_probs, draft_tokens, uniform):
    """A wrong verifier: on a rejection it samples from p itself instead of the residual."""
    for k, token in enumerate(draft_tokens):
        if uniform(k, 0) * draft_probs[k, token] >= target_probs[k, token]:
            return k, sample(target_probs[k], uniform(k, 1))
    return len(draft_tokens), sample(target_probs[len(draft_tokens)], uniform(len(draft_tokens), 1))


@pytest.fixture(scope="module", params=["fp32", "int4", "w8a8", "w4a8", "fp32-draft-vocab-220"])
def skewed_engine_dir(tmp_path_factory, request):
    """The echo engine with a random Markov bias: drafts agree with the target often, but q differs from p; the
    third drafts over 220 of the 300 tokens only (chosen by random frequencies), so q is 0 on tokens p can take."""
    weights, _, vocab = request.param.partition("-draft-vocab-")
    return build_echo_engine(tmp_path_factory.mktemp(f"skewed-{request.param}"), markov_scale=0.3, embedding_scale=5.0,
                             weights=weights, draft_vocab=int(vocab) if vocab else None)


@pytest.mark.parametrize("setting", SETTINGS)
def test_spec_sampling_matches_the_target_and_a_wrong_verifier_fails(skewed_engine_dir, monkeypatch, setting):
    params = SETTINGS[setting]
    with Engine.load(skewed_engine_dir, OrtBackend(threads=1)) as engine:
        prompt = engine.tokenizer.encode("Hello there")
        joint = exact_joint(skewed_engine_dir, prompt, params)
        assert p_value(sample_pairs(engine, prompt, params, "fixed:3"), joint) > 1e-3

        monkeypatch.setattr(lossless, "verify_sampled", no_residual)
        assert p_value(sample_pairs(engine, prompt, params, "fixed:3"), joint) < 1e-6


@pytest.mark.parametrize("spec", ["sync", "async"])
def test_scheduled_sampling_matches_the_target(skewed_engine_dir, tmp_path, spec):
    """`sync` and `async` on a curve that is flat up to 12 tokens and steep after: with eight requests
    decoding in lockstep, only the four most confident drafts fit, so some requests verify a draft and others not."""
    folder = tmp_path / "engine"
    shutil.copytree(skewed_engine_dir, folder)
    write_curve(folder, [0.001] * 12 + [0.001 * (1.5 + 0.5 * b) for b in range(244)], [0.0001] * 8)
    params = SETTINGS["T1"]
    with Engine.load(folder, OrtBackend(threads=1)) as engine:
        prompt = engine.tokenizer.encode("Hello there")
        rounds: list[int] = []
        assert (
            p_value(sample_pairs(engine, prompt, params, spec, rounds), exact_joint(skewed_engine_dir, prompt, params))
            > 1e-3
        )
    verified = sum(r > 0 for r in rounds)
    assert 0.05 * SAMPLES < verified < 0.95 * SAMPLES, verified


def test_free_drafts_sample_the_target_and_unchecked_drafts_fail(skewed_engine_dir, tmp_path, monkeypatch,
                                                                  curve_as_written):
    """A drafter too costly to ever run leaves `async` with free drafts alone (the curve as written). The prompt ends with a token x its
    target tends to repeat; after a first x, the lookup finds [x x] earlier and proposes the token that followed it
    there, which the target rarely takes: verifying it must reject as often as p says (the point-mass rule of
    `test_verify` covers the residual), and a verifier that keeps free drafts unchecked fails."""
    folder = tmp_path / "engine"
    shutil.copytree(skewed_engine_dir, folder)
    write_curve(folder, [0.001] * 256, [1.0] * 8)
    params = SETTINGS["T1"]
    with Engine.load(folder, OrtBackend(threads=1)) as engine:
        head = engine.tokenizer.encode("Hello there")
        prompt = head + head[-1:] + head[:2] + head[-1:]  # ... x | x y c x: after a first x, [x x] proposes y
        joint = exact_joint(skewed_engine_dir, prompt, params)
        assert p_value(sample_pairs(engine, prompt, params, "async"), joint) > 1e-3
        assert engine.gate_steps()["free"] > 0.1 * SAMPLES and engine.gate_steps()["draft"] == 0

        def unchecked(target_probs, draft_probs, draft_tokens, uniform):
            return len(draft_tokens), sample(target_probs[len(draft_tokens)], uniform(len(draft_tokens), 1))

        monkeypatch.setattr(lossless, "verify_sampled", unchecked)
        assert p_value(sample_pairs(engine, prompt, params, "async"), joint) < 1e-6
