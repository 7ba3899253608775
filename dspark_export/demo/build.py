"""Rebuild the bundled demo target from scratch: `python -m dspark_export.demo.build --work DIR`.

Stages (each skipped when its output exists, so an interrupted build resumes): corpus, tokenizer,
token streams, training (resumable from its own checkpoint), the Hugging Face checkpoint written into
the package's `assets/demo/`, and the held-out prompt sets in the runtime's `assets/demo-prompts.jsonl`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click

from dspark_export.config import DecoderConfig
from dspark_export.demo.corpus import build_corpus, read_jsonl, DOMAINS
from dspark_export.presets import demo_dir
from dspark_common.prompts import demo_prompts_path

# Sized by measurement on a 2-core CPU (docs/demo-target.md): the middle of three sizes tried, small enough to train
# there in minutes, large enough that verifying 8 tokens costs visibly more than one.
DEMO_CONFIG = DecoderConfig(
    vocab_size=8192,
    hidden_size=384,
    intermediate_size=1152,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
    dtype="bfloat16",
)
def write_generation_config(folder: Path) -> None:
    """Greedy by default: the demo exists to show drafting, and a 13.5M-parameter model sampled at T=0.7 writes
    noise its drafter cannot predict (the gate then rightly keeps drafting off). A real model keeps its own."""
    config = {"eos_token_id": [2, 0], "pad_token_id": 0, "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(config, indent=2) + "\n")


@click.command()
@click.option("--work", type=click.Path(file_okay=False, path_type=Path), default=Path("build/demo"), show_default=True,
              help="Folder for the corpus, tokens and the training run.")
@click.option("--steps", type=int, default=1400, show_default=True, help="Training steps of 8 x 512 tokens.")
@click.option("--threads", type=int, default=None, help="torch threads (default: all cores).")
@click.option("--export-only", is_flag=True, help="Write the package assets from the run as it stands.")
def main(work: Path, steps: int, threads: int | None, export_only: bool) -> None:
    """Rebuild the demo corpus, tokenizer and target, then install them as package data."""
    from dspark_export.demo.prompts import build_prompts
    from dspark_export.demo.tokenizer import train_tokenizer
    from dspark_export.demo.tokens import tokenize_corpus
    from dspark_export.demo.train import TrainConfig, train
    from dspark_export.model import save_checkpoint
    from dspark_common.tokenizer import ChatTokenizer

    corpus, tokenizer_dir, tokens, run = work / "corpus", work / "tokenizer", work / "tokens", work / "run"
    if not (corpus / "chat.test.jsonl").is_file():
        click.echo(json.dumps({"corpus": build_corpus(corpus, work / "cache")}), err=True)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        train_tokenizer(
            (doc["text"] for d in DOMAINS for doc in read_jsonl(corpus / f"{d}.train.jsonl")), tokenizer_dir
        )
    if not (tokens / "chat.test.u16").is_file():
        click.echo(json.dumps({"tokens": tokenize_corpus(corpus, tokenizer_dir, tokens)}), err=True)
    cfg = TrainConfig(steps=steps)
    if export_only:
        import torch

        from dspark_export.model import DecoderModel

        model = DecoderModel(DEMO_CONFIG)
        model.load_state_dict(torch.load(run / "state.pt", weights_only=False)["model"])
    else:
        model = train(DEMO_CONFIG, tokens, run, cfg, threads)
    assets = demo_dir()
    assets.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, assets, dtype=DEMO_CONFIG.dtype)
    write_generation_config(assets)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, assets / name)
    tokenizer = ChatTokenizer.from_dir(assets)
    counts = build_prompts(corpus, demo_prompts_path(), lambda messages: tokenizer.apply_chat_template(messages))
    click.echo(json.dumps({"assets": str(assets), "prompts": counts}))


if __name__ == "__main__":
    main()
