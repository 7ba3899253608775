"""A random-weight checkpoint with a preset's exact shapes (Qwen3, Qwen2.5, Llama-3.x), for timing at real size.

    python scripts/random_checkpoint.py --target qwen3-1.7b --out build/random/qwen3-1.7b

Hugging Face layout (config.json, bf16 safetensors shards of at most --shard-gib with their index, and the demo's
tokenizer, whose ids all lie inside the model's vocabulary). Each tensor is drawn and written in slices of rows,
so the checkpoint is never held in memory (an 8B one needs about 16 GB of disk and a few hundred MB of RAM).
Weights and biases ~ N(0, 0.02), norms 1: the model's outputs are meaningless, its costs are real. Never commit one.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import struct
from pathlib import Path

import numpy as np

ROWS_PER_SLICE = 4096


def bf16_bits(values: np.ndarray) -> np.ndarray:
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def write_shard(path: Path, shapes: dict[str, tuple[int, ...]], rng: np.random.Generator) -> None:
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                handle.write(bf16_bits(np.ones(shape)).tobytes())
                continue
            for start in range(0, shape[0], ROWS_PER_SLICE):
                rows = min(ROWS_PER_SLICE, shape[0] - start)
                handle.write(bf16_bits(rng.standard_normal((rows, *shape[1:]), dtype=np.float32) * 0.02).tobytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--target", required=True, help="a preset (dspark_export.presets.PRESETS), e.g. qwen3-1.7b, llama-3.2-1b"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shard-gib", type=float, default=2.0)
    args = parser.parse_args()

    from dspark_export.checkpoint import expected_shapes
    from dspark_export.presets import PRESETS, demo_dir

    config = PRESETS[args.target][1].with_dtype("bfloat16")
    args.out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, tuple[int, ...]]] = [{}]
    size = 0
    for name, shape in expected_shapes(config).items():
        tensor_bytes = math.prod(shape) * 2
        if shards[-1] and size + tensor_bytes > args.shard_gib * 2**30:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += tensor_bytes
    rng = np.random.default_rng(0)
    weight_map = {}
    for index, shapes in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        write_shard(args.out / file, shapes, rng)
        weight_map |= {name: file for name in shapes}
        print(f"wrote {file}", flush=True)
    (args.out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
    )
    (args.out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_dir() / name, args.out / name)


if __name__ == "__main__":
    main()
