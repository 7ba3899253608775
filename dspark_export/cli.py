"""`dspark-export`: inspect targets (and, as they land, train drafters and build engines)."""

from __future__ import annotations

import json

import click

from dspark_export.presets import KNOWN_TARGETS
from dspark_runtime.cli_errors import DSparkGroup


def target_options(command):
    """`--target NAME` and `--target-path DIR`, shared by every command that loads a target."""
    command = click.option("--target-path", type=click.Path(file_okay=False, path_type=str), default=None,
                           help="Hugging Face model folder (config.json + safetensors); never downloaded.")(command)
    return click.option("--target", type=click.Choice(KNOWN_TARGETS), default=None,
                        help="Named architecture; weights from --target-path or the local Hugging Face cache.")(command)


@click.group(cls=DSparkGroup)
def main() -> None:
    """Export Qwen3 targets and DSpark drafters for the DSpark runtime."""


@main.command()
@target_options
@click.option("--slots", type=click.IntRange(min=1), default=1, show_default=True, help="Concurrent requests (KV cache slots).")
@click.option("--context", type=click.IntRange(min=1), default=4096, show_default=True, help="Tokens per slot.")
@click.option("--kv-dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="KV cache precision (default: the weights').")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(target: str | None, target_path: str | None, slots: int, context: int, kv_dtype: str | None, as_json: bool) -> None:
    """Show a target's architecture, size and the memory for weights plus a KV cache.

    \b
    Examples:
      dspark-export inspect --target qwen3-8b --slots 4 --context 8192
      dspark-export inspect --target-path ~/models/Qwen3-4B
    Library: dspark_export.inspect.describe_target(resolve_target(target, target_path), slots, context)
    """
    from dspark_export.inspect import describe_target, format_report
    from dspark_export.presets import resolve_target

    report = describe_target(resolve_target(target, target_path), slots, context, kv_dtype)
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))
