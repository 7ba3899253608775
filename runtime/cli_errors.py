"""Click plumbing shared by both CLIs: a DSparkError becomes one `error:` line and exit code 1."""

from __future__ import annotations

import os

import click

from dspark_runtime.errors import DSparkError


class DSparkGroup(click.Group):
    """A click group whose commands report DSparkError as one line (set DSPARK_DEBUG=1 for the traceback)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except DSparkError as exc:
            if os.environ.get("DSPARK_DEBUG"):
                raise
            raise click.ClickException(str(exc)) from None
