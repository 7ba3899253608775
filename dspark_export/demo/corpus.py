"""Assemble the demo corpus: documents per domain, chat framing, held-out splits by document.

Output (`build_corpus`): `{out}/{domain}.{split}.jsonl`, one `{"key", "text"}` document per line,
and a stats dict (documents and characters per domain and split).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Iterable, Iterator

from dspark_export.demo import mathgen, sources

DOMAINS = ("code", "math", "chat")
SPLITS = ("train", "val", "test")
MATH_PROBLEMS = {"train": 40_000, "val": 1_000, "test": 1_000}
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a friendly and concise assistant.", "Answer clearly."]
FORTUNE_ASKS = [
    "Tell me a fortune.",
    "Share a quote with me.",
    "Say something clever.",
    "Give me a saying to think about.",
    "Cheer me up with a fortune.",
    "Tell me something funny.",
]
PASSAGE_LINES = 32
CHAT_PROMPT_END = "<|im_start|>assistant\n"  # a chat prompt ends where the reply begins


def split_of(key: str) -> str:
    """A document's split from a hash of its key: 94% train, 3% val, 3% test."""
    bucket = int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100
    return "train" if bucket < 94 else "val" if bucket < 97 else "test"


def chat(user: str, assistant: str, rng: random.Random) -> str:
    """A one-turn conversation in the demo's chat format (see chat_template.jinja)."""
    system = f"<|im_start|>system\n{rng.choice(SYSTEM_PROMPTS)}<|im_end|>\n" if rng.random() < 0.3 else ""
    return f"{system}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"


def passages(key: str, text: str) -> Iterator[tuple[str, str, str]]:
    """Cut a long literary work into passages: (key, opening lines, continuation)."""
    lines = [line for line in text.splitlines() if line.strip()]
    title = key.split("/")[-1].removesuffix("_gut").replace("_", " ").title()
    for start in range(0, len(lines) - PASSAGE_LINES, PASSAGE_LINES):
        chunk = lines[start : start + PASSAGE_LINES]
        yield title, "\n".join(chunk[:3]), "\n".join(chunk[3:])


def chat_documents(literature_folder: Path, rng: random.Random) -> Iterator[tuple[str, str]]:
    for key, text in sources.fortunes():
        yield key, chat(rng.choice(FORTUNE_ASKS), text, rng)
    for key, text in sources.bible_chapters():
        title, body = text.split("\n", 1)
        yield key, chat(f"Recite {title} from the King James Bible.", body, rng)
    for key, text in sources.literature(literature_folder):
        for title, opening, rest in passages(key, text):
            yield key, chat(f"Continue this passage from {title}:\n{opening}", rest, rng)
    for key, text in sources.man_pages():
        name, body = text.split("\n\n", 1)
        command = name.split(" ")[0].split(",")[0]
        yield key, chat(f"What does the `{command}` command do?", f"{name}\n\n{body}", rng)


def math_documents(split: str, seed: int) -> Iterator[tuple[str, str]]:
    rng = random.Random(f"math-{split}-{seed}")
    for index in range(MATH_PROBLEMS[split]):
        question, solution = mathgen.problem(rng)
        yield f"math/{split}/{index}", chat(question, solution, rng)


def write_jsonl(path: Path, documents: Iterable[tuple[str, str]]) -> tuple[int, int]:
    count = chars = 0
    with path.open("w", encoding="utf-8") as handle:
        for key, text in documents:
            handle.write(json.dumps({"key": key, "text": text}, ensure_ascii=False) + "\n")
            count, chars = count + 1, chars + len(text)
    return count, chars


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def build_corpus(out: Path, cache: Path, seed: int = 0) -> dict:
    """Write every domain's splits under `out`; returns {domain: {split: {"documents", "chars"}}}."""
    out.mkdir(parents=True, exist_ok=True)
    literature_folder = sources.install_sources(cache)
    rng = random.Random(seed)
    by_domain = {
        "code": list(sources.python_stdlib()),
        "chat": list(chat_documents(literature_folder, rng)),
    }
    stats: dict = {}
    for domain in DOMAINS:
        stats[domain] = {}
        for split in SPLITS:
            if domain == "math":
                documents: Iterable = math_documents(split, seed)
            else:
                documents = [(key, text) for key, text in by_domain[domain] if split_of(key) == split]
            count, chars = write_jsonl(out / f"{domain}.{split}.jsonl", documents)
            stats[domain][split] = {"documents": count, "chars": chars}
    return stats
