"""Click plumbing shared by both CLIs: a DSparkError becomes one `error:` line and exit code 1; prompt files; sizes."""

from __future__ import annotations

import functools
import os

import click

from dspark_common.errors import DSparkError


EXTRAS = {"torch": "export", "matplotlib": "export", "starlette": "serve", "uvicorn": "serve", "tensorrt": "trt",
          "polygraphy": "trt", "triton": "trt"}  # optional module -> the extra that installs it


class OneLineUsageError(click.ClickException):
    """A usage error as one `Error:` line, with a usage error's exit status."""

    exit_code = 2


class DSparkGroup(click.Group):
    """A click group whose commands report usage errors and DSparkError as one line (DSPARK_DEBUG=1: the traceback),
    as they do a missing optional package (naming the extra that installs it), and that answers `--version`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        click.version_option(package_name="dspark", message="%(prog)s (DSpark) %(version)s")(self)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:  # click's own is four lines: usage, a hint, a blank, the error
            if os.environ.get("DSPARK_DEBUG"):
                raise
            where = exc.ctx.command_path if exc.ctx else ctx.command_path
            raise OneLineUsageError(f"{exc.format_message()} (`{where} --help` lists the options)") from None
        except DSparkError as exc:
            if os.environ.get("DSPARK_DEBUG"):
                raise
            raise click.ClickException(str(exc)) from None
        except ModuleNotFoundError as exc:
            extra = EXTRAS.get((exc.name or "").split(".")[0])
            if extra is None or os.environ.get("DSPARK_DEBUG"):
                raise
            hint = " (torch==2.13.0 first: a bare `torch` is a multi-GB CUDA build)" if extra == "export" else ""
            raise click.ClickException(f"this command needs {exc.name}: pip install 'dspark[{extra}]'{hint}") from None


def prompt_options(command):
    """`--prompts FILE` (default: the demo's held-out prompts), `--limit N` and `--skip N` of each domain; the
    command receives the chosen prompts as `rows`."""

    @functools.wraps(command)
    def with_rows(*args, prompts, limit, skip, **kwargs):
        from dspark_common.prompts import demo_prompts_path, read_prompts

        return command(*args, rows=read_prompts(prompts or demo_prompts_path(), limit, skip), **kwargs)

    options = [
        click.option("--prompts", type=click.Path(dir_okay=False, exists=True), default=None,
                     help="JSON-lines prompts (default: the demo's)."),
        click.option("--limit", type=click.IntRange(min=1), default=None, help="Prompts per domain at most."),
        click.option("--skip", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Leave out the first SKIP prompts of each domain."),
    ]
    for option in reversed(options):
        with_rows = option(with_rows)
    return with_rows


def parse_size(text: str, option: str) -> int:
    """"4GiB", "512MB", "1.5G", "2000000" -> bytes (K/M/G/T are powers of 1024); `option` names it in errors."""
    cleaned = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(cleaned[-1:], 1)
    try:
        value = int(float(cleaned[:-1] if scale > 1 else cleaned) * scale)
    except ValueError:
        raise DSparkError(f"{option} {text!r} is not a size (e.g. 4GiB, 512MB)") from None
    if value < 1:
        raise DSparkError(f"{option} must be positive (got {text!r})")
    return value
