"""DSpark runtime: numpy + ONNX Runtime (or TensorRT), never torch."""

from dspark_runtime.errors import CheckpointError, ConfigError, DSparkError, MissingDependencyError, TokenizerError
from dspark_runtime.tokenizer import ChatTokenizer

__all__ = [
    "ChatTokenizer",
    "CheckpointError",
    "ConfigError",
    "DSparkError",
    "MissingDependencyError",
    "TokenizerError",
]
