"""Markdown table of τ per domain and macro-average from `dspark-export eval --json` outputs.

    python scripts/eval_table.py eval-t0.json eval-t1.json

Each file is one eval run over several drafters (the first drafter is the reference of the ratio columns).
"""

from __future__ import annotations

import argparse
import json


def rows_of(file: str) -> tuple[float, list[dict]]:
    report = json.loads(open(file, encoding="utf-8").read())
    results = report["results"] if "results" in report else [report]
    return results[0]["temperature"], results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="`dspark-export eval --json` outputs, one table block each")
    files = parser.parse_args().files
    print(
        "| T | drafter | "
        + " | ".join(["code", "math", "chat", "macro", "first-position acceptance", "τ(first listed) / τ (macro)"])
        + " |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for file in files:
        temperature, results = rows_of(file)
        reference = results[0]
        for result in results:
            domains = result["per_domain"]
            cells = [f"{domains[d]['tau']:.2f}" if d in domains else "-" for d in ("code", "math", "chat")]
            ratio = reference["tau_macro"] / result["tau_macro"]
            print(f"| {temperature:g} | {result['drafter']} | " + " | ".join(cells) +
                  f" | **{result['tau_macro']:.2f}** | {result['first_position_acceptance']:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
