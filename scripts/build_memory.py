"""Peak memory of `dspark-export build` on a large random Qwen3 checkpoint (default ~0.94B parameters, bf16,
sharded), to show the exporter streams weights instead of holding the checkpoint in memory.

    python scripts/build_memory.py --work build/memory [--dtype float32|bfloat16|float16]

Prints the checkpoint size, the written graph size, the build's wall time and peak resident memory
(the child process's max RSS) and the ratio of peak memory to the checkpoint size.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16, num_attention_heads=16,
              num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False)


def write_checkpoint(folder: Path) -> None:
    import torch

    from dspark_export.config import Qwen3Config
    from dspark_export.model import Qwen3Model, save_checkpoint
    from dspark_export.presets import demo_dir

    torch.manual_seed(0)
    with torch.no_grad():
        model = Qwen3Model(Qwen3Config(**CONFIG))
    save_checkpoint(model, folder, "bfloat16", max_shard_bytes=1 << 30)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_dir() / name, folder / name)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("build/memory"))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    checkpoint, engine = args.work / "checkpoint", args.work / f"engine-{args.dtype}"
    if args.write_only:
        write_checkpoint(checkpoint)
        return
    if not (checkpoint / "model.safetensors.index.json").is_file():
        print(f"writing a random checkpoint to {checkpoint} ...", flush=True)
        # in a child process: this one must stay small, or the build child's max RSS would count its pages
        subprocess.run([sys.executable, __file__, "--work", str(args.work), "--write-only"], check=True)
    start = time.perf_counter()
    subprocess.run(["dspark-export", "build", "--target-path", str(checkpoint), "--out", str(engine),
                    "--dtype", args.dtype, "--force"], check=True)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    size = folder_bytes(checkpoint)
    params = CONFIG["vocab_size"] * CONFIG["hidden_size"] * 2 + CONFIG["num_hidden_layers"] * (
        CONFIG["hidden_size"] * CONFIG["head_dim"] * (2 * CONFIG["num_attention_heads"] + 2 * CONFIG["num_key_value_heads"])
        + 3 * CONFIG["hidden_size"] * CONFIG["intermediate_size"])
    print(f"checkpoint: {params / 1e9:.2f}B parameters, {size / 2**30:.2f} GiB (bf16, 1 GiB shards)")
    print(f"engine ({args.dtype}): {folder_bytes(engine) / 2**30:.2f} GiB written in {seconds:.0f} s")
    print(f"peak RSS of the build: {peak / 2**30:.2f} GiB = {peak / size:.2f}x the checkpoint")


if __name__ == "__main__":
    main()
