"""What the draft gate adds to the paper's schedulers: `sync` and `async` with the gate, and with it forced
open (drafting every step, as in the paper), on the same prompts in one process.

    python scripts/gate_ablation.py ENGINE_DIR --concurrency 1,4,8 --temperature 1 --limit 11 --max-tokens 64

The engine needs hardware_curve.json (`dspark-run profile`) and preferably calibration.json. `off` is measured
alongside for reference. Prints one JSON object: aggregate and per-request tokens/s and τ per mode and load.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine_dir")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--limit", type=int, default=11, help="prompts per domain")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    from dspark_runtime import Engine, OrtBackend, SamplingParams
    from dspark_runtime.bench import run_mode
    from dspark_common.prompts import demo_prompts_path, read_prompts

    rows = read_prompts(demo_prompts_path(), args.limit)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    results = []
    with Engine.load(args.engine_dir, OrtBackend(args.threads, shared_pool=True)) as engine:
        engine.generate(
            rows[0]["prompt"], SamplingParams(max_tokens=4, temperature=args.temperature), spec="sync"
        )  # warm-up
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for mode, gated in (("off", True), ("sync", True), ("sync", False), ("async", True), ("async", False)):
                engine.set_draft_gate(gated)
                result = run_mode(engine, rows, params, mode, concurrency)
                label = mode if mode == "off" else f"{mode}{'' if gated else ' (gate open)'}"
                results.append(
                    {
                        "mode": label,
                        "concurrency": concurrency,
                        **{k: round(result[k], 2) for k in ("tokens_per_s", "per_request_tokens_per_s", "tau")},
                    }
                )
                print(json.dumps(results[-1]), flush=True)
    print(
        json.dumps(
            {"temperature": args.temperature, "prompts": len(rows), "max_tokens": args.max_tokens, "results": results}
        )
    )


if __name__ == "__main__":
    main()
