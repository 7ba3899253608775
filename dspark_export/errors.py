"""The exporter's errors: both are `DSparkError`s, so the CLIs report them as one line."""

from dspark_runtime.errors import DSparkError


class ConfigError(DSparkError):
    """A model or drafter configuration that DSpark cannot run (unknown preset, unsupported architecture)."""


class CheckpointError(DSparkError):
    """A checkpoint that is missing, incomplete, corrupt or does not match its configuration."""
