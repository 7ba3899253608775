"""Error of the fp16 and bf16 target graphs against the torch fp32 reference, on held-out demo prompts.

    python scripts/precision_report.py [--prompts 6] [--work build/precision]

Builds `target.onnx` in float32 and float16 and runs them on ONNX Runtime (CPU) over whole prompts
(prefill); compares the logits with the torch model in float32: max and mean absolute error, and how
often the argmax agrees. ONNX Runtime's CPU provider runs many float16 ops through inserted casts to
float32, so its float16 row is an optimistic bound for a GPU; it has no bfloat16 kernels at all, so the
bf16 row is the torch model run in bfloat16 (what a bf16 engine computes, up to kernel differences).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def run_graph(graph: Path, ids: list[int], config) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(graph))
    cache_type = np.float16 if "float16" in session.get_inputs()[5].type else np.float32
    shape = (1, config.num_key_value_heads, len(ids), config.head_dim)
    feeds = {"input_ids": np.asarray(ids), "pos": np.arange(len(ids)), "slot": np.zeros(len(ids), np.int64),
             "cache_len": np.zeros(1, np.int64), "logit_index": np.arange(len(ids))}
    for layer in range(config.num_hidden_layers):
        feeds[f"past_key_{layer}"] = feeds[f"past_value_{layer}"] = np.zeros(shape, cache_type)
    return session.run(["logits"], feeds)[0]


def main() -> None:
    import torch

    from dspark_export.build import build_engine
    from dspark_runtime.prompts import demo_prompts_path
    from dspark_export.loading import load_target
    from dspark_export.presets import resolve_target
    from dspark_runtime.prompts import read_prompts

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6, help="prompts per domain")
    parser.add_argument("--work", type=Path, default=Path("build/precision"))
    args = parser.parse_args()
    spec = resolve_target("demo")
    model, tokenizer = load_target(spec)
    rows = read_prompts(demo_prompts_path(), args.prompts)
    graphs = {dtype: build_engine(spec, args.work / dtype, dtype=dtype, force=True, show_progress=False) / "target.onnx"
              for dtype in ("float32", "float16")}
    errors: dict[str, list] = {"onnx float32": [], "onnx float16": [], "torch bfloat16": []}
    for row in rows:
        ids = tokenizer.encode(row["prompt"])
        with torch.no_grad():
            reference = model(torch.tensor([ids])).logits[0].float().numpy()
            bf16 = model.to(torch.bfloat16)(torch.tensor([ids])).logits[0].float().numpy()
            model.float()
        candidates = {"onnx float32": run_graph(graphs["float32"], ids, spec.config),
                      "onnx float16": run_graph(graphs["float16"], ids, spec.config), "torch bfloat16": bf16}
        for name, logits in candidates.items():
            diff = np.abs(logits.astype(np.float64) - reference)
            errors[name].append((diff.max(), diff.mean(), (logits.argmax(-1) == reference.argmax(-1)).mean()))
    report = {name: {"max_abs_error": float(max(e[0] for e in rows_)), "mean_abs_error": float(np.mean([e[1] for e in rows_])),
                     "argmax_agreement": float(np.mean([e[2] for e in rows_]))} for name, rows_ in errors.items()}
    print(json.dumps({"prompts": len(rows), "reference": "torch float32 logits"} | report, indent=2))


if __name__ == "__main__":
    main()
