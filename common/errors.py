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


def read_json_file(file: Path, error: type[DSparkError] = DSparkError) -> dict:
    """A JSON object from `file`, or `error` saying the file is missing or not valid JSON."""
    if not file.is_file():
        raise error(f"no {file.name} in {file.parent}")
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise error(f"{file} does not hold a JSON object")
    return value
