"""Self-distillation data: continuations the target itself generates for training-split prompts.

Drafters learn the target's own distribution (the paper trains on target-regenerated responses).
`python -m dspark_export.demo.distill --target demo --out FILE.npz` writes one compressed file:
`tokens` (uint16, or uint32 for vocabularies past 65,536, sequences back to back), `starts`, `prompt_lengths`,
`lengths` (int32 per sequence), `domains` (index into `domain_names`) and `greedy` (1 = greedy, 0 = sampled at T=1).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path

import click
import numpy as np
import torch

from dspark_export.demo.corpus import CHAT_PROMPT_END, DOMAINS, read_jsonl
from dspark_export.drafters.data import token_dtype
from dspark_export.model import DecoderModel

STOP_IDS = (0, 2)  # <|endoftext|>, <|im_end|>
BUCKET = 32  # chat prompts are trimmed from the left to a multiple of this (shorter ones skipped), so they batch
MAX_CHAT_PROMPT = 256


def training_prompts(
    corpus: Path, tokenizer, per_domain: int, code_prompt_tokens: int, seed: int
) -> list[tuple[str, list[int]]]:
    """(domain, token ids) prompts: chat turns up to the assistant's reply, code as a file prefix."""
    rng = random.Random(seed)
    prompts = []
    for domain in DOMAINS:
        documents = read_jsonl(corpus / f"{domain}.train.jsonl")
        for doc in rng.sample(documents, min(per_domain, len(documents))):
            text = doc["text"]
            if domain == "code":
                ids = tokenizer.encode(text)
                start = rng.randrange(0, max(1, len(ids) - code_prompt_tokens))
                prompts.append((domain, ids[start : start + code_prompt_tokens]))
            else:
                cut = text.index(CHAT_PROMPT_END) + len(CHAT_PROMPT_END)
                ids = tokenizer.encode(text[:cut])[-MAX_CHAT_PROMPT:]
                if len(ids) >= BUCKET:  # keep a multiple of BUCKET tokens (cut from the left): prompts batch together
                    prompts.append((domain, ids[len(ids) % BUCKET :]))
    return prompts


@torch.no_grad()
def generate_batch(
    model: DecoderModel, prompts: torch.Tensor, max_new: int, greedy: bool, generator: torch.Generator
) -> list[list[int]]:
    """Continue equal-length prompts [B, P]; each continuation ends at its first stop token (kept)."""
    batch, length = prompts.shape
    model.setup_caches(batch, length + max_new)
    logits = model(prompts, torch.arange(length).expand(batch, length), use_cache=True).logits[:, -1]
    out, done = [], torch.zeros(batch, dtype=torch.bool)
    for step in range(max_new):
        if greedy:
            token = logits.argmax(-1)
        else:
            token = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator)[:, 0]
        out.append(token)
        done |= torch.isin(token, torch.tensor(STOP_IDS))
        if bool(done.all()) or step == max_new - 1:
            break
        position = torch.full((batch, 1), length + step)
        logits = model(token[:, None], position, use_cache=True).logits[:, -1]
    sequences = torch.stack(out, 1).tolist()
    continuations = []
    for row in sequences:
        stops = [i for i, t in enumerate(row) if t in STOP_IDS]
        continuations.append(row[: stops[0] + 1] if stops else row)
    return continuations


def distill(
    model: DecoderModel, prompts: list[tuple[str, list[int]]], max_new: int, batch: int, seed: int
) -> dict[str, np.ndarray]:
    """Greedy and T=1 continuations for every prompt, grouped by prompt length so batches share positions."""
    generator = torch.Generator().manual_seed(seed)
    groups: dict[int, list[int]] = defaultdict(list)
    for index, (_, ids) in enumerate(prompts):
        groups[len(ids)].append(index)
    records = []
    from tqdm import tqdm

    with tqdm(total=2 * len(prompts), desc="distill", unit="seq") as bar:
        for greedy in (True, False):
            for length, members in sorted(groups.items()):
                for start in range(0, len(members), batch):
                    chunk = members[start : start + batch]
                    ids = torch.tensor([prompts[i][1] for i in chunk])
                    for i, continuation in zip(chunk, generate_batch(model, ids, max_new, greedy, generator)):
                        records.append((prompts[i][0], prompts[i][1], continuation, greedy))
                    bar.update(len(chunk))
    sequences = [prompt + continuation for _, prompt, continuation, _ in records]
    lengths = np.array([len(s) for s in sequences], dtype=np.int32)
    return {
        "tokens": np.concatenate([np.asarray(s, dtype=token_dtype(model.config.vocab_size)) for s in sequences]),
        "starts": np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64),
        "lengths": lengths,
        "prompt_lengths": np.array([len(p) for _, p, _, _ in records], dtype=np.int32),
        "domains": np.array([DOMAINS.index(d) for d, _, _, _ in records], dtype=np.uint8),
        "domain_names": np.array(DOMAINS),
        "greedy": np.array([g for *_, g in records], dtype=np.uint8),
    }


@click.command()
@click.option("--target", default="demo", show_default=True, help="Target name (see dspark-export inspect).")
@click.option("--target-path", default=None, help="Hugging Face model folder.")
@click.option(
    "--corpus", type=click.Path(file_okay=False, path_type=Path), default=Path("build/demo/corpus"), show_default=True
)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True)
@click.option("--per-domain", type=int, default=1000, show_default=True, help="Prompts per domain.")
@click.option("--max-new", type=int, default=160, show_default=True, help="Tokens per continuation at most.")
@click.option("--batch", type=int, default=32, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def main(target, target_path, corpus, out, per_domain, max_new, batch, seed) -> None:
    """Generate self-distillation sequences from the target for drafter training."""
    from dspark_export.loading import load_target
    from dspark_export.presets import resolve_target

    model, tokenizer = load_target(resolve_target(target, target_path))
    prompts = training_prompts(corpus, tokenizer, per_domain, code_prompt_tokens=64, seed=seed)
    data = distill(model, prompts, max_new, batch, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **data)
    click.echo(
        json.dumps({"sequences": int(len(data["lengths"])), "tokens": int(data["lengths"].sum()), "out": str(out)})
    )


if __name__ == "__main__":
    main()
