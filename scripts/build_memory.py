"""Peak memory of `dspark-export build` on a random checkpoint with a published Qwen3 size's shapes, to show the
exporter streams weights instead of holding the checkpoint in memory.

    python scripts/build_memory.py --target qwen3-1.7b --weights int4 --work build/memory

The checkpoint is written by `scripts/random_checkpoint.py` when missing. Prints the checkpoint's size, the
engine's, the build's wall time and peak resident memory (the build process's max RSS) and the ratio of peak
memory to the checkpoint's size.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen3-1.7b")
    parser.add_argument("--weights", default="int4", choices=["fp32", "fp16", "int8", "int4"])
    parser.add_argument("--work", type=Path, default=Path("build/memory"))
    args = parser.parse_args()
    checkpoint, engine = args.work / args.target, args.work / f"{args.target}-{args.weights}"
    if not (checkpoint / "model.safetensors.index.json").is_file():
        subprocess.run([sys.executable, str(Path(__file__).with_name("random_checkpoint.py")), "--target", args.target,
                        "--out", str(checkpoint)], check=True)
    dtype = "float16" if args.weights == "fp16" else "float32"
    start = time.perf_counter()
    subprocess.run(["dspark-export", "build", "--target-path", str(checkpoint), "--out", str(engine), "--no-drafter",
                    "--weights", args.weights, "--dtype", dtype, "--force"], check=True)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest child: the build
    size, written = folder_bytes(checkpoint), folder_bytes(engine)
    print(json.dumps({"target": args.target, "weights": args.weights, "checkpoint_bytes": size, "engine_bytes": written,
                      "build_seconds": round(seconds, 1), "peak_rss_bytes": peak,
                      "peak_over_checkpoint": round(peak / size, 3)}, indent=2))


if __name__ == "__main__":
    main()
