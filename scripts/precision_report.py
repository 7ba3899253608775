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


def run_graph(engine: Path, ids: list[int]) -> np.ndarray:
    """The logits of a whole prompt run as one prefill step through an engine's target graph."""
    from dspark_runtime.backend import open_graphs
    from dspark_runtime.batches import TargetBatch
    from dspark_runtime.engine_dir import read_manifest

    graph, _ = open_graphs(engine, read_manifest(engine), "ort")
    batch = TargetBatch(np.asarray(ids), np.arange(len(ids)), np.zeros(len(ids)), np.zeros(1), np.arange(len(ids)))
    return graph.run(batch.feeds(graph.io))["logits"]


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
    engines = {dtype: build_engine(spec, args.work / dtype, dtype=dtype, cache_slots=1, max_context=1024, force=True,
                                   show_progress=False) for dtype in ("float32", "float16")}
    errors: dict[str, list] = {"onnx float32": [], "onnx float16": [], "torch bfloat16": []}
    for row in rows:
        ids = tokenizer.encode(row["prompt"])
        with torch.no_grad():
            reference = model(torch.tensor([ids])).logits[0].float().numpy()
            bf16 = model.to(torch.bfloat16)(torch.tensor([ids])).logits[0].float().numpy()
            model.float()
        candidates = {"onnx float32": run_graph(engines["float32"], ids), "onnx float16": run_graph(engines["float16"], ids),
                      "torch bfloat16": bf16}
        for name, logits in candidates.items():
            diff = np.abs(logits.astype(np.float64) - reference)
            errors[name].append((diff.max(), diff.mean(), (logits.argmax(-1) == reference.argmax(-1)).mean()))
    report = {name: {"max_abs_error": float(max(e[0] for e in rows_)), "mean_abs_error": float(np.mean([e[1] for e in rows_])),
                     "argmax_agreement": float(np.mean([e[2] for e in rows_]))} for name, rows_ in errors.items()}
    print(json.dumps({"prompts": len(rows), "reference": "torch float32 logits"} | report, indent=2))


if __name__ == "__main__":
    main()
