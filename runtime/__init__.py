"""DSpark runtime: numpy + ONNX Runtime (or TensorRT), never torch.

    from dspark_runtime import Engine, SamplingParams
    engine = Engine.load()  # the bundled demo
    out = engine.generate("def add(a, b):", SamplingParams(max_tokens=64, temperature=0.0), spec="fixed:4")
"""

from importlib import import_module
from typing import Any

# public name -> its module: imported on first use, so that `dspark_runtime.errors` (which the exporter imports)
# does not load the engine, ONNX Runtime and the tokenizer
_EXPORTS = {
    "ChatTokenizer": "tokenizer",
    "Completion": "engine",
    "DSparkError": "errors",
    "Delta": "output",
    "Engine": "engine",
    "InvalidRequestError": "errors",
    "MissingDependencyError": "errors",
    "OrtBackend": "backend",
    "Request": "engine",
    "SamplingParams": "sampling",
    "TokenizerError": "errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dspark_runtime' has no attribute {name!r}")
    return getattr(import_module(f"dspark_runtime.{_EXPORTS[name]}"), name)
