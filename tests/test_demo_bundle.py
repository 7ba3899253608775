"""The bundled demo target and drafters: load through the preset, match transformers and the target, fit the budget."""

from __future__ import annotations

import json

import pytest

from dspark_export.demo.build import DEMO_CONFIG
from dspark_common.prompts import demo_prompts_path
from dspark_export.presets import demo_dir, resolve_target
from dspark_common.tokenizer import ChatTokenizer

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def demo_model():
    from dspark_export.loading import load_target

    return load_target(resolve_target("demo"))


def test_preset_resolves_to_the_packaged_checkpoint():
    spec = resolve_target("demo")
    assert spec.path == demo_dir()
    assert spec.config == DEMO_CONFIG
    files = {p.name for p in demo_dir().iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= files
    assert sum(p.stat().st_size for p in demo_dir().iterdir()) < 60e6


def test_matches_transformers(demo_model):
    transformers = pytest.importorskip("transformers")
    model, tokenizer = demo_model
    reference = transformers.Qwen3ForCausalLM.from_pretrained(demo_dir(), dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")])
    with torch.no_grad():
        assert (model(ids).logits - reference(ids).logits).abs().max() <= 1e-4
        expected = reference.generate(ids, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids))
    from dspark_export.demo.distill import generate_batch

    ours = generate_batch(model, ids, 24, True, torch.Generator())[0]
    assert ours == expected[0, ids.shape[1] : ids.shape[1] + len(ours)].tolist()


def test_greedy_generation_is_deterministic(demo_model):
    from dspark_export.demo.distill import generate_batch

    model, tokenizer = demo_model
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is (12 + 30) × 2?"}])
    ids = torch.tensor([tokenizer.encode(prompt)])
    first = generate_batch(model, ids, 32, True, torch.Generator())
    assert first == generate_batch(model, ids, 32, True, torch.Generator())
    assert len(first[0]) > 0


def test_chat_template_renders_two_turns():
    tokenizer = ChatTokenizer.from_dir(demo_dir())
    text = tokenizer.apply_chat_template([
        {"role": "user", "content": "Tell me a fortune."},
        {"role": "assistant", "content": "Fortune favours the bold."},
        {"role": "user", "content": "Another one?"},
    ])
    assert text == (
        "<|im_start|>user\nTell me a fortune.<|im_end|>\n<|im_start|>assistant\nFortune favours the bold.<|im_end|>\n"
        "<|im_start|>user\nAnother one?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text)
    assert ids.count(tokenizer.special["<|im_start|>"]) == 4 and tokenizer.decode(ids) == text
    assert tokenizer.eos_token_ids == (2, 0)


def test_held_out_prompt_sets():
    rows = [json.loads(line) for line in demo_prompts_path().read_text().splitlines()]
    for domain in ("code", "math", "chat"):
        assert sum(r["domain"] == domain for r in rows) >= 50
    chat = [r for r in rows if r["domain"] != "code"]
    assert all(r["prompt"].endswith("<|im_start|>assistant\n") and r["messages"][0]["role"] == "user" for r in chat)


def test_bundled_drafters_are_built_for_the_demo_target_and_fit_the_budget():
    from dspark_export.drafters.bundled import bundled_drafters, bundled_root
    from dspark_export.drafters.config import DrafterConfig

    names = bundled_drafters()
    assert {"demo-dspark", "demo-dflash", "demo-eagle3"} <= set(names)
    tokenizer = ChatTokenizer.from_dir(demo_dir())
    for name in names:
        config = DrafterConfig.from_dir(bundled_root() / name)
        config.check_target(DEMO_CONFIG, tokenizer.vocab_hash())  # raises on a mismatch
    folders = (demo_dir(), *(bundled_root() / name for name in names))
    size = sum(file.stat().st_size for folder in folders for file in folder.iterdir())
    assert size < 54e6  # the binary budget is 60 MB in all; data, fixtures and figures take about 6 MB
