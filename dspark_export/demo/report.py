"""Held-out quality of the demo target: loss, next-token entropy and top-1 accuracy per domain, plus
greedy samples. `python -m dspark_export.demo.report --work build/demo` prints one JSON object."""

from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np
import torch

from dspark_export.demo.corpus import DOMAINS
from dspark_export.demo.distill import generate_batch
from dspark_export.demo.tokens import load_stream
from dspark_export.model import DecoderModel


@torch.no_grad()
def held_out_metrics(
    model: DecoderModel, stream: np.ndarray, windows: int, seq_len: int, seed: int = 0
) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    losses, entropies, hits = [], [], []
    for _ in range(windows):
        start = int(rng.integers(0, len(stream) - seq_len - 1))
        window = torch.from_numpy(stream[start : start + seq_len + 1].astype(np.int64))[None]
        log_probs = torch.log_softmax(model(window[:, :-1]).logits[0].float(), -1)
        targets = window[0, 1:]
        losses.append(-log_probs.gather(1, targets[:, None])[:, 0])
        entropies.append(-(log_probs.exp() * log_probs).sum(-1))
        hits.append((log_probs.argmax(-1) == targets).float())
    return {
        "loss": round(float(torch.cat(losses).mean()), 4),
        "entropy": round(float(torch.cat(entropies).mean()), 4),
        "top1_accuracy": round(float(torch.cat(hits).mean()), 4),
    }


@click.command()
@click.option("--work", type=click.Path(file_okay=False, path_type=Path), default=Path("build/demo"), show_default=True)
@click.option("--windows", type=int, default=16, show_default=True, help="Held-out windows of 512 tokens per domain.")
@click.option("--samples", type=int, default=2, show_default=True, help="Greedy samples per domain.")
def main(work: Path, windows: int, samples: int) -> None:
    """Report the bundled demo target's held-out quality."""
    from dspark_common.prompts import demo_prompts_path
    from dspark_export.loading import load_target
    from dspark_export.presets import resolve_target

    spec = resolve_target("demo")
    model, tokenizer = load_target(spec)
    report: dict = {"parameters": spec.config.num_parameters(), "held_out": {}, "greedy_samples": {}}
    prompts = [json.loads(line) for line in demo_prompts_path().read_text().splitlines()]
    for domain in DOMAINS:
        report["held_out"][domain] = held_out_metrics(model, load_stream(work / "tokens", domain, "test"), windows, 512)
        report["greedy_samples"][domain] = []
        for prompt in [p for p in prompts if p["domain"] == domain][:samples]:
            ids = torch.tensor([tokenizer.encode(prompt["prompt"])])
            continuation = generate_batch(model, ids, 80, True, torch.Generator())[0]
            report["greedy_samples"][domain].append(
                {"prompt": prompt["prompt"], "completion": tokenizer.decode(continuation)}
            )
    click.echo(json.dumps(report, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
