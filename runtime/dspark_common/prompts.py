"""Benchmark prompt files (DESIGN §9): JSON lines `{"domain": ..., "prompt": ..., "messages": [...]?}`."""

from __future__ import annotations

import json
from collections import Counter
from importlib import resources
from pathlib import Path

from dspark_common.errors import DSparkError


DEMO_PROMPT = "A train travels 60 km each hour. How far does it travel in 4 hours?"  # one the demo drafts well
DEMO_NOTE = ("The bundled demo: a 13.5M-parameter model this project trains on code, grade-school math and prose, "
             "with its DSpark drafter. It is not an assistant and is often wrong; it is here to show speculation at "
             "work.")


def demo_prompts_path() -> Path:
    """The bundled demo's held-out prompts (60 per domain), the default of every benchmark command."""
    return Path(str(resources.files("dspark_common") / "assets" / "demo-prompts.jsonl"))


def read_prompts(file: str | Path, per_domain: int | None = None, skip: int = 0) -> list[dict]:
    """The prompts of a file: of each domain, those after its first `skip`, at most `per_domain` of them."""
    try:
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DSparkError(f"cannot read prompts from {file}: {exc}") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DSparkError(f"{file}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise DSparkError(f'{file}:{number}: each line needs a "prompt" string')
        rows.append(row)
    last = skip + (len(rows) if per_domain is None else per_domain)
    seen: Counter = Counter()
    kept = []
    for row in rows:
        domain = row.get("domain", "all")
        seen[domain] += 1
        if skip < seen[domain] <= last:
            kept.append(row)
    return kept
