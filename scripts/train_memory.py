"""Peak memory of one `dspark-export train` step of a published-shape DSpark drafter (5 layers, Markov rank 256)
against a random checkpoint with a published Qwen3 size's shapes: does training fit a desktop machine?

    python scripts/train_memory.py --target qwen3-1.7b --work build/memory

The checkpoint is written by `scripts/random_checkpoint.py` when missing; the data are random token sequences
(prompt 64, continuation to --length). Prints the step's wall time and the training process's peak memory: its
resident anonymous memory (weights, optimiser state, activations: what must fit in RAM), sampled every 50 ms, and
its max RSS (which also counts the checkpoint's memory-mapped pages, which the kernel can evict).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def random_sequences(out: Path, count: int, length: int, vocab: int) -> Path:
    """`count` random sequences of `length` tokens in the distillation file format."""
    rng = np.random.default_rng(0)
    lengths = np.full(count, length, dtype=np.int32)
    np.savez(out, tokens=rng.integers(4, vocab, count * length).astype(np.uint32),
             starts=np.arange(count, dtype=np.int64) * length, lengths=lengths,
             prompt_lengths=np.full(count, 64, dtype=np.int32))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen3-1.7b")
    parser.add_argument("--work", type=Path, default=Path("build/memory"))
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--draft-vocab", type=int, default=None, help="draft over this many tokens (default: all)")
    args = parser.parse_args()
    checkpoint = args.work / args.target
    if not (checkpoint / "model.safetensors.index.json").is_file():
        subprocess.run([sys.executable, str(Path(__file__).with_name("random_checkpoint.py")), "--target", args.target,
                        "--out", str(checkpoint)], check=True)
    vocab = json.loads((checkpoint / "tokenizer.json").read_text())["model"]["vocab"]
    data = random_sequences(args.work / "random-sequences.npz", args.batch, args.length, len(vocab))
    out = args.work / f"drafter-{args.target}"
    shutil.rmtree(out.with_name(out.name + ".run"), ignore_errors=True)
    command = ["dspark-export", "train", "--target-path", str(checkpoint), "--data", str(data), "--out", str(out),
               "--layers", str(args.layers), "--steps", "1", "--batch", str(args.batch)]
    if args.draft_vocab:
        command += ["--draft-vocab", str(args.draft_vocab)]
    start = time.perf_counter()
    process, anonymous = subprocess.Popen(command), 0
    while process.poll() is None:  # anonymous memory: what must fit (the checkpoint's mapped pages can be evicted)
        anonymous = max(anonymous, resident_anonymous(process.pid))
        time.sleep(0.05)
    if process.returncode:
        raise SystemExit(f"training failed with exit code {process.returncode}")
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest child: the training run
    print(json.dumps({"target": args.target, "layers": args.layers, "batch": args.batch, "length": args.length,
                      "draft_vocab": args.draft_vocab, "seconds": round(seconds, 1),
                      "peak_anonymous_gib": round(anonymous / 2**30, 2), "peak_rss_gib": round(peak / 2**30, 2)},
                     indent=2))


def resident_anonymous(pid: int) -> int:
    """A process's resident anonymous memory in bytes (0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon:")), 0)


if __name__ == "__main__":
    main()
