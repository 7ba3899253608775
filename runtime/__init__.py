"""DSpark runtime: numpy + ONNX Runtime (or TensorRT), never torch.

    from dspark_runtime import Engine, SamplingParams
    engine = Engine.load()  # the bundled demo
    out = engine.generate("def add(a, b):", SamplingParams(max_tokens=64, temperature=0.0), spec="fixed:4")
"""

from dspark_runtime.engine import Completion, Engine, Request
from dspark_runtime.errors import DSparkError, MissingDependencyError, TokenizerError
from dspark_runtime.output import Delta
from dspark_runtime.sampling import InvalidRequestError, SamplingParams
from dspark_runtime.tokenizer import ChatTokenizer

__all__ = [
    "ChatTokenizer",
    "Completion",
    "DSparkError",
    "Delta",
    "Engine",
    "InvalidRequestError",
    "MissingDependencyError",
    "Request",
    "SamplingParams",
    "TokenizerError",
]
