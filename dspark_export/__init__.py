"""DSpark exporter: targets (Qwen3, Qwen2.5, Llama-3.x) and drafters in torch, ONNX graph building, the
`dspark-export` CLI, and engines built on first use (`demo_engine()`, `model_engine(FILE)`)."""

from dspark_export.checkpoint import Checkpoint
from dspark_export.config import DecoderConfig
from dspark_export.cached_engines import demo_engine, model_engine
from dspark_export.presets import KNOWN_TARGETS, TargetSpec, resolve_target

__all__ = ["Checkpoint", "KNOWN_TARGETS", "DecoderConfig", "TargetSpec", "demo_engine", "model_engine",
           "resolve_target"]
