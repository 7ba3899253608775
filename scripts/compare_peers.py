"""DSpark against `transformers` `generate()` on the same checkpoint, the same prompts, in one process.

    python scripts/compare_peers.py [ENGINE_DIR] --domains code --limit 10 --max-tokens 128 --spec fixed:4

Greedy decoding, one request at a time. For each prompt `transformers` (eager, fp32, the same number of
threads) and the DSpark engine (`off` and `--spec`) generate `--max-tokens` tokens; medians of tokens/s
and the ratios are printed, and greedy outputs are checked to be identical. Needs torch and
transformers (`pip install -e ".[export,test]"`); not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine_dir", nargs="?", default=None)
    parser.add_argument("--domains", default="code", help="comma-separated prompt domains")
    parser.add_argument("--limit", type=int, default=10, help="prompts per domain")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--spec", default="fixed:4")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()

    import torch
    import transformers

    from dspark_export.demo.build import prompts_path
    from dspark_runtime import Engine, SamplingParams
    from dspark_runtime.prompts import read_prompts

    torch.set_num_threads(args.threads)
    rows = [r for r in read_prompts(prompts_path(), args.limit) if r.get("domain") in args.domains.split(",")]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    timings: dict[str, list[float]] = {"transformers": [], "off": [], args.spec: []}
    mismatches = same_as_transformers = 0
    with Engine.load(args.engine_dir, threads=args.threads) as engine:
        from dspark_export.presets import resolve_target

        model_dir = resolve_target(engine.manifest.target_name, None).require_path()
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        engine.generate(rows[0]["prompt"], SamplingParams(max_tokens=4, temperature=0.0), spec=args.spec)  # warm-up
        for row in rows:
            ids = engine.tokenizer.encode(row["prompt"])
            outputs = {}
            for mode in ("off", args.spec):
                started = time.perf_counter()
                outputs[mode] = engine.generate(ids, params, spec=mode).token_ids
                timings[mode].append(len(outputs[mode]) / (time.perf_counter() - started))
            with torch.no_grad():
                started = time.perf_counter()
                generated = model.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                                           do_sample=False, pad_token_id=0)
                seconds = time.perf_counter() - started
            reference = generated[0, len(ids):].tolist()
            timings["transformers"].append(len(reference) / seconds)
            mismatches += outputs["off"] != outputs[args.spec]
            same_as_transformers += outputs["off"] == reference
            print(f"{row['domain']:5s} transformers {timings['transformers'][-1]:6.1f}  off {timings['off'][-1]:6.1f}  "
                  f"{args.spec} {timings[args.spec][-1]:6.1f} tok/s", flush=True)
    medians = {name: float(np.median(values)) for name, values in timings.items()}
    print(json.dumps({
        "prompts": len(rows), "domains": args.domains, "max_tokens": args.max_tokens, "threads": args.threads,
        "median_tokens_per_s": {k: round(v, 1) for k, v in medians.items()},
        f"{args.spec}_vs_off": round(medians[args.spec] / medians["off"], 2),
        f"{args.spec}_vs_transformers": round(medians[args.spec] / medians["transformers"], 2),
        "off_vs_transformers": round(medians["off"] / medians["transformers"], 2),
        "greedy_outputs_identical_off_vs_spec": mismatches == 0,
        "prompts_where_transformers_greedy_equals_dspark": same_as_transformers,
    }, indent=2))


if __name__ == "__main__":
    main()
