"""`dspark-run bench`: the same prompts through every speculation mode and concurrency, in one process."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Callable

import numpy as np

from dspark_runtime.engine import Engine, Prompt
from dspark_common.sampling import SamplingParams


def prompt_of(row: dict) -> Prompt:
    return row["messages"] if "messages" in row else row["prompt"]


def run_mode(engine: Engine, rows: list[dict], params: SamplingParams, spec: str, concurrency: int) -> dict:
    """All prompts with at most `concurrency` in flight; aggregate and per-request figures."""
    return _summary(spec, concurrency, *_run(engine, rows, params, spec, concurrency))


def run_interleaved(engine: Engine, rows: list[dict], params: SamplingParams, modes: list[str]) -> list[dict]:
    """One request at a time, every mode on a prompt before the next prompt (the order rotating), so that the
    machine's drift lands on all modes alike; one figure per mode, as `run_mode` gives it."""
    parts = {mode: ([], 0.0, dict.fromkeys(_counters(engine), 0.0)) for mode in modes}
    for index, row in enumerate(rows):
        shift = index % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            results, elapsed, spent = _run(engine, [row], params, mode, 1, first_seed=index)
            done, total, parts_spent = parts[mode]
            parts[mode] = (done + results, total + elapsed, {k: parts_spent[k] + spent[k] for k in spent})
    return [_summary(mode, 1, *parts[mode]) for mode in modes]


def _run(engine: Engine, rows: list[dict], params: SamplingParams, spec: str, concurrency: int,
         first_seed: int = 0) -> tuple[list, float, dict[str, float]]:
    """(completions, wall seconds, step-loop seconds by part and the gate's decisions) of the prompts with at most
    `concurrency` in flight."""
    gate = threading.Semaphore(concurrency)
    results: list = [None] * len(rows)

    def worker(index: int) -> None:
        try:
            seed = first_seed + index if params.seed is None else params.seed + index
            results[index] = engine.generate(prompt_of(rows[index]), replace(params, seed=seed), spec=spec,
                                             truncate=True)
        finally:
            gate.release()

    threads = []
    before = _counters(engine)
    started = time.perf_counter()
    for index in range(len(rows)):
        gate.acquire()
        thread = threading.Thread(target=worker, args=(index,))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    return results, elapsed, {part: value - before[part] for part, value in _counters(engine).items()}


def _counters(engine: Engine) -> dict[str, float]:
    """The step loop's seconds by part and the draft gate's counts (`Engine.gate_steps`, keyed `gate_<kind>`)."""
    return engine.step_seconds() | {f"gate_{kind}": float(n) for kind, n in engine.gate_steps().items()}


def _summary(spec: str, concurrency: int, results: list, elapsed: float, spent: dict[str, float]) -> dict:
    """One mode's figures from its completions, its wall time and the step loop's seconds by part."""
    share = {part: spent[part] / spent["step"] if spent["step"] else 0.0 for part in ("schedule", "target", "drafter")}
    generated = sum(len(r.token_ids) for r in results)
    steps = sum(r.stats.steps for r in results)
    return {
        "mode": spec,
        "concurrency": concurrency,
        "tokens_per_s": generated / elapsed,
        "per_request_tokens_per_s": float(
            np.median([r.stats.tokens_per_s for r in results if r.stats.tokens_per_s] or [0.0])
        ),
        "tau": generated / steps if steps else 0.0,
        "steps": steps,
        "generated_tokens": generated,
        "seconds": elapsed,
        "accepted_per_step": float(np.mean([r.stats.accepted_per_step for r in results])),
        "scheduler_share_of_step_time": share["schedule"],
        "target_share_of_step_time": share["target"],
        "drafter_share_of_step_time": share["drafter"],
        "gate_steps": {key.removeprefix("gate_"): int(n) for key, n in spent.items() if key.startswith("gate_")},
    }


def run_benchmark(engine: Engine, rows: list[dict], modes: list[str], concurrencies: list[int], params: SamplingParams,
                  progress: Callable[[dict], None] | None = None, rounds: int = 1) -> dict:
    """Every (mode, concurrency) pair; `ratio_to_off` against `off` at the same concurrency when measured.

    With `rounds` > 1 the modes run in turn, round after round, and each figure is the median over the
    rounds; a ratio is taken within its round first (`ratio_to_off_by_round`), so that the machine's drift
    between rounds does not land on one mode. One request at a time, the modes take turns prompt by prompt
    (`run_interleaved`).
    """
    engine.generate(prompt_of(rows[0]), replace(params, max_tokens=4), spec=modes[0], truncate=True)  # warm-up
    results = []
    for concurrency in concurrencies:
        measured = []
        for _ in range(rounds):
            measured.append(run_interleaved(engine, rows, params, modes) if concurrency == 1 else
                            [run_mode(engine, rows, params, mode, concurrency) for mode in modes])
            for result in measured[-1]:
                _add_ratios(result, measured[-1])
                if progress:
                    progress(result)
        results += [_median_of(list(by_mode)) for by_mode in zip(*measured)]
    return {"engine": str(engine.folder), "prompts": len(rows), "max_tokens": params.max_tokens,
            "temperature": params.temperature, "rounds": rounds, "results": results}


def _add_ratios(result: dict, same_round: list[dict]) -> None:
    base = next((r for r in same_round if r["mode"] == "off"), None)
    result["ratio_to_off"] = result["tokens_per_s"] / base["tokens_per_s"] if base else None
    # the ceiling of a drafter that cost nothing and drafted as well: the same run less its drafter time
    result["ratio_with_free_drafter"] = (
        result["ratio_to_off"] / (1 - result["drafter_share_of_step_time"]) if base else None
    )


def _median_of(runs: list[dict]) -> dict:
    """One mode's rounds -> the median of every figure, with the per-round ratios kept."""
    merged = {key: (float(np.median([r[key] for r in runs])) if isinstance(value, float) else value)
              for key, value in runs[0].items()}
    merged["ratio_to_off_by_round"] = [r["ratio_to_off"] for r in runs]
    merged["gate_steps"] = {kind: sum(r["gate_steps"][kind] for r in runs) for kind in runs[0]["gate_steps"]}
    return merged


def plot_frontier(report: dict, file: str) -> bool:
    """Aggregate vs per-request tokens/s, one line per mode across concurrencies; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axis = plt.subplots(figsize=(6.5, 4.5), dpi=120)
    for mode in dict.fromkeys(r["mode"] for r in report["results"]):
        points = sorted((r for r in report["results"] if r["mode"] == mode), key=lambda r: r["concurrency"])
        axis.plot(
            [r["per_request_tokens_per_s"] for r in points], [r["tokens_per_s"] for r in points], marker="o", label=mode
        )
        for r in points:
            axis.annotate(str(r["concurrency"]), (r["per_request_tokens_per_s"], r["tokens_per_s"]), fontsize=7,
                          textcoords="offset points", xytext=(3, 3))
    axis.set_xlabel("per-request tokens/s (median)")
    axis.set_ylabel("aggregate tokens/s")
    axis.set_title(f"throughput vs per-request speed (T={report['temperature']:g}; labels: concurrency)")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(file)
    plt.close(figure)
    return True
