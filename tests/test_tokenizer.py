"""Tokenizer files and the chat template: our sandboxed rendering equals `transformers`' own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_export.demo.tokenizer import SPECIAL_TOKENS, train_tokenizer
from dspark_common.errors import TokenizerError
from dspark_common.tokenizer import ChatTokenizer

QWEN3_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3_chat_template.jinja").read_text()
TEXT = ["def add(a, b):\n    return a + b\n", "Hello there, how are you today?", "The answer is 42."] * 50
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "<think>\ngreet back\n</think>\n\nHello."},
    {"role": "user", "content": "What is 2 + 2?"},
]


@pytest.fixture
def qwen3_style_dir(tmp_path) -> Path:
    train_tokenizer(TEXT, tmp_path, vocab_size=300)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": QWEN3_TEMPLATE}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return tmp_path


def test_special_tokens_and_round_trip(qwen3_style_dir):
    tokenizer = ChatTokenizer.from_dir(qwen3_style_dir)
    assert tokenizer.special == {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    assert tokenizer.eos_token_ids == (2, 0) and tokenizer.pad_token_id == 0
    text = "<|im_start|>user\ndef add(a, b): é ✓<|im_end|>"
    ids = tokenizer.encode(text)
    assert ids[0] == 1 and ids[-1] == 2  # special tokens are single ids
    assert tokenizer.decode(ids) == text
    assert len(tokenizer.vocab_hash()) == 16


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_qwen3_template_matches_transformers(qwen3_style_dir, enable_thinking):
    transformers = pytest.importorskip("transformers")
    ours = ChatTokenizer.from_dir(qwen3_style_dir).apply_chat_template(CONVERSATION, enable_thinking=enable_thinking)
    reference = transformers.AutoTokenizer.from_pretrained(qwen3_style_dir).apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    assert ours == reference
    assert "greet back" not in ours  # reasoning of earlier turns is dropped
    assert ours.endswith("<|im_start|>assistant\n" + ("" if enable_thinking else "<think>\n\n</think>\n\n"))


def test_demo_template_two_turns(tmp_path):
    train_tokenizer(TEXT, tmp_path, vocab_size=300)
    rendered = ChatTokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATION[1:])
    assert rendered == (
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n<think>\ngreet back\n</think>\n\nHello.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    tool = ChatTokenizer.from_dir(tmp_path).apply_chat_template([{"role": "tool", "content": "sunny"}], False)
    assert tool == "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"  # as Qwen3 renders it
    with pytest.raises(TokenizerError, match="unknown role function"):
        ChatTokenizer.from_dir(tmp_path).apply_chat_template([{"role": "function", "content": "x"}])


def test_sandbox_blocks_unsafe_templates(qwen3_style_dir):
    tokenizer = ChatTokenizer.from_dir(qwen3_style_dir)
    tokenizer.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(TokenizerError, match="chat template failed"):
        tokenizer.apply_chat_template(CONVERSATION)


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        ChatTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(TokenizerError, match="not a valid tokenizer file"):
        ChatTokenizer.from_dir(tmp_path)


# Meta-Llama-3-Instruct's template: the conversation opens with {{ bos_token }}, which transformers hands templates
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def test_a_template_gets_the_special_tokens_as_transformers_gives_them(qwen3_style_dir):
    transformers = pytest.importorskip("transformers")
    config = json.loads((qwen3_style_dir / "tokenizer_config.json").read_text())
    config |= {"chat_template": LLAMA3_TEMPLATE, "bos_token": "<|endoftext|>"}
    (qwen3_style_dir / "tokenizer_config.json").write_text(json.dumps(config))
    ours = ChatTokenizer.from_dir(qwen3_style_dir).apply_chat_template(CONVERSATION[:2])
    reference = transformers.AutoTokenizer.from_pretrained(qwen3_style_dir).apply_chat_template(
        CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert ours == reference and ours.startswith("<|endoftext|><|start_header_id|>system")
