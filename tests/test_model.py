"""The torch target against transformers' own Qwen3, Qwen2 and Llama classes, the cached decode, sharded loading."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dspark_export.checkpoint import Checkpoint  # noqa: E402
from dspark_export.config import DecoderConfig  # noqa: E402
from dspark_export.model import DecoderModel, save_checkpoint  # noqa: E402
from tests.conftest import write_hf_checkpoint  # noqa: E402


def load(folder, dtype="float32") -> DecoderModel:
    return DecoderModel.from_checkpoint(Checkpoint(folder, DecoderConfig.from_dir(folder)), dtype)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 5e5}
CASES = {
    "untied-gqa4-theta1e6": dict(tie_word_embeddings=False, num_key_value_heads=1, rope_theta=1e6),
    "tied-gqa1-theta1e4": dict(tie_word_embeddings=True, num_key_value_heads=4, rope_theta=1e4),
    "tied-gqa2-linear-rope": dict(
        tie_word_embeddings=True,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
    ),
    "qwen2.5-biases": dict(architecture="qwen2", tie_word_embeddings=True, num_key_value_heads=2, rope_theta=1e6),
    # with these numbers each rotary frequency of a 16-wide head is kept, blended or scaled (wavelengths 6 to 1e5)
    "llama3-rope": dict(architecture="llama", tie_word_embeddings=False, num_key_value_heads=2, rms_norm_eps=1e-5,
                        rope_parameters=LLAMA3_ROPE),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_and_hidden_states_match_transformers(tmp_path, case):
    folder = write_hf_checkpoint(tmp_path / case, seed=len(case), **CASES[case])
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load(folder)
    ids = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids, output_hidden_states=True)
        got = ours(ids, feature_layers=(0, 1))
    assert (got.logits - expected.logits).abs().max() <= 1e-4
    # hidden_states[l + 1] is the output of decoder layer l
    for layer in (0, 1):
        assert (got.features[layer] - expected.hidden_states[layer + 1]).abs().max() <= 1e-4


def test_cached_incremental_decode_equals_full_forward(tiny_checkpoint):
    model = load(tiny_checkpoint)
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        model.setup_caches(batch=2, max_len=32)
        steps = [model(ids[:, :8], torch.arange(8).expand(2, 8), use_cache=True).logits]  # prefill chunk
        for start, end in [(8, 9), (9, 13), (13, 20)]:  # one token, then multi-token verification chunks
            positions = torch.arange(start, end).expand(2, end - start)
            steps.append(model(ids[:, start:end], positions, use_cache=True).logits)
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-5


def test_sharded_checkpoint_loads_identically(tmp_path):
    single = write_hf_checkpoint(tmp_path / "single", seed=3)
    sharded = write_hf_checkpoint(tmp_path / "sharded", seed=3, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    a, b = load(single).state_dict(), load(sharded).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_a_streamed_target_computes_exactly_what_the_resident_one_does_and_holds_no_layer(tmp_path, weights):
    from dspark_export.demo.tokenizer import train_tokenizer
    from dspark_export.loading import load_target
    from dspark_export.presets import resolve_target
    from tests.conftest import TEXT

    folder = write_hf_checkpoint(tmp_path / "target", tie_word_embeddings=False, vocab_size=300)
    train_tokenizer(TEXT, folder, vocab_size=300)
    spec = resolve_target(None, folder)
    resident, streamed = (load_target(spec, weights=weights, streamed=s)[0] for s in (False, True))
    headless = load_target(spec, weights=weights, streamed=True, stream_head=True)[0]
    ids = torch.randint(0, 300, (2, 11))
    with torch.no_grad():
        a, b, c = (model(ids, feature_layers=(0, 1, 2)) for model in (resident, streamed, headless))
    for other in (b, c):
        assert torch.equal(a.logits, other.logits)
        assert all(torch.equal(a.features[k], other.features[k]) for k in a.features)
    assert all(p.is_meta for p in streamed.layers.parameters())  # dropped again after the pass
    held = sum(p.numel() for p in streamed.parameters() if not p.is_meta)
    assert held == sum(p.numel() for name in ("embed_tokens", "norm", "lm_head")
                       for p in getattr(resident, name).parameters())
    assert headless.lm_head.weight.is_meta and not headless.embed_tokens.weight.is_meta


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_checkpoints_round_trip(tmp_path, tiny_checkpoint, dtype):
    model = load(tiny_checkpoint)
    save_checkpoint(model, tmp_path / dtype, dtype=dtype, max_shard_bytes=30_000)
    reloaded = load(tmp_path / dtype, dtype)
    assert reloaded.embed_tokens.weight.dtype == getattr(torch, dtype)
    expected = model.embed_tokens.weight.to(getattr(torch, dtype))
    assert torch.equal(reloaded.embed_tokens.weight, expected)
    ids = torch.arange(10)[None]
    with torch.no_grad():
        diff = (reloaded.float()(ids).logits - model(ids).logits).abs().max()
    assert diff < 0.1  # storage rounding only


def test_our_checkpoint_loads_in_transformers(tmp_path, tiny_checkpoint):
    model = load(tiny_checkpoint)
    save_checkpoint(model, tmp_path / "ours", dtype="float32")
    reference = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    ids = torch.arange(12)[None]
    with torch.no_grad():
        assert (reference(ids).logits - model(ids).logits).abs().max() <= 1e-5
