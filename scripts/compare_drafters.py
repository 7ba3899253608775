"""Drafters compared the way users choose: end-to-end speed, one engine per drafter, in one run.

    python scripts/compare_drafters.py demo-dspark demo-eagle3 demo-eagle3@3 --limit 10 --rounds 3 --work build/compare

For each drafter (a folder or bundled name, any layout `build` reads; `NAME@K` builds an EAGLE-3 drafter
unrolled K steps a round, as `build --gamma K` does): an engine for the demo target at
`--weights`, its speed curve (measured on first load), and for drafters with a confidence head an STS fit per
temperature on held-out prompts the benchmark does not use (the first `--skip` of each domain). Then, per
temperature and domain, the `--limit` prompts after those (each generation ends at the end-of-sequence token or
`--max-tokens`, as a user sees it: past the end the target writes text no drafter was trained on, most of a
math answer's 128 tokens) through `off`, `fixed:K` for each K of
`--fixed` and `async` (`--rounds` rounds in turn; medians, ratios within rounds). Prints a Markdown table per
temperature, a row per drafter and domain and a macro row: τ and the drafter's share of a step at `fixed:γ`,
`off`, the best `fixed:K` and `async` in tokens/s and against `off`, and the best of those modes against `off` and
against the first drafter named; `--json FILE` keeps every figure, `--table FILE [NAME ...]` prints its tables again.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

DOMAINS = ("code", "math", "chat")


def bench_drafter(name: str, args) -> dict:
    """{temperature: {domain: {mode: figures}}} for one drafter (`NAME@K`: an EAGLE-3 drafter unrolled K steps)."""
    from dspark_export.build import build_engine
    from dspark_export.drafters.bundled import resolve_drafter
    from dspark_export.graphs.weights import WeightFormat
    from dspark_export.presets import resolve_target
    from dspark_runtime import Engine, OrtBackend, SamplingParams
    from dspark_runtime.bench import run_benchmark
    from dspark_runtime.calibrate import calibrate
    from dspark_common.prompts import demo_prompts_path, read_prompts

    drafter, _, gamma = name.partition("@")
    folder = args.work / Path(name).name
    if not (folder / "manifest.json").is_file():
        build_engine(resolve_target("demo"), folder, resolve_drafter(drafter), Path(drafter).name, show_progress=False,
                     weights=WeightFormat(args.weights), gamma=int(gamma) if gamma else None)
    rows = read_prompts(demo_prompts_path(), args.limit, args.skip)
    by_domain = {d: [r for r in rows if r.get("domain") == d] for d in DOMAINS}
    held_out = read_prompts(demo_prompts_path(), args.skip)
    figures: dict = {}
    with Engine.load(folder, OrtBackend(args.threads)) as engine:
        gamma = engine.gamma
        if engine.manifest.drafter.get("confidence"):
            for temperature in args.temperatures:
                params = SamplingParams(max_tokens=256, temperature=temperature)
                calibrate(engine, held_out, params, plot=False)
        modes = ["off", *(f"fixed:{k}" for k in args.fixed if k <= gamma), "async"]
        for temperature in args.temperatures:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature)
            for domain in DOMAINS:
                report = run_benchmark(engine, by_domain[domain], modes, [1], params, rounds=args.rounds)
                figures.setdefault(temperature, {})[domain] = {r["mode"]: r for r in report["results"]}
                print(f"{name} T={temperature:g} {domain}: " + ", ".join(
                    f"{r['mode']} {r['tokens_per_s']:.0f}" for r in report["results"]), file=sys.stderr)
    return {"gamma": gamma, "by_temperature": figures}


def summarize(results: dict) -> dict:
    """Per drafter and temperature, per domain and macro: τ and drafter share at fixed:γ, the best fixed:K, async and
    the better of the two. The macro row averages each mode over the domains and then picks, as a user who sets one
    mode for every prompt would (a per-domain row picks within its domain)."""
    table = {}
    for name, result in results.items():
        gamma = result["gamma"]
        for temperature, domains in result["by_temperature"].items():
            macro_modes = {mode: {key: float(np.mean([domains[d][mode][key] for d in domains]))
                                  for key in ("tokens_per_s", "ratio_to_off", "tau", "drafter_share_of_step_time")}
                           for mode in domains[DOMAINS[0]]}
            table.setdefault(float(temperature), {})[name] = {
                "domains": {domain: row_of(modes, gamma) for domain, modes in domains.items()},
                "macro": row_of(macro_modes, gamma)}
    return table


def row_of(modes: dict, gamma: int) -> dict:
    """τ and drafter share at fixed:γ, `off`, the best fixed:K and async (tokens/s, ratio to off), the better one."""
    fixed = {m: r for m, r in modes.items() if m.startswith("fixed:")}
    best = max(fixed, key=lambda m: fixed[m]["ratio_to_off"])
    full = fixed.get(f"fixed:{gamma}", fixed[best])
    return {"tau": full["tau"], "drafter_share": full["drafter_share_of_step_time"],
            "off": modes["off"]["tokens_per_s"], "best_fixed": best,
            "best_fixed_tokens_per_s": fixed[best]["tokens_per_s"], "best_fixed_ratio": fixed[best]["ratio_to_off"],
            "async_tokens_per_s": modes["async"]["tokens_per_s"], "async_ratio": modes["async"]["ratio_to_off"],
            "best_mode_tokens_per_s": max(fixed[best]["tokens_per_s"], modes["async"]["tokens_per_s"]),
            "best_mode_ratio": max(fixed[best]["ratio_to_off"], modes["async"]["ratio_to_off"])}


def markdown(table: dict) -> str:
    """Per temperature, one row per drafter and domain and one for the macro average. Drafters are compared by
    their best mode's ratio to their own `off`: every engine runs the same target, and a ratio taken within
    rounds is immune to the machine's drift between engines measured minutes apart."""
    lines = []
    for temperature, drafters in table.items():
        first = next(iter(drafters))
        lines += [f"\nT={temperature:g}\n",
                  "| drafter | domain | τ at fixed:γ | drafter share | `off` tok/s | best `fixed:K` tok/s (x off) | "
                  f"`async` tok/s (x off) | best mode x off | x {first} |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, row in drafters.items():
            for domain, cells in [*row["domains"].items(), ("macro", row["macro"])]:
                reference = drafters[first]["domains"].get(domain, drafters[first]["macro"])
                best = f" `{cells['best_fixed']}`"
                bold = "**" if domain == "macro" else ""
                lines.append(f"| {name} | {domain} | {cells['tau']:.2f} | {cells['drafter_share']:.2f} | "
                             f"{cells['off']:.0f} | {cells['best_fixed_tokens_per_s']:.0f}{best} "
                             f"({cells['best_fixed_ratio']:.2f}x) | {cells['async_tokens_per_s']:.0f} "
                             f"({cells['async_ratio']:.2f}x) | {cells['best_mode_ratio']:.2f}x | "
                             f"{bold}{cells['best_mode_ratio'] / reference['best_mode_ratio']:.2f}x{bold} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafters", nargs="*", help="with --table: the drafters to show, in order (default: all)")
    parser.add_argument("--table", type=Path, default=None, help="print the tables of an earlier --json run only")
    parser.add_argument("--weights", default="fp32", choices=["fp32", "int8", "int4"])
    parser.add_argument("--limit", type=int, default=10, help="benchmark prompts per domain")
    parser.add_argument("--skip", type=int, default=30, help="prompts per domain for STS, before the benchmark's")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=3)
    parser.add_argument("--temperatures", type=lambda s: [float(t) for t in s.split(",")], default=[0.0, 1.0])
    parser.add_argument("--fixed", type=lambda s: [int(k) for k in s.split(",")], default=[1, 2, 3, 5, 7])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--work", type=Path, default=Path("build/compare"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.table:
        results = json.loads(args.table.read_text())["results"]
        print(markdown(summarize({name: results[name] for name in args.drafters or results})))
        return
    results = {Path(name).name: bench_drafter(name, args) for name in args.drafters}
    table = summarize(results)
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "results": results,
                                         "table": table}, indent=1))
    print(markdown(table))


if __name__ == "__main__":
    main()
