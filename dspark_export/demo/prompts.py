"""Held-out prompt sets (DESIGN §9 JSON lines) from the test split of each domain."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from dspark_export.demo.corpus import read_jsonl

CHAT_TURN = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)
DEF_WITH_DOCSTRING = re.compile(r"^(    )?def \w+\(.*?\).*?:\n(\s+)(\"\"\"|''')(?:.|\n)*?\3\n", re.MULTILINE)


def code_prompts(documents: list[dict], limit: int, rng: random.Random) -> list[dict]:
    """A function's signature and docstring, from held-out stdlib files: the model writes the body."""
    candidates = []
    for doc in documents:
        for match in DEF_WITH_DOCSTRING.finditer(doc["text"]):
            snippet = match.group(0)
            if 40 <= len(snippet) <= 600:
                candidates.append(
                    snippet if not snippet.startswith("    ") else re.sub(r"^    ", "", snippet, flags=re.MULTILINE)
                )
    rng.shuffle(candidates)
    return [{"domain": "code", "prompt": text} for text in candidates[:limit]]


def chat_prompts(domain: str, documents: list[dict], limit: int, rng: random.Random, template) -> list[dict]:
    """The first user turn of held-out conversations, with the rendered prompt text."""
    picked = rng.sample(documents, min(limit, len(documents)))
    prompts = []
    for doc in picked:
        user = CHAT_TURN.search(doc["text"]).group(1)
        messages = [{"role": "user", "content": user}]
        prompts.append({"domain": domain, "prompt": template(messages), "messages": messages})
    return prompts


def build_prompts(corpus: Path, out_file: Path, template, per_domain: int = 60, seed: int = 0) -> dict[str, int]:
    """Write `per_domain` prompts of each domain to `out_file`; `template(messages) -> str` renders chat turns."""
    rng = random.Random(seed)
    prompts = code_prompts(read_jsonl(corpus / "code.test.jsonl"), per_domain, rng)
    for domain in ("math", "chat"):
        prompts += chat_prompts(domain, read_jsonl(corpus / f"{domain}.test.jsonl"), per_domain, rng, template)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts), encoding="utf-8")
    return {d: sum(p["domain"] == d for p in prompts) for d in ("code", "math", "chat")}
