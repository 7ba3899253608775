"""How closely quantized engines follow the fp32 engine of the same checkpoint: greedy tokens before the first
divergence (prompts x tokens, plain decoding), and teacher-forced next-token argmax agreement and KL(fp32 || engine)
along the fp32 engine's own continuations.

    python scripts/weight_agreement.py [--target-path DIR] [--weights int4,w8a8] [--prompts 10] [--max-tokens 64]
    python scripts/weight_agreement.py --outliers 100   # the same on a massive-activation checkpoint (below)

`--outliers C` first rewrites the checkpoint into one that computes the same function (in exact arithmetic) but
whose projections see massive input channels, as real Qwen3 and Llama checkpoints do: in every layer, `--channels`
channels of the normed inputs of q/k/v and gate/up are C times larger (the norm weight times C, the weights' columns
over C), and so are as many channels of the down_proj input (up_proj's rows times C, down_proj's columns over C) and
of the o_proj input (v_proj's rows times C, o_proj's columns over C).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np


def with_outliers(folder: Path, out: Path, factor: float, channels: int) -> Path:
    """A float32 copy of the checkpoint in `folder` with massive input channels in every projection (see above)."""
    from safetensors.numpy import save_file

    from dspark_export.checkpoint import Checkpoint
    from dspark_export.config import DecoderConfig

    config = DecoderConfig.from_dir(folder)
    checkpoint = Checkpoint(folder, config)
    tensors = {name: checkpoint.float32(name) for name in checkpoint.tensors}
    rng = np.random.default_rng(0)
    group = config.num_attention_heads // config.num_key_value_heads
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        for norm, projections in (("input_layernorm", ("q_proj", "k_proj", "v_proj")),
                                  ("post_attention_layernorm", ("gate_proj", "up_proj"))):
            picked = rng.choice(config.hidden_size, channels, replace=False)
            tensors[p + norm + ".weight"][picked] *= factor
            for name in projections:
                part = "self_attn." if name.endswith(("q_proj", "k_proj", "v_proj")) else "mlp."
                tensors[p + part + name + ".weight"][:, picked] /= factor
        picked = rng.choice(config.intermediate_size, channels, replace=False)
        tensors[p + "mlp.up_proj.weight"][picked] *= factor
        tensors[p + "mlp.down_proj.weight"][:, picked] /= factor
        d = config.head_dim
        for value_row in rng.choice(config.num_key_value_heads * d, channels, replace=False):
            head, dim = divmod(int(value_row), d)
            tensors[p + "self_attn.v_proj.weight"][value_row] *= factor
            for q_head in range(head * group, (head + 1) * group):
                tensors[p + "self_attn.o_proj.weight"][:, q_head * d + dim] /= factor
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for file in folder.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and file.name != "model.safetensors.index.json":
            shutil.copy(file, out / file.name)
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(raw | {"torch_dtype": "float32", "dtype": "float32"}, indent=2))
    return out


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def main() -> None:
    from dspark_export.build import build_engine
    from dspark_export.graphs.weights import WeightFormat
    from dspark_export.presets import resolve_target
    from dspark_common.cpu import int8_code_max
    from dspark_common.prompts import demo_prompts_path, read_prompts
    from dspark_common.sampling import SamplingParams
    from dspark_runtime.backend import OrtBackend
    from dspark_runtime.engine import Engine
    from precision_report import run_graph  # scripts/ beside this one

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-path", type=Path, default=None, help="HF checkpoint (default: the bundled demo)")
    parser.add_argument("--weights", default="int4,w8a8,w8a8+smooth",
                        help="formats to hold against fp32 (w8a8+smooth: with SmoothQuant)")
    parser.add_argument("--prompts", type=int, default=10, help="prompts per domain")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--outliers", type=float, default=None, help="make input channels this much larger first")
    parser.add_argument("--channels", type=int, default=4, help="massive channels per projection input")
    parser.add_argument("--work", type=Path, default=Path("build/agreement"))
    args = parser.parse_args()
    spec = resolve_target("demo" if args.target_path is None else None, args.target_path)
    if args.outliers:
        folder = with_outliers(spec.require_path(), args.work / "outliers", args.outliers, args.channels)
        spec = resolve_target(None, folder)
    engines = {}
    for name in ["fp32", *args.weights.split(",")]:
        fmt, _, smooth = name.partition("+")  # w8a8+smooth: SmoothQuant first (`dspark-export build --smooth`)
        engines[name] = build_engine(spec, args.work / name, cache_slots=1, max_context=1024, force=True,
                                     show_progress=False, weights=WeightFormat(fmt, code_max=int8_code_max()),
                                     smooth=smooth == "smooth")
    rows = read_prompts(demo_prompts_path(), args.prompts)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}
    logits: dict[str, list[np.ndarray]] = {}
    for name, folder in engines.items():
        with Engine.load(folder, OrtBackend(), profile=False) as engine:
            prompts = [engine.tokenizer.encode(row["prompt"]) for row in rows]
            outputs[name] = [engine.generate(p, greedy, spec="off").token_ids for p in prompts]
        logits[name] = [run_graph(folder, p + outputs["fp32"][i])[len(p) - 1 : -1] for i, p in enumerate(prompts)]
    report = {"prompts": len(rows), "max_tokens": args.max_tokens, "outliers": args.outliers,
              "channels": args.channels if args.outliers else None}
    for name in engines:
        if name == "fp32":
            continue
        before = [first_divergence(a, b) for a, b in zip(outputs[name], outputs["fp32"])]
        reference = np.concatenate(logits["fp32"])
        mine = np.concatenate(logits[name])
        p = log_softmax(reference)
        report[name] = {
            "tokens_before_divergence": round(float(np.mean(before)), 2),
            "identical_prompts": sum(b == args.max_tokens for b in before),
            "argmax_agreement": round(float((mine.argmax(-1) == reference.argmax(-1)).mean()), 4),
            "kl_from_fp32": float((np.exp(p) * (p - log_softmax(mine))).sum(-1).mean()),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
