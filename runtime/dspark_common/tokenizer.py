"""Hugging Face tokenizer files (`tokenizer.json`, `tokenizer_config.json`) and the chat template.

The chat template is rendered by jinja2 in a sandbox, with the same environment options and helpers
as `transformers` (so Qwen3's own template renders unchanged), without importing transformers. A template comes
with the model file, so its rendering is bounded: the text it writes, the items its loops draw from `range`, the
strings and lists `*` makes, the widths of padding filters and the size of `**`; any failure is one
`TokenizerError` for that request.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from dspark_common.errors import TokenizerError, read_json_file


TEMPLATE_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")  # Llama-3's template opens with {{ bos_token }}
TEMPLATE_OUTPUT = 1 << 22  # characters a rendering may write (and a string or list `*` may make)
TEMPLATE_ITEMS = 1 << 20  # items all of a rendering's `range` calls may yield together
TEMPLATE_WIDTH = 1 << 12  # widths of `indent`, `center` and `tojson(indent=...)`
TEMPLATE_POWER = 1 << 10  # the largest exponent of `**`


class TemplateBoundError(Exception):
    """A chat template went past one of the bounds above."""


def _template_environment():  # jinja2 is imported only when a template is rendered
    from jinja2.compiler import CodeGenerator
    from jinja2.exceptions import TemplateError
    from jinja2.filters import do_center, do_format, do_indent
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        """`a ~ b` through `environment.concat`, which counts what it makes."""

        def visit_Concat(self, node, frame) -> None:
            self.write("environment.concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox, with `*`, `**`, `+`, `%`, `~` and `str.format` checked before they compute and `range`
        counted."""

        code_generator_class = BoundedCodeGenerator
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def __init__(self, **options: Any):
            super().__init__(**options)
            self.items = 0

        def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > TEMPLATE_POWER:
                raise TemplateBoundError(f"** with an exponent of {right}")
            if operator == "*":
                for sized, count in ((left, right), (right, left)):
                    if isinstance(sized, (str, list, tuple)) and isinstance(count, int) and \
                            len(sized) * count > TEMPLATE_OUTPUT:
                        raise TemplateBoundError(f"a {type(sized).__name__} repeated {count} times")
            if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                _sized(len(left) + len(right))
            if operator == "%" and isinstance(left, str):
                _check_format(left)
            return super().call_binop(context, operator, left, right)

        def concat(self, values: tuple) -> str:
            text = "".join(str(value) for value in values)
            return _sized(len(text)) and text

        def wrap_str_format(self, value: Any):
            wrapped = super().wrap_str_format(value)
            if wrapped is not None:
                _check_format(value.__self__)
            return wrapped

        def counted_range(self, *args: int):
            for value in range(*args):
                self.items += 1
                if self.items > TEMPLATE_ITEMS:
                    raise TemplateBoundError(f"loops over more than {TEMPLATE_ITEMS} items")
                yield value

    def raise_exception(message: str = "raise_exception() was called") -> None:
        raise TemplateError(message)

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
    ) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=_width(indent), separators=separators,
                          sort_keys=sort_keys)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.filters["indent"] = lambda s, width=4, *args, **kwargs: do_indent(s, _width(width), *args, **kwargs)
    env.filters["center"] = lambda value, width=80: do_center(value, _width(width))
    env.filters["format"] = lambda value, *args, **kwargs: do_format(_check_format(value), *args, **kwargs)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["range"] = env.counted_range
    return env


def _sized(length: int) -> bool:
    """True, or TemplateBoundError for a string or list longer than TEMPLATE_OUTPUT."""
    if length > TEMPLATE_OUTPUT:
        raise TemplateBoundError(f"a value of {length} items or characters")
    return True


PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d*)(?:\.(\d*))?")
BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")


def _check_format(text: Any) -> Any:
    """`text`, or TemplateBoundError when a width or precision in it (% or {} style) passes TEMPLATE_WIDTH."""
    if isinstance(text, str):
        numbers = [n for match in PERCENT_SPEC.finditer(text) for n in match.groups() if n]
        numbers += [n for match in BRACE_SPEC.finditer(text) for n in re.findall(r"\d+", match.group(1))]
        for number in numbers:
            _width(int(number))
    return text


def _width(width: Any) -> Any:
    """A padding width a template asks for, refused past TEMPLATE_WIDTH."""
    if isinstance(width, int) and width > TEMPLATE_WIDTH:
        raise TemplateBoundError(f"a width of {width}")
    return width


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
        try:
            template = _template_environment().from_string(self.chat_template)
            parts, written = [], 0
            for part in template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                          **(self.template_tokens | variables)):
                written += len(part)
                if written > TEMPLATE_OUTPUT:
                    raise TemplateBoundError(f"more than {TEMPLATE_OUTPUT} characters written")
                parts.append(part)
            return "".join(parts)
        except TemplateBoundError as exc:
            raise TokenizerError(f"chat template stopped: {exc}") from None
        except Exception as exc:  # the template is the model file's code: any failure is this request's alone
            raise TokenizerError(f"chat template failed: {type(exc).__name__}: {exc}") from None


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
