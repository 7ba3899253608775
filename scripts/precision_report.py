"""Error of the fp16, int8 and int4 target graphs (and bf16) against the torch fp32 reference, on held-out
demo prompts.

    python scripts/precision_report.py [--prompts 6] [--work build/precision]

Builds engines with fp32, fp16, int8 and int4 weights and runs their target graphs on ONNX Runtime (CPU) over
whole prompts (prefill); compares the logits with the torch model in float32: max and mean absolute error, how
often the argmax agrees, and the next-token loss per domain (nats/token, the reference's beside it). ONNX
Runtime's CPU provider runs many float16 ops through inserted casts to float32, so its float16 row is an
optimistic bound for a GPU; it has no bfloat16 kernels at all, so the bf16 row is the torch model run in
bfloat16 (what a bf16 engine computes, up to kernel differences).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def run_graph(engine: Path, ids: list[int]) -> np.ndarray:
    """The logits of a whole prompt run as one prefill step through an engine's target graph."""
    from dspark_runtime.backend import OrtBackend
    from dspark_runtime.batches import TargetBatch
    from dspark_common.engine_dir import read_manifest

    graph, _ = OrtBackend().open(engine, read_manifest(engine))
    batch = TargetBatch(np.asarray(ids), np.arange(len(ids)), np.zeros(len(ids), np.int64), np.zeros(1, np.int64),
                        np.arange(len(ids)))
    return graph.run(batch)["logits"]


def main() -> None:
    import torch

    from dspark_export.build import build_engine
    from dspark_export.graphs.weights import WeightFormat
    from dspark_common.prompts import demo_prompts_path
    from dspark_export.loading import load_target
    from dspark_export.presets import resolve_target
    from dspark_common.prompts import read_prompts

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6, help="prompts per domain")
    parser.add_argument("--work", type=Path, default=Path("build/precision"))
    args = parser.parse_args()
    spec = resolve_target("demo")
    model, tokenizer = load_target(spec)
    rows = read_prompts(demo_prompts_path(), args.prompts)
    engines = {
        f"onnx {weights}": build_engine(
            spec,
            args.work / weights,
            dtype=dtype,
            cache_slots=1,
            max_context=1024,
            force=True,
            show_progress=False,
            weights=WeightFormat(weights),
        )
        for weights, dtype in (("fp32", "float32"), ("fp16", "float16"), ("int8", "float32"), ("int4", "float32"))
    }
    errors: dict[str, list] = {name: [] for name in [*engines, "torch bfloat16", "reference"]}
    for row in rows:
        ids = tokenizer.encode(row["prompt"])
        with torch.no_grad():
            reference = model(torch.tensor([ids])).logits[0].float().numpy()
            bf16 = model.to(torch.bfloat16)(torch.tensor([ids])).logits[0].float().numpy()
            model.float()
        candidates = {name: run_graph(engine, ids) for name, engine in engines.items()} | {"torch bfloat16": bf16,
                                                                                         "reference": reference}
        for name, logits in candidates.items():
            diff = np.abs(logits.astype(np.float64) - reference)
            errors[name].append((diff.max(), diff.mean(), (logits.argmax(-1) == reference.argmax(-1)).mean(),
                                 next_token_loss(logits, ids), row.get("domain", "all")))
    report = {}
    for name, results in errors.items():
        domains = sorted({r[4] for r in results})
        loss = {d: round(float(np.mean([r[3] for r in results if r[4] == d])), 4) for d in domains}
        report[name] = (
            {"loss_per_domain": loss}
            if name == "reference"
            else {
                "max_abs_error": float(max(r[0] for r in results)),
                "mean_abs_error": float(np.mean([r[1] for r in results])),
                "argmax_agreement": float(np.mean([r[2] for r in results])),
                "loss_per_domain": loss,
            }
        )
    print(json.dumps({"prompts": len(rows), "reference": "torch float32 logits"} | report, indent=2))


def next_token_loss(logits: np.ndarray, ids: list[int]) -> float:
    """Mean cross-entropy (nats) of each prompt token given the ones before it."""
    shifted = logits[:-1].astype(np.float64)
    shifted -= shifted.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return float(-log_probs[np.arange(len(ids) - 1), ids[1:]].mean())


if __name__ == "__main__":
    main()
