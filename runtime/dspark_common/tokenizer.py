"""Hugging Face tokenizer files (`tokenizer.json`, `tokenizer_config.json`) and the chat template.

The chat template is rendered by jinja2 in a sandbox, with the same environment options and helpers
as `transformers` (so Qwen3's own template renders unchanged), without importing transformers.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from dspark_common.errors import TokenizerError, read_json_file


TEMPLATE_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")  # Llama-3's template opens with {{ bos_token }}


def _template_environment():  # jinja2 is imported only when a template is rendered
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
    ) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(entry: Any) -> str | None:
    """`tokenizer_config.json` writes special tokens as strings or as AddedToken dicts."""
    if isinstance(entry, dict):
        return entry.get("content")
    return entry


@dataclass
class ChatTokenizer:
    """Text <-> token ids plus the chat template, loaded from a Hugging Face model folder."""

    backend: Any  # tokenizers.Tokenizer
    chat_template: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    special: dict[str, int] = field(default_factory=dict)
    template_tokens: dict[str, str] = field(default_factory=dict)  # bos_token etc., as transformers hands templates

    @classmethod
    def from_dir(cls, path: str | Path) -> "ChatTokenizer":
        """Load `tokenizer.json` (required), `tokenizer_config.json`, `chat_template.jinja` and
        `generation_config.json` (optional) from one folder."""
        from tokenizers import Tokenizer

        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"no tokenizer.json in {path}")
        try:
            backend = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust library raises plain Exceptions
            raise TokenizerError(f"{tokenizer_file} is not a valid tokenizer file: {exc}") from None
        config = _optional_json(path / "tokenizer_config.json")
        generation = _optional_json(path / "generation_config.json")

        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")

        special = {tok.content: idx for idx, tok in backend.get_added_tokens_decoder().items() if tok.special}

        def token_id(entry: Any) -> int | None:
            text = _token_text(entry)
            return None if text is None else backend.token_to_id(text)

        eos_ids: list[int] = []
        eos_from_generation = generation.get("eos_token_id")
        for candidate in [token_id(config.get("eos_token"))] + (
            eos_from_generation if isinstance(eos_from_generation, list) else [eos_from_generation]
        ):
            if candidate is not None and candidate not in eos_ids:
                eos_ids.append(int(candidate))
        named = {key: _token_text(config.get(key)) for key in TEMPLATE_TOKENS}
        return cls(backend, template, tuple(eos_ids), token_id(config.get("pad_token")), special,
                   {key: text for key, text in named.items() if text is not None})

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def vocab_hash(self) -> str:
        """A short fingerprint of the token -> id map: two tokenizers with equal hashes are interchangeable."""
        vocab = sorted(self.backend.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
        return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. Through `encode_batch`, which releases the GIL while it works: a 2 MB prompt takes
        seconds to tokenize, and `encode` would hold every other thread (the step loop too) for all of them."""
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level token may hold part of a UTF-8 character)."""
        piece = self.backend.id_to_token(token_id)
        byte_level = type(self.backend.decoder).__name__ == "ByteLevel"
        if piece is None or token_id in self.special.values() or not byte_level:
            return self.decode([token_id]).encode("utf-8")
        table = _byte_level_table()
        return bytes(table[char] for char in piece) if all(char in table for char in piece) else piece.encode()

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """Render a conversation to the prompt text the model was trained on.

        Extra keyword arguments (`enable_thinking=False`, `tools=[...]`) reach the template as variables.
        """
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template; use plain completion instead")
        from jinja2.exceptions import TemplateError

        try:
            template = _template_environment().from_string(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **(self.template_tokens | variables))
        except TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from None


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE token uses for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def _optional_json(path: Path) -> dict[str, Any]:
    return read_json_file(path, TokenizerError) if path.is_file() else {}


ROLES = ("system", "user", "assistant", "tool", "developer")


def checked_text(text: str, what: str) -> str:
    """`text` if it is encodable text (no lone surrogates), else an InvalidRequestError naming `what`."""
    from dspark_common.errors import InvalidRequestError

    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(f"{what} is not valid Unicode text (a lone surrogate)") from None
    return text


def chat_messages(messages: list | tuple) -> list[dict[str, Any]]:
    """OpenAI chat messages as the template wants them: a role and a string content (a list of text parts, as
    OpenAI clients send, is joined; None is empty). OpenAI's `developer` role is the system role chat templates
    know. Anything else is an InvalidRequestError."""
    from dspark_common.errors import InvalidRequestError

    out = []
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise InvalidRequestError(f"message {number} needs a role: one of {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise InvalidRequestError(f'message {number}: content parts must be {{"type": "text", "text": ...}}')
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise InvalidRequestError(f"message {number}: content must be a string or a list of text parts")
        role = "system" if message["role"] == "developer" else message["role"]
        out.append({**message, "role": role, "content": checked_text(content, f"message {number}'s content")})
    return out
