"""`dspark-run`: the runtime's command line."""

from __future__ import annotations

import click

from dspark_runtime.cli_errors import DSparkGroup


@click.group(cls=DSparkGroup)
def main() -> None:
    """Run DSpark engines: chat, serve, benchmark, profile and calibrate (commands arrive with the runtime)."""
