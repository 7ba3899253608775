"""The one exception hierarchy of DSpark, the runtime's and the exporter's: CLIs turn these into one clear
line, never a traceback."""

import json
from pathlib import Path


class DSparkError(Exception):
    """Base of every error DSpark raises on purpose."""


class TokenizerError(DSparkError):
    """A tokenizer or chat template that cannot be loaded or rendered."""


class MissingDependencyError(DSparkError):
    """An optional backend is not installed; the message names the extra that brings it."""


class InvalidRequestError(DSparkError):
    """A request that cannot run (bad sampling parameters, a prompt that does not fit)."""


class ConfigError(DSparkError):
    """A model or drafter configuration that DSpark cannot run (unknown preset, unsupported architecture)."""


class CheckpointError(DSparkError):
    """A checkpoint that is missing, incomplete, corrupt or does not match its configuration."""


class EngineError(DSparkError):
    """An engine directory that is missing, stale, altered or corrupt."""


def read_json_file(file: Path, error: type[DSparkError] = DSparkError, remedy: str | None = None) -> dict:
    """A JSON object from `file`, or one `error` line naming the file, what is wrong with it and (given) the remedy:
    the one JSON reader of configs, manifests and the files profiling and calibration write."""
    tail = f"; {remedy}" if remedy else ""
    if not file.is_file():
        raise error(f"no {file.name} in {file.parent}{tail}")
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, RecursionError, OSError) as exc:  # bad JSON or UTF-8, too deep, unreadable
        raise error(f"{file} is corrupt (not valid JSON: {str(exc)[:80]}){tail}") from None
    if not isinstance(value, dict):
        raise error(f"{file} is corrupt (not a JSON object){tail}")
    return value
