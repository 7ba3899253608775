"""`dspark-run`: the runtime's command line."""

from __future__ import annotations

import json

import click

from dspark_runtime.cli_errors import DSparkGroup


def demo_prompts_file() -> str:
    """The demo's held-out prompt sets, shipped with the exporter's package data."""
    from importlib import resources

    return str(resources.files("dspark_export") / "assets" / "prompts" / "demo.jsonl")


def int_list(ctx: click.Context | None, param: click.Parameter | None, text: str) -> list[int]:
    """click callback: "1,4,8" -> [1, 4, 8]."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise click.BadParameter("values must be positive integers")
    return values


@click.group(cls=DSparkGroup)
def main() -> None:
    """Run DSpark engines (benchmark today; chat, serve, profile and calibrate are being built)."""


@main.command()
@click.argument("engine_dir", required=False, type=click.Path(file_okay=False, exists=True))
@click.option("--prompts", type=click.Path(dir_okay=False, exists=True), default=None, help="JSON-lines prompts (default: the demo's).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Prompts per domain at most.")
@click.option("--modes", default="off,fixed:4", show_default=True, help="Comma-separated: off, fixed:K, sync, async.")
@click.option("--concurrency", default="1", show_default=True, callback=int_list, help="Comma-separated request concurrency levels.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="onnxruntime threads (default: all cores).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object only.")
def bench(engine_dir, prompts, limit, modes, concurrency, max_tokens, temperature, threads, as_json) -> None:
    """Throughput of each speculation mode against `off`, same prompts, one process.

    \b
    Example:
      dspark-run bench --modes off,fixed:2,fixed:4 --concurrency 1,4 --limit 10 --json
    """
    from dspark_runtime.bench import run_benchmark
    from dspark_runtime.engine import Engine
    from dspark_runtime.prompts import read_prompts
    from dspark_runtime.sampling import SamplingParams

    rows = read_prompts(prompts or demo_prompts_file(), limit)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)

    def show(result: dict) -> None:
        if not as_json:
            click.echo(f"{result['mode']:>9} x{result['concurrency']:<3} {result['tokens_per_s']:8.1f} tok/s  "
                       f"tau {result['tau']:.2f}  per-request {result['per_request_tokens_per_s']:.1f} tok/s", err=True)

    with Engine.load(engine_dir, threads=threads) as engine:
        report = run_benchmark(engine, rows, [m.strip() for m in modes.split(",")], concurrency, params, show)
    click.echo(json.dumps(report, indent=None if as_json else 2))


@main.command()
@click.argument("engine_dir", required=False, type=click.Path(file_okay=False, exists=True))
@click.option("--context", type=click.IntRange(min=0), default=256, show_default=True, help="Cached positions per request while timing.")
@click.option("--repeats", type=click.IntRange(min=1), default=7, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None)
def profile(engine_dir, context, repeats, threads) -> None:
    """Measure target step time per batch size and drafter time per request count (hardware_curve.json)."""
    from tqdm import tqdm

    from dspark_runtime.engine import Engine

    with Engine.load(engine_dir, threads=threads, profile=False) as engine:
        total = engine.manifest.max_batch_tokens + (engine.manifest.cache_slots if engine.core.block else 0)
        with tqdm(total=total, desc="profile", unit="size") as bar:
            curve = engine.profile(context, repeats, lambda graph, n: bar.update())
    target = curve["target_seconds"]
    click.echo(f"target: {1e3 * target[0]:.2f} ms at 1 token, {1e3 * target[-1]:.2f} ms at {len(target)} tokens; "
               f"written to {engine.folder / 'hardware_curve.json'}")


@main.command()
@click.argument("engine_dir", required=False, type=click.Path(file_okay=False, exists=True))
@click.option("--prompts", type=click.Path(dir_okay=False, exists=True), default=None, help="JSON-lines prompts (default: the demo's).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Prompts per domain at most.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=1.0, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None)
@click.option("--json", "as_json", is_flag=True)
def calibrate(engine_dir, prompts, limit, max_tokens, temperature, threads, as_json) -> None:
    """Fit Sequential Temperature Scaling on real verification rounds (calibration.json, calibration.png)."""
    from tqdm import tqdm

    from dspark_runtime.calibrate import calibrate as run_calibration
    from dspark_runtime.engine import Engine
    from dspark_runtime.prompts import read_prompts
    from dspark_runtime.sampling import SamplingParams

    rows = read_prompts(prompts or demo_prompts_file(), limit)
    with Engine.load(engine_dir, threads=threads) as engine:
        with tqdm(total=len(rows), desc="calibrate", unit="prompt", disable=as_json) as bar:
            report = run_calibration(engine, rows, SamplingParams(max_tokens=max_tokens, temperature=temperature), True, bar.update)
    if as_json:
        click.echo(json.dumps(report))
    else:
        for name in ("before", "after"):
            click.echo(f"{name:>6}: ECE {[round(100 * e, 2) for e in report[name]['ece']]} %  AUC {report[name]['auc']}")
        click.echo(f"temperatures {report['temperatures']} from {report['rounds']} rounds")
