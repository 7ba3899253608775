"""DSpark runtime: numpy + ONNX Runtime, never torch (a TensorRT runner is not written yet).

    from dspark_runtime import Engine, SamplingParams
    engine = Engine.load("engines/q8")  # an engine directory (dspark_export.demo_engine() is the bundled demo's)
    out = engine.generate("def add(a, b):", SamplingParams(max_tokens=64, temperature=0.0), spec="fixed:4")
"""

from importlib import import_module
from typing import Any

# public name -> its module: imported on first use, so that naming an error class does not load the engine,
# ONNX Runtime and the tokenizer
_EXPORTS = {
    "ChatTokenizer": "dspark_common.tokenizer",
    "Completion": "dspark_runtime.engine",
    "DSparkError": "dspark_common.errors",
    "Delta": "dspark_runtime.output",
    "Engine": "dspark_runtime.engine",
    "InvalidRequestError": "dspark_common.errors",
    "MissingDependencyError": "dspark_common.errors",
    "OrtBackend": "dspark_runtime.backend",
    "Request": "dspark_runtime.engine",
    "SamplingParams": "dspark_common.sampling",
    "TokenizerError": "dspark_common.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dspark_runtime' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
