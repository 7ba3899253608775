"""The one exception hierarchy of DSpark: CLIs turn these into one clear line, never a traceback."""


class DSparkError(Exception):
    """Base of every error DSpark raises on purpose."""


class ConfigError(DSparkError):
    """A model or drafter configuration that DSpark cannot run (unknown preset, unsupported architecture)."""


class CheckpointError(DSparkError):
    """A checkpoint that is missing, incomplete, corrupt or does not match its configuration."""


class TokenizerError(DSparkError):
    """A tokenizer or chat template that cannot be loaded or rendered."""


class MissingDependencyError(DSparkError):
    """An optional backend is not installed; the message names the extra that brings it."""
