"""Tokenize the corpus splits into flat uint16 streams (documents joined by `<|endoftext|>`, id 0)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark_export.demo.corpus import DOMAINS, SPLITS, read_jsonl

END_OF_TEXT = 0


def tokenize_corpus(corpus: Path, tokenizer_dir: Path, out: Path) -> dict:
    """Write `{out}/{domain}.{split}.u16`; returns tokens per domain and split."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    if tokenizer.get_vocab_size() > 65535:
        raise ValueError("uint16 token streams need a vocabulary under 65536")
    out.mkdir(parents=True, exist_ok=True)
    counts: dict = {}
    for domain in DOMAINS:
        counts[domain] = {}
        for split in SPLITS:
            texts = [doc["text"] for doc in read_jsonl(corpus / f"{domain}.{split}.jsonl")]
            stream = []
            for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
                stream.extend(encoding.ids)
                stream.append(END_OF_TEXT)
            np.asarray(stream, dtype=np.uint16).tofile(out / f"{domain}.{split}.u16")
            counts[domain][split] = len(stream)
    return counts


def load_stream(folder: Path, domain: str, split: str) -> np.ndarray:
    return np.fromfile(folder / f"{domain}.{split}.u16", dtype=np.uint16)
